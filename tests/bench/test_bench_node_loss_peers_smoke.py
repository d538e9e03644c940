"""Smoke tests of ``benchmarks/bench_node_loss_peers.py --quick``: the same node loss (2 nodes x 2
ranks, the last node SIGKILLed) recovered by nonstop, torchrun + DCP and, where the benchmark-only
torchft is installed, torchft; and the same as HSDP (``--mesh``) by nonstop and torchrun + DCP;
every figure of the report is there and nothing is left running (~1.5 minutes each, plus ~30 s for
torchft, on two cores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_benchmark_quick

# a benchmark script's smoke run of a minute or more: `make test-bench`, by hand (not CI)
pytestmark = [pytest.mark.bench, pytest.mark.manual]

FIGURES = ("survivors_resume_s", "replacement_participates_s", "full_participation_s")


def _only_run(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report["contenders"][name]
    assert entry["summary"]["runs_ok"] == len(entry["runs"]) == 1, entry["runs"]
    run: dict[str, Any] = entry["runs"][0]
    for key in FIGURES:
        assert run[key] > 0, (name, key, run[key])
    assert run["survivors_resume_s"] <= run["full_participation_s"]
    assert run["replacement_participates_s"] <= run["full_participation_s"]
    return run


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_node_loss_peers_quick_nonstop_and_torchrun_dcp(tmp_path: Path) -> None:
    report = run_benchmark_quick(
        "bench_node_loss_peers",
        tmp_path / "peers.json",
        "--contenders",
        "nonstop,torchrun_dcp",
        timeout=410,
    )
    cfg = report["config"]
    ns = _only_run(report, "nonstop")
    assert ns["lost_steps"] == 0 and ns["ranks_lost"] == 2 and ns["left_behind"] == 0
    dcp = _only_run(report, "torchrun_dcp")
    # every rank restarts from the newest DCP checkpoint completed before the fault
    assert dcp["restore_step"] == [dcp["newest_ckpt_done_before_fault"]]
    assert dcp["lost_steps"] == cfg["fault_step"] - dcp["restore_step"][0]
    assert dcp["node_dead_confirmed"] and dcp["returncodes"] == [0, 0]
    assert dcp["left_behind"] == 0
    ratio = report["ratios"]["full_participation_s:torchrun_dcp/nonstop"]
    assert ratio["per_round"]["n"] == 1 and ratio["of_medians"] > 0
    assert report["machine"]["cpu_count"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_node_loss_peers_quick_hsdp(tmp_path: Path) -> None:
    """``--mesh replicate=2,shard=2``: each node is one replica group; nonstop's spares take the lost
    one's shards from peer replicas, torchrun's restarted ranks reshard-load DCP; torchft is left out."""
    report = run_benchmark_quick(
        "bench_node_loss_peers", tmp_path / "peers.json", "--mesh", "replicate=2,shard=2", timeout=410
    )
    assert report["config"]["mesh"] == "replicate=2,shard=2"
    assert list(report["contenders"]) == ["nonstop", "torchrun_dcp"]
    ns = _only_run(report, "nonstop")
    assert ns["lost_steps"] == 0 and ns["ranks_lost"] == 2 and ns["left_behind"] == 0
    dcp = _only_run(report, "torchrun_dcp")
    assert dcp["restore_step"] == [dcp["newest_ckpt_done_before_fault"]] and dcp["left_behind"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_node_loss_peers_quick_torchft(tmp_path: Path) -> None:
    pytest.importorskip("torchft")  # a benchmark-only extra
    report = run_benchmark_quick(
        "bench_node_loss_peers", tmp_path / "peers.json", "--contenders", "torchft", timeout=290
    )
    ft = _only_run(report, "torchft")
    assert ft["lost_steps"] == 0
    assert ft["lost_node_returncodes"] == [-9, -9] and ft["node_dead_confirmed"]
    assert ft["returncodes"] == [0, 0, 0, 0] and ft["left_behind"] == 0
    assert ft["quorum_sizes_after_fault"] == [1, 2]  # survivors alone, then with the replacement
    assert report["config"]["torchft"]
