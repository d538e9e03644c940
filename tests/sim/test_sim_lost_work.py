"""What a nonstop recovery rolls back: back to the newest snapshot whose copy had landed.

A snapshot of a step boundary is whole in host memory ``capture_s`` after the boundary (the copy
overlaps the next step), and on its peer holders ``replicas x transfer`` later still; the runtime
restores the newest step every rank has whole, so a failure just after a boundary loses the step
before it too, and one later in the step loses only the step in flight.
"""

from __future__ import annotations

import pytest

from nonstop.policy.decisions import FailureKind, Tier
from nonstop.sim.api import JobSpec
from nonstop.sim.calibrate import Calibration
from nonstop.sim.engine import simulate
from nonstop.sim.failures import Cause
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from tests.simscript import NODE_LOSS, Scripted

# no per-step cost and no stall: the job's progress is its wall time, so step boundaries are
# multiples of the step in wall time too
CAL = Calibration(nonstop_step_overhead_s=0.0)
JOB = JobSpec(num_gpus=64, days=1)  # 8 nodes, 4 GB per GPU, a 5 s step
CRASH = Cause(name="crash", weight=1, kind=FailureKind.KILLED)


def lost_s(at: float, cause: Cause, *, snapshot_every: int = 1) -> tuple[float, Nonstop]:
    """Seconds of progress one failure at ``at`` rolls back, per GPU."""
    params = NonstopParams(stall_s=0.0, snapshot_every=snapshot_every)
    strat = Nonstop(job=JOB, params=params, calibration=CAL)
    r = simulate(JOB, Scripted((at, 3), cause=cause), strat)
    return sum(v.get("lost_work", 0.0) for v in r.lost_gpu_s.values()) / JOB.num_gpus, strat


def test_the_copies_take_the_lags_the_calibration_implies() -> None:
    s = Nonstop(job=JOB, params=NonstopParams(replicas=2), calibration=CAL)
    assert s.capture == pytest.approx(4e9 / (CAL.d2h_gbps * 1e9))
    assert s.replica_lag == pytest.approx(2 * 4e9 / (CAL.peer_gbps_per_gpu * 1e9))
    assert s.describe()["capture_s"] == s.capture and s.describe()["replica_lag_s"] == s.replica_lag


def test_a_lost_node_late_in_a_step_loses_only_the_step_in_flight() -> None:
    lost, s = lost_s(10_002.0, NODE_LOSS)  # 2 s into the step after the boundary at 10,000 s
    assert s.capture + s.replica_lag < 2.0
    assert lost == pytest.approx(2.0)


def test_a_lost_node_before_its_replica_landed_loses_the_step_before_too() -> None:
    lost, s = lost_s(10_000.2, NODE_LOSS)  # the boundary's replica lands 0.32 s after it
    assert 0.2 < s.capture + s.replica_lag
    assert lost == pytest.approx(5.2)


def test_a_crash_restores_from_local_memory_which_only_waits_for_the_capture() -> None:
    """Local memory is whole ``capture`` after the boundary: 0.2 s in, the boundary's snapshot is
    there (0.16 s), though its replica is not yet."""
    lost, s = lost_s(10_000.2, CRASH)
    assert s.capture < 0.2 < s.capture + s.replica_lag
    assert lost == pytest.approx(0.2)
    early, _ = lost_s(10_000.1, CRASH)  # its copy not yet landed: back one more step
    assert early == pytest.approx(5.1)


def test_snapshotting_every_k_steps_rolls_back_to_the_last_snapshot() -> None:
    lost, _ = lost_s(10_012.0, NODE_LOSS, snapshot_every=4)  # snapshots at 10,000 and 10,020 s
    assert lost == pytest.approx(12.0)


def test_the_tier_lags_are_ordered() -> None:
    """Local memory is never behind a peer's replica, which is never behind the durable tier."""
    s = Nonstop(job=JOB, params=NonstopParams(stall_s=0.0), calibration=CAL)
    s.begin(None)  # type: ignore[arg-type]
    for work in (3_600.05, 3_600.2, 3_601.0, 5_000.0):
        s.work = work
        local, peer, durable = (s._lost(t) for t in (Tier.LOCAL, Tier.PEER, Tier.DURABLE))
        assert local <= peer <= durable
