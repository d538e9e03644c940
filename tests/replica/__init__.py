"""Tests of nonstop/replica/."""
