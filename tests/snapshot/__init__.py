"""Tests of nonstop/snapshot/."""
