"""Smoke test of ``benchmarks/bench_step_cost_peers.py --quick``: plain DDP, nonstop with and without
its snapshot and, where the benchmark-only torchft is installed, torchft train the same tiny job
without a failure; every contender's pace and its excess over DDP's are in the report (~40 s, plus
~10 s for torchft, on two cores)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(300)
def test_bench_step_cost_peers_quick(tmp_path: Path) -> None:
    contenders = ["ddp", "nonstop_off", "nonstop"]
    if importlib.util.find_spec("torchft") is not None:
        contenders.insert(1, "torchft")
    report = run_benchmark_quick(
        "bench_step_cost_peers", tmp_path / "cost.json", "--contenders", ",".join(contenders), timeout=290
    )
    assert list(report["summary"]) == contenders
    (round_,) = report["rounds"]
    for name in contenders:
        run = round_[name]
        assert len(run["intervals_s"]) >= 4 and all(x > 0 for x in run["intervals_s"]), (name, run)
        entry = report["summary"][name]
        assert entry["median_interval_s"]["median"] == run["median_interval_s"] > 0
        if name != "ddp":
            ratio = run["median_interval_s"] / round_["ddp"]["median_interval_s"]
            assert entry["interval_vs_ddp"]["median"] == pytest.approx(ratio)
            extra = run["median_interval_s"] - round_["ddp"]["median_interval_s"]
            assert entry["extra_s_vs_ddp"]["median"] == pytest.approx(extra)
    assert report["workload"]["model"] == "tiny" and report["machine"]["cpu_count"] >= 1


def test_bench_step_cost_peers_refuses_unknown_contenders(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="--contenders"):
        run_benchmark_quick(
            "bench_step_cost_peers", tmp_path / "x.json", "--contenders", "deepspeed", timeout=60
        )
