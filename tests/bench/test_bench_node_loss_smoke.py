"""Smoke test of ``benchmarks/bench_node_loss.py --quick``: a node loss across 2 nodes is
recovered from peer memory and every figure of the report is there (~1 minute on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_node_loss_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_node_loss", tmp_path / "node_loss.json", timeout=230)
    lay = report["layouts"]["2x2"]
    assert lay["ok_runs"] == len(lay["runs"]) == 1
    (run,) = lay["runs"]
    assert run["lost_steps"] == 0 and run["ranks_lost"] == 2
    assert run["fetches"]  # the lost node's ranks came from a peer's memory
    assert 0 < lay["training_again_s"]["median"] <= lay["mttr_s"]["median"]
    assert 0 < lay["wire_over_raw"]["median"] < 1.0
    assert report["machine"]["cpu_count"] >= 1
