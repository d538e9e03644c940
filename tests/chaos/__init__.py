"""Tests of nonstop/chaos/."""
