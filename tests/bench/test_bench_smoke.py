"""Smoke tests for the scripts in ``benchmarks/`` (they are not a package: loaded by path)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_snapshot_stall_quick(tmp_path: Path) -> None:
    bench = _load("bench_snapshot_stall")
    out = tmp_path / "snapshot_stall.json"
    rc = bench.main(["--quick", "--runs", "1", "--out", str(out), "--disk-dir", str(tmp_path / "disk")])
    assert rc == 0
    report = json.loads(out.read_text())
    (case,) = report["cases"]
    assert "skipped" not in case, case.get("skipped")
    assert case["workload"]["total_state_bytes"] > 0
    contenders = case["contenders"]
    assert contenders["floor"]["median_s"] > 0
    assert contenders["nonstop"]["median_s"] > 0, contenders["nonstop"].get("error")
    assert len(contenders["nonstop"]["runs_s"]) == 1
    assert "median" in contenders["nonstop"]["ratio_to_floor"]
