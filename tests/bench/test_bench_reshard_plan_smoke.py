"""Smoke test of ``benchmarks/bench_reshard_plan.py --quick``: for every resize it reports, a node
gathers at most every old rank and, at 256 ranks and more, under a quarter of them; the figures are there."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(60)
def test_bench_reshard_plan_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_reshard_plan", tmp_path / "plan.json", timeout=50)
    assert report["settings"]["quick"] and report["layouts"] > 0
    for row in report["resizes"]:
        assert 1 <= row["old_ranks_per_node_max"] <= row["old_ranks_per_node_before"] == row["old_world"]
        assert row["plan_s_median"] > 0 and row["nodes"] == -(
            -row["new_world"] // report["settings"]["per_node"]
        )
        assert 1 <= row["durable_reads_per_rank_max"] <= row["old_ranks_per_node_max"]
        if row["old_world"] >= 256:
            assert row["old_ranks_per_node_max"] < row["old_world"] / 4
