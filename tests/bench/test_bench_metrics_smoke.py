"""Smoke test of ``benchmarks/bench_metrics.py --quick``: the tiny demo job unscraped and scraped
(every 0.2 s) by a separate process with the job's token; every scrape answered 200 and every
figure is there (~40 s on 2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(300)
def test_bench_metrics_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_metrics", tmp_path / "metrics.json", timeout=290)
    runs = report["runs"]
    assert [r["mode"] for r in runs] == ["off", "scraped"]
    assert all(r["ok"] and r["median_step_s"] > 0 for r in runs)
    scraped = runs[1]
    assert scraped["requests"] >= 4 and set(scraped["codes"]) == {"200"}
    assert scraped["cpu_per_scrape_ms"] > 0 and scraped["publishes"] >= 1
    assert report["summary"]["step_time_ratio"] > 0
