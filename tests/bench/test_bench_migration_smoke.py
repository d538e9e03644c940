"""Smoke test of ``benchmarks/bench_migration.py --quick``: one run of each contender and one
drain of a 2-rank node; every figure of the report is there (~2.5 minutes on two cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_bench_migration_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_migration", tmp_path / "migration.json", timeout=470)
    c = report["contenders"]
    for name in ("nonstop_migrate", "nonstop_kill", "torchrun_restart", "no_event"):
        assert c[name]["ok_runs"] == 1, c[name]["runs"]
        assert c[name]["pause_ratio"]["median"] > 1.0  # a gap longer than a median step
    (run,) = c["nonstop_migrate"]["runs"]
    assert run["migration"]["rank"] == 1 and run["migration"]["target"] == "2" and run["lost_steps"] == 0
    assert run["window_pause"]["ratio"] > 1.0  # the gap during the migration, measured
    assert c["no_event"]["runs"][0]["window_pause"] is None  # no event: no window
    (drain,) = report["drain_2_ranks"]
    assert drain["ok"] and sorted(drain["ranks_moved"]) == [2, 3] and drain["lost_steps"] == 0
    assert drain["failures"] == 0 and 0 < drain["drained_s"] < report["params"]["grace"]
