"""Smoke test of ``benchmarks/bench_gpu_capture.py --device cpu --quick`` (the figures it is for
need a GPU: scripts/gpu_check.sh runs it on a lent one): every contender of the training loop ran
and reported a step time, and the bandwidth part measured all three copies::

    .venv/bin/python -m pytest -q tests/bench/test_bench_gpu_capture_smoke.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_benchmark_quick

pytestmark = pytest.mark.bench  # a benchmark script's smoke run: `make test-bench`


@pytest.mark.timeout(180)
def test_bench_gpu_capture_quick_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-capture-quick.json"
    report = run_benchmark_quick("bench_gpu_capture", out, "--device", "cpu", timeout=170)
    assert report["device"] == "cpu"
    bw = report["bandwidth"]
    assert bw["bytes"] > 0 and min(bw["pinned_gbps"], bw["pageable_gbps"], bw["nonstop_gbps"]) > 0
    (loop,) = report["loops"]
    assert loop["errors"] == {}, loop["errors"]
    assert loop["none"]["step_ratio"] == 1.0
    for c in ("nonstop", "nonstop_deep", "nonstop_sync", "dcp_stage"):
        assert loop[c]["median_step_s"] > 0 and loop[c]["step_ratio"] > 0, c
        assert len(loop[c]["steps_s"]) == loop["steps_per_contender"] > 0, c  # the simulator's samples
        phases = loop[c]["phases_s"]
        assert set(phases) == {"enqueue", "fence", "opt", "snapshot", "item"}, c
        assert all(len(v) == len(loop[c]["steps_s"]) for v in phases.values()), c
        for i, step in enumerate(loop[c]["steps_s"]):  # the phases are parts of the step
            assert sum(v[i] for v in phases.values()) == pytest.approx(step, rel=1e-6), c
    assert loop["nonstop_sync"]["median_host_s"] > 0  # it copied on the caller's thread
    assert "copier" not in loop["nonstop"]  # CPU tensors: no paced device copies to time
