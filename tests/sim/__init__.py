"""Tests of nonstop/sim/."""
