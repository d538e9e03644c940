"""Tests of nonstop/coordinator/."""
