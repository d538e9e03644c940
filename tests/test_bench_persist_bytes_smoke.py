"""Smoke test of ``benchmarks/bench_persist_bytes.py --quick``: a tiny 3-rank job run by this tree and
by the tree before shared chunks (a git worktree) trains the same weights; this tree writes about a
third of the bytes, and its last checkpoint's chunks, counted per rank, are exactly what the old
tree wrote. About 40 s on two cores::

    .venv/bin/python -m pytest -q tests/test_bench_persist_bytes_smoke.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(300)
def test_bench_persist_bytes_quick(tmp_path: Path) -> None:
    out = tmp_path / "persist-bytes-quick.json"
    report = run_benchmark_quick("bench_persist_bytes", out, timeout=290)
    assert report["benchmark"] == "persist-bytes" and report["config"]["quick"] is True
    s = report["summary"]
    assert s["ratio_per_rank_to_shared"]["median"] > 2.5  # 3 ranks: nearly 3x
    shared, per_rank = s["last_checkpoint_shared"], s["last_checkpoint_per_rank"]
    assert shared["version"] == 2 and per_rank["version"] == 1
    assert shared["every_rank_own_bytes"] == per_rank["stored_bytes"]
