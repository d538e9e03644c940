"""torchft-like: every membership change reconfigures the cross-group process group for everyone.

torchft's ``Manager._async_quorum`` calls ``_pg.configure`` with every replica whenever the quorum
id changes, so a failed group's leaving and its rejoining each make every group build a process
group over one rank of each replica group; the simulator charges that the rendezvous law nonstop's
rebuild of the same group is charged, less the forward its async quorum runs beside.
"""

from __future__ import annotations

import pytest

from nonstop.policy.decisions import FailureKind
from nonstop.sim.api import JobSpec
from nonstop.sim.calibrate import Calibration, rendezvous_s
from nonstop.sim.engine import simulate
from nonstop.sim.failures import Cause
from nonstop.sim.strategies import TorchftLike
from tests.simscript import NODE_LOSS, Scripted

CAL = Calibration(torchft_step_overhead_s=0.0)
JOB = JobSpec(num_gpus=1024, days=1)  # 128 nodes: 8 replica groups of 16 nodes
GROUP_GPUS = 16 * 8


def rebuild_gpu_s(strat: TorchftLike, cause: Cause = NODE_LOSS) -> float:
    r = simulate(JOB, Scripted((10_000.0, 3), cause=cause), strat)
    return sum(v.get("rebuild", 0.0) for v in r.lost_gpu_s.values())


def test_a_membership_change_stops_the_job_for_what_the_forward_does_not_hide() -> None:
    ft = TorchftLike(job=JOB, calibration=CAL)
    assert ft.num_groups == 8 and ft.reconfigure == rendezvous_s(8)
    assert ft.forward == pytest.approx(JOB.step_s / 3)
    assert ft.requorum == pytest.approx(CAL.quorum_s + rendezvous_s(8) - JOB.step_s / 3)
    d = ft.describe()
    assert (d["reconfigure_s"], d["requorum_s"]) == (ft.reconfigure, ft.requorum)
    hidden = TorchftLike(job=JOB, calibration=CAL, quorum_s=0.5, reconfigure_s=0.5)
    assert hidden.requorum == 0.0  # a quorum shorter than the forward costs nothing


def test_a_lost_node_costs_everyone_a_reconfiguration_when_its_group_leaves_and_when_it_rejoins() -> None:
    ft = TorchftLike(job=JOB, calibration=CAL)
    whole = ft.quorum + ft.reconfigure
    # the leaving: every GPU; the rejoining: every GPU, and the rejoining group the whole quorum
    expected = 2 * ft.requorum * JOB.num_gpus + (whole - ft.requorum) * GROUP_GPUS
    assert rebuild_gpu_s(ft) == pytest.approx(expected)


def test_a_planned_move_still_changes_the_membership_twice() -> None:
    planned = Cause(name="maintenance", weight=1, kind=FailureKind.NODE_LOST, planned=True)
    ft = TorchftLike(job=JOB, calibration=CAL)
    r = simulate(JOB, Scripted((10_000.0, 3), cause=planned), ft)
    by_stage = r.lost_by_stage
    assert by_stage["detect"] == 0 and by_stage["lost_work"] == 0
    whole = ft.quorum + ft.reconfigure
    assert by_stage["rebuild"] == pytest.approx(
        2 * ft.requorum * JOB.num_gpus + (whole - ft.requorum) * GROUP_GPUS
    )


def test_without_a_reconfiguration_only_the_rejoining_group_waits_for_its_quorum() -> None:
    """The model before this charge, spelled out: quorum 1 s, no process group to build."""
    ft = TorchftLike(job=JOB, calibration=CAL, quorum_s=1.0, reconfigure_s=0.0)
    assert ft.requorum == 0.0
    assert rebuild_gpu_s(ft) == pytest.approx(1.0 * GROUP_GPUS)
