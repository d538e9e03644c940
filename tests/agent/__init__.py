"""Tests of nonstop/agent/."""
