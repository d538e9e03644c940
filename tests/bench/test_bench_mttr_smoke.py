"""Smoke test of ``benchmarks/bench_mttr.py --quick``: every contender recovers and reports an MTTR.

Runs the benchmark's quick mode (tiny model, 3 ranks, one run of each contender) into a
temporary directory, about a minute on two cores. Run it with::

    .venv/bin/python -m pytest -q tests/bench/test_bench_mttr_smoke.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_mttr_quick(tmp_path: Path) -> None:
    out = tmp_path / "mttr.json"
    report = run_benchmark_quick("bench_mttr", out, "--work-dir", str(tmp_path / "work"), timeout=230)
    contenders = report["contenders"]
    assert set(contenders) == {"nonstop_hot", "nonstop_cold", "torchrun_ckpt"}
    for name, c in contenders.items():
        runs = c["runs"]
        assert runs and all(r["ok"] for r in runs), (name, runs)
        assert all(r["mttr_s"] > 0 for r in runs), (name, runs)
        assert c["summary"]["mttr_s"]["median"] > 0
    for name in ("nonstop_hot", "nonstop_cold"):
        assert all(r["lost_steps"] == 0 for r in contenders[name]["runs"]), contenders[name]["runs"]
    base = contenders["torchrun_ckpt"]["runs"][0]
    w = report["workload"]
    assert base["lost_steps"] == w["fault_step"] - (w["fault_step"] // w["ckpt_every"]) * w["ckpt_every"]
    assert report["ratios"]["torchrun_ckpt/nonstop_hot"]["median"] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_mttr_quick_sharded(tmp_path: Path) -> None:
    """FSDP2 on 2 ranks: nonstop against torchrun + DCP async_save (sharded state needs DCP)."""
    out = tmp_path / "mttr.json"
    args = ("--mesh", "shard=2", "--nproc", "2", "--work-dir", str(tmp_path / "work"))
    report = run_benchmark_quick("bench_mttr", out, *args, timeout=230)
    contenders = report["contenders"]
    assert contenders["torchrun_ckpt"]["label"] == "torchrun + DCP async"
    for name, c in contenders.items():
        assert c["runs"] and all(r["ok"] for r in c["runs"]), (name, c["runs"])
    assert all(r["lost_steps"] == 0 for r in contenders["nonstop_hot"]["runs"])
    assert report["workload"]["mesh"] == "shard=2"
    assert report["ratios"]["torchrun_ckpt/nonstop_hot"]["median"] > 0
