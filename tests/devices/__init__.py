"""Tests of nonstop/devices/."""
