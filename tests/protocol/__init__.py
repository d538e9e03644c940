"""Tests of nonstop/protocol/."""
