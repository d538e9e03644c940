"""Tests of nonstop/timeline/."""
