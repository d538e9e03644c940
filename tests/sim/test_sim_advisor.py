"""The advisor's snapshot intervals: the fixed few, and Daly's optimum for this job's stall and MTBF."""

from __future__ import annotations

from nonstop.sim.advisor import MAX_SNAPSHOT_EVERY, snapshot_intervals
from nonstop.sim.api import JobSpec
from nonstop.sim.calibrate import Calibration
from nonstop.sim.engine import simulate
from nonstop.sim.failures import FailureModel, preset
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.theory import daly_interval

CAL = Calibration()


def test_the_intervals_tried_include_dalys_optimum_its_half_and_its_double() -> None:
    job = JobSpec(num_gpus=1024)
    model = preset("llama3")
    stall = CAL.snapshot_stall_s(job.state_bytes_per_gpu, job.step_s)
    k = daly_interval(ckpt_s=stall, mtbf_s=1 / model.job_rate_per_s(job.num_nodes)) / job.step_s
    assert 10 < k < MAX_SNAPSHOT_EVERY / 4  # a job of 128 nodes fails about every two days
    got = snapshot_intervals(job, model, CAL)
    assert {1, 2, 4, 8, round(k / 2), round(k), round(2 * k)} == set(got) and got == sorted(got)


def test_a_job_that_never_fails_or_never_stalls_tries_the_fixed_few_and_a_huge_mtbf_is_capped() -> None:
    job = JobSpec(num_gpus=64)
    assert snapshot_intervals(job, FailureModel(rate_per_node_day=0.0), CAL) == [1, 2, 4, 8]
    assert snapshot_intervals(job, preset("llama3"), Calibration(overlapped_stall_ratio=0.0)) == [1, 2, 4, 8]
    rare = snapshot_intervals(job, FailureModel(rate_per_node_day=1e-9), CAL)
    assert max(rare) == MAX_SNAPSHOT_EVERY


def test_where_failures_are_rare_dalys_interval_beats_the_fixed_few() -> None:
    """1,024 GPUs under llama3's rates fail about every two days; with the stall measured on an
    H200 (0.27 of a copy) Daly's interval (25 steps) gives more ETTR than every 8 steps, the
    longest the advisor tried before, and more than four times Daly's (mean of 30 draws) -- when
    a failure rolls back to the last snapshot (no rescues)."""
    job = JobSpec(num_gpus=1024, days=30)
    cal = Calibration(overlapped_stall_ratio=0.27)
    model = preset("llama3")
    tried = snapshot_intervals(job, model, cal)

    def mean_ettr(k: int) -> float:  # without rescues: a failure rolls back to the last snapshot
        params = NonstopParams(snapshot_every=k, snapshot_budget=0.0, rescue=False)
        runs = [
            simulate(job, model, Nonstop(job=job, params=params, calibration=cal), seed=s) for s in range(30)
        ]
        return sum(r.ettr for r in runs) / len(runs)

    daly = tried[-2]  # the half, the optimum, the double: the optimum is the middle one
    assert daly > 8
    assert mean_ettr(daly) > mean_ettr(8) + 2e-4
    assert mean_ettr(daly) > mean_ettr(4 * daly)


def test_with_rescues_a_longer_interval_costs_no_rollback() -> None:
    """Rescue snapshots (policy/rescue.py): a failure in memory redoes only the step in flight
    whatever the interval, so every 64 steps beats every 8 -- less stall, the same lost work --
    and the advisor tries it; without rescues the lost work grows with the interval."""
    job = JobSpec(num_gpus=16384, days=10)
    model = preset("llama3")
    assert {16, 32, 64} <= set(snapshot_intervals(job, model, CAL, rescue=True))
    assert not {16, 32, 64} & set(snapshot_intervals(job, model, CAL))

    def run(k: int, rescue: bool):  # type: ignore[no-untyped-def]
        params = NonstopParams(snapshot_every=k, rescue=rescue)
        return simulate(job, model, Nonstop(job=job, params=params, calibration=CAL), seed=0)

    r8, r64, n64 = run(8, True), run(64, True), run(64, False)
    lost = {name: r.lost_by_stage["lost_work"] for name, r in (("r8", r8), ("r64", r64), ("n64", n64))}
    assert r64.ettr > r8.ettr and lost["r64"] < 1.2 * lost["r8"]
    assert lost["n64"] > 4 * lost["r64"], lost
