"""Smoke test of ``benchmarks/bench_survivors.py --quick``: the tiny demo job killed once with
``--survivors wait`` and ``continue``; both recover with no step lost, bitwise equal to the
reference, and every figure is there (~1 min on 2 busy cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(300)
def test_bench_survivors_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_survivors", tmp_path / "survivors.json", timeout=290)
    runs = report["runs"]
    assert [r["mode"] for r in runs] == ["wait", "continue"]
    assert all(r["ok"] and r["equal"] and r["lost_steps"] == 0 for r in runs)
    wait, cont = runs
    assert wait["shrinks"] == 0 and cont["shrinks"] == 1
    for r in runs:
        assert r["survivor_gap_steps"] > 0 and r["training_again_s"] > 0 and r["full_s"] > 0
    assert cont["grow_pause_steps"] > 0
    assert report["summary"]["continue"]["equal"] == 1
