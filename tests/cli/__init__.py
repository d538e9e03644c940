"""Tests of nonstop/cli/."""
