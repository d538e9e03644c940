"""Tests of nonstop/policy/."""
