"""Smoke test of ``benchmarks/bench_catchup.py --quick``: whole and delta fetches over loopback and
an emulated 25 MB/s link; every figure of the report is there (~10 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(120)
def test_bench_catchup_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_catchup", tmp_path / "catchup.json", timeout=110)
    loop, capped = report["links"]
    assert loop["link_mb_s"] is None and capped["link_mb_s"] == 25
    for r in (loop, capped):
        assert r["whole_s"]["n"] == r["delta_s"]["n"] == 2  # 2 pairs x 1 rep
        assert r["delta_wire_bytes"] < r["whole_wire_bytes"] and r["delta_ratio"] > 1.0
        assert r["raw_bytes"] > 0 and r["delta_speedup"] > 0
    # the cap holds the whole step back: at 25 MB/s it takes at least (bytes - 50 ms burst) / rate
    assert capped["whole_s"]["min"] >= (capped["whole_wire_bytes"] / 25e6) - 0.05
