"""The snapshot stall the simulator charges, and where its ratio comes from (nonstop/sim/calibrate.py):
the GPU benchmark's per-step samples when there are any, the CPU's ratio otherwise; a copy longer
than the step costs the whole copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nonstop.sim.calibrate import Calibration, gpu_stall_ratio, load_calibration


def _report(*, none: list[float], nonstop: list[float], state: float = 50e9, gbps: float = 50.0) -> dict:
    case = {"state_bytes": state, "none": {"steps_s": none}, "nonstop": {"steps_s": nonstop}}
    return {"machine": {"gpu": "G"}, "bandwidth": {"nonstop_gbps": gbps}, "loops": [case]}


def test_the_ratio_is_the_mean_extra_step_over_the_copy() -> None:
    # a 1 s copy in a 2 s step; one step in four pays 0.8 s more: 0.2 s a step on average
    ratio, source = gpu_stall_ratio(_report(none=[2.0] * 4, nonstop=[2.0, 2.0, 2.0, 2.8]))
    assert ratio == pytest.approx(0.2) and "(G)" in source
    # a median would have said 0: the mean keeps the occasional whole-copy step
    assert gpu_stall_ratio(_report(none=[2.0] * 4, nonstop=[1.9] * 4))[0] == 0.0  # never negative


def test_no_ratio_from_a_step_shorter_than_the_copy_or_without_samples() -> None:
    assert gpu_stall_ratio(_report(none=[0.5] * 3, nonstop=[1.5] * 3))[0] is None  # copy 1 s > step
    old = _report(none=[2.0], nonstop=[2.0])
    for contender in ("none", "nonstop"):
        old["loops"][0][contender] = {"median_step_s": 2.0}  # a report from before the samples
    assert gpu_stall_ratio(old)[0] is None
    assert gpu_stall_ratio(None)[0] is None


def test_load_calibration_prefers_the_gpu_figure_and_falls_back_to_the_cpus(tmp_path: Path) -> None:
    stall = {"cases": [{"contenders": {"nonstop_overlapped": {"ratio_to_floor": {"median": 0.05}}}}]}
    (tmp_path / "snapshot_stall.json").write_text(json.dumps(stall))
    cpu = load_calibration(tmp_path)
    assert cpu.overlapped_stall_ratio == 0.05 and "snapshot_stall.json" in cpu.source(
        "overlapped_stall_ratio"
    )
    (tmp_path / "gpu_capture.json").write_text(json.dumps(_report(none=[2.0] * 2, nonstop=[2.0, 2.2])))
    gpu = load_calibration(tmp_path)
    assert gpu.overlapped_stall_ratio == pytest.approx(0.1)
    assert "gpu_capture.json" in gpu.source("overlapped_stall_ratio")


def test_a_copy_longer_than_the_step_stalls_for_the_whole_copy() -> None:
    cal = Calibration(overlapped_stall_ratio=0.05, d2h_gbps=25.0)
    assert cal.snapshot_stall_s(25e9, step_s=5.0) == pytest.approx(0.05)  # 1 s copy, 5 s step
    assert cal.snapshot_stall_s(25e9, step_s=0.5) == pytest.approx(1.0)  # the step cannot hide it
    assert cal.snapshot_stall_s(25e9) == pytest.approx(0.05)  # no step given: assumed longer
