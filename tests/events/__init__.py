"""Tests of nonstop/events/."""
