"""Smoke test of ``benchmarks/bench_rescue.py --quick``: the tiny demo job killed between two
snapshots, snapshotting every step, every 8 with rescues, every 8 without; all bitwise equal to the
reference, the rescue redoing at most the step in flight and the rollback the steps since the
snapshot (~1 min on 2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench


@pytest.mark.timeout(400)
def test_bench_rescue_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_rescue", tmp_path / "rescue.json", timeout=390)
    runs = {r["contender"]: r for r in report["runs"]}
    assert set(runs) == {"every-step", "rescue", "rollback"}
    assert all(r["ok"] and r["equal"] and r["lost_steps"] == 0 for r in runs.values())
    assert runs["rescue"]["restore_step"] == 12 and runs["rescue"]["redone_steps"] <= 1
    assert runs["rollback"]["restore_step"] == 8 and runs["rollback"]["redone_steps"] >= 4
    for r in runs.values():
        assert r["survivor_gap_steps"] > 0 and r["plan_s"] >= 0 and r["step_s"] > 0
