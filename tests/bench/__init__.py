"""Smoke runs of the benchmarks/ scripts (marker bench: make test-bench)."""
