"""Tests of nonstop/train/."""
