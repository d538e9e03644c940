"""Smoke test of ``benchmarks/bench_silence.py --quick``: one round of the tiny 3-node job beside
CPU burners, the agent confirming silences and not. What does not depend on timing: both runs end
bitwise equal, every figure is there, and the runs say which mode they ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(400)
def test_bench_silence_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_silence", tmp_path / "silence.json", timeout=390)
    runs = report["runs"]
    assert [(r["mode"], r["fault"]) for r in runs] == [("confirm", None), ("kill", None)]
    assert all(r["ok"] and r["equal"] for r in runs)
    for r in runs:
        assert r["false_kills"] >= 0 and r["excused"] >= 0 and r["detect_s"] is None
        assert r["failures"] >= r["false_kills"]  # no fault: every false kill cost a recovery
    assert runs[1]["excused"] == 0  # --no-confirm-silence spares nobody
    assert set(report["summary"]) == {"confirm, no fault", "kill, no fault"}
    assert report["settings"]["burners"] >= 1 and report["stamp"]["commit"]
