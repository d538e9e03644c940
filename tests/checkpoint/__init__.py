"""Tests of nonstop/checkpoint/."""
