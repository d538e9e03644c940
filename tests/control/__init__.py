"""Tests of nonstop/control/."""
