"""Tests of the code base's shape: layering, docs, tiers, typed protocol, policy callers."""
