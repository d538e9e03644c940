"""Smoke test of ``benchmarks/bench_node_copy.py --quick``: one copy per node holds less than one
copy per rank at 2 ranks on a node (and for HSDP 2x2 on one node) and replicates about half the
bytes, with equal weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

# 16 short real jobs (DDP and HSDP pairs, a recovery, replication over 2 nodes): ~4 minutes on a
# quiet machine, over 9 beside a test suite run: make test-bench
pytestmark = [pytest.mark.bench, pytest.mark.manual]


@pytest.mark.timeout(1500)
def test_bench_node_copy_quick(tmp_path: Path) -> None:
    report = run_benchmark_quick("bench_node_copy", tmp_path / "node_copy.json", timeout=1440)
    (rnd,) = report["rounds"]
    assert rnd["equal-1"] and rnd["equal-2"]
    two = report["summary"]["2"]
    assert two["node"]["shm_peak_mib"]["median"] < two["rank"]["shm_peak_mib"]["median"]
    rep = report["replication_mib_per_node_and_round"]["2"]
    assert rep["node_over_rank_raw"]["median"] < 0.75
    hsdp = report["hsdp_2x2_one_node"]  # each shard once on the node: about half the memory
    assert hsdp["node_over_rank_memory"]["median"] < 0.75
