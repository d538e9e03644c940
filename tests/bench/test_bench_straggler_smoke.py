"""Smoke test of ``benchmarks/bench_straggler.py --quick``: one round of the tiny 3-node job
undisturbed, with rank 1 slowed 3x left alone (``--straggler warn``) and migrated live
(``--straggler migrate``). What does not depend on timing: every run ends bitwise equal to the
undisturbed one, the undisturbed run flags no straggler, the migrate run moved rank 1 for being a
straggler, and every figure is there (~2 min on 2 busy cores, ~3.5 at load 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(300)
def test_bench_straggler_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_straggler", tmp_path / "straggler.json", timeout=290)
    runs = report["runs"]
    assert [r["mode"] for r in runs] == ["undisturbed", "warn", "migrate"]
    assert all(r["ok"] and r["equal"] for r in runs)
    undisturbed, warn, migrate = runs
    assert undisturbed["flagged"] == [] and undisturbed["false_positives"] == 0
    assert undisturbed["migrations"] == [] and warn["migrations"] == []
    assert [(m["rank"], m["reason"]) for m in migrate["migrations"]] == [(1, "straggler")]
    assert migrate["boundary"] == migrate["migrations"][0]["boundary"] > report["settings"]["event_step"]
    for r in (warn, migrate):
        assert r["detect_steps"] is not None and r["detect_steps"] >= 0
        assert r["detect_factor"] > 1
        assert r["during_s"] > 0 and r["last10_s"] > 0 and r["total_ratio"] > 0
    assert migrate["after10_s"] > 0 and migrate["pause_ratio"] is not None
    for r in runs:
        assert r["before_s"] > 0 and r["throughput_last10"] > 0
    summary = report["summary"]
    assert summary["migrate"]["migrated"] == 1 and summary["undisturbed"]["migrated"] == 0
    assert all(summary[m]["equal"] == 1 for m in ("undisturbed", "warn", "migrate"))
    assert report["machine"]["cpu_count"] and report["stamp"]["commit"]
