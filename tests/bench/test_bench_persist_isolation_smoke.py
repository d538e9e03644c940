"""Smoke test of ``benchmarks/bench_persist_isolation.py --quick``: the persist thread, at nice 19
and at its process's priority, runs beside CPU burners and the loop's gaps are recorded for each
(the figures are the benchmark's, BENCHMARKS.md; here only that every mode persisted and the
report is whole). About 30 s on two cores::

    .venv/bin/python -m pytest -q tests/bench/test_bench_persist_isolation_smoke.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(300)
def test_bench_persist_isolation_quick(tmp_path: Path) -> None:
    out = tmp_path / "persist-isolation-quick.json"
    report = run_benchmark_quick("bench_persist_isolation", out, timeout=290)
    for case in ("nice19/shared", "nice0/shared", "nice19/own", "nice0/own"):
        (r,) = report["rounds"][case]
        assert r["persists"] >= 1, (case, r)  # it persisted while the loop ticked
        assert 0.01 <= r["p99_gap_s"] <= r["max_gap_s"]  # a gap is at least the tick
    assert report["nice0_over_nice19"]["own"]["max_gap_s"]["n"] == 1
    assert report["commit"] and report["machine"]["cpu_count"]
