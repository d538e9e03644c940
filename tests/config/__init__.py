"""Tests of nonstop/config/."""
