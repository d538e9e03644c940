"""Smoke test of ``benchmarks/bench_tls.py``: a 4 MB snapshot replicated and fetched, and control
round-trips, with and without TLS (seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(180)
def test_bench_tls_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_tls", tmp_path / "tls.json", timeout=170)
    for mode in ("plain", "tls"):
        r = report["modes"][mode]
        assert r["replicate_mbps"] > 0 and r["fetch_mbps"] > 0 and r["rtt_us"] > 0 and r["connect_ms"] > 0
    assert set(report["tls_over_plain"]) == {"replicate_throughput", "fetch_throughput", "rtt", "connect"}
