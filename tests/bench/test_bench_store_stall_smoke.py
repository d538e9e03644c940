"""Smoke test of ``benchmarks/bench_store_stall.py --quick``: a 3-node job on a real etcd frozen
for 1 s rides through it (nothing fenced, nothing lost, bitwise equal to the reference) and every
figure is there (~1.5 min on 2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(400)
def test_bench_store_stall_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_store_stall", tmp_path / "store_stall.json", timeout=390)
    [run] = report["runs"]
    assert run["stall_s"] == 1.0 and run["ok"] and run["equal"], run
    assert run["fenced"] == 0 and run["nodes_lost"] == 0 and run["failures"] == 0
    assert run["coordinator_restarts"] == 0 and run["lapsed"] == run["renewed"]
    assert run["wall_s"] > 0 and "steps_during_stall" in run
    assert report["longest_ridden_s"] == 1.0 and report["reference"]["ok"]
