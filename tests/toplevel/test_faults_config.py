"""Fault specs, configs and pure policies (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nonstop.config import DetectorConfig, WorkerEnv, job_config_from_flat
from nonstop.errors import UsageError
from nonstop.faults import FaultInjector, FaultSpec, parse_fault
from nonstop.policy.decisions import (
    FailureKind,
    RankObservation,
    classify_exit,
    committed_step,
    find_hung_ranks,
)
from nonstop.policy.reconfiguration import Failure, Reconfiguration, Stage, next_stage


@pytest.mark.parametrize(
    "text,expect",
    [
        ("kill:rank=1,step=10", FaultSpec(kind="kill", rank=1, step=10)),
        ("hang:rank=0,step=0", FaultSpec(kind="hang", rank=0, step=0)),
        ("exit:rank=2,step=5,code=3", FaultSpec(kind="exit", rank=2, step=5, code=3)),
        ("kill:rank=2,step=5,at=recovery", FaultSpec(kind="kill", rank=2, step=5, at="recovery")),
        ("slow:rank=0,step=3,seconds=1.5", FaultSpec(kind="slow", rank=0, step=3, seconds=1.5)),
    ],
)
def test_parse_fault(text: str, expect: FaultSpec) -> None:
    assert parse_fault(text) == expect
    assert parse_fault(expect.to_text()) == expect


@pytest.mark.parametrize(
    "text",
    [
        "kill",
        "boom:rank=1,step=1",
        "kill:rank=1",
        "kill:rank=x,step=1",
        "kill:rank=-1,step=1",
        "kill:rank=1,step=1,code=2",
        "exit:rank=1,step=1,code=300",
        "kill:rank=1,step=1,at=never",
        "kill:rank=1,rank=2,step=1",
        "kill:rank=1,step=1,color=red",
    ],
)
def test_bad_fault_specs_say_what_is_expected(text: str) -> None:
    with pytest.raises(UsageError, match="bad fault spec"):
        parse_fault(text)


def test_fault_fires_once_per_job(tmp_path: Path) -> None:
    faults = [FaultSpec(kind="kill", rank=1, step=4)]
    first = FaultInjector(faults, tmp_path)
    second = FaultInjector(faults, tmp_path)  # the replacement worker, same job dir
    assert first.due(rank=0, step=4, phase="step") is None
    assert first.due(rank=1, step=3, phase="step") is None
    assert first.due(rank=1, step=4, phase="step") == (0, faults[0])
    assert second.due(rank=1, step=4, phase="step") is None


def test_recovery_phase_fault_fires_at_or_after_step(tmp_path: Path) -> None:
    inj = FaultInjector([FaultSpec(kind="kill", rank=2, step=5, at="recovery")], tmp_path)
    assert inj.due(rank=2, step=7, phase="step") is None
    assert inj.due(rank=2, step=4, phase="recovery") is None
    assert inj.due(rank=2, step=7, phase="recovery") is not None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"nproc_per_node": 0}, "nproc-per-node must be >= 1"),
        ({"spares": -1}, "spares must be >= 0"),
        ({"port": 70000}, "port must be in 0..65535"),
    ],
)
def test_job_config_rejects_bad_values(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        job_config_from_flat({"script": "x.py", **kwargs})


def test_detector_config_rejects_timeout_below_interval() -> None:
    with pytest.raises(UsageError, match="heartbeat timeout must be greater"):
        DetectorConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=0.2)


def test_worker_env_outside_launcher_says_how_to_start() -> None:
    with pytest.raises(UsageError, match="start the script with `nonstop run SCRIPT`"):
        WorkerEnv.from_environ({})


def test_committed_step_is_newest_common_step() -> None:
    assert committed_step({0: [4, 5], 1: [4, 5], 2: [3, 4]}, 3) == 4
    assert committed_step({0: [4, 5], 1: [5, 6]}, 2) == 5
    assert committed_step({0: [4, 5], 1: []}, 2) is None
    assert committed_step({0: [1]}, 2) is None  # rank 1 has nothing


def _obs(
    hb: float, prog: float, coll: bool = False, stepped: bool = True, moving: bool = False
) -> RankObservation:
    return RankObservation(
        last_heartbeat=hb, last_progress=prog, collective_pending=coll, stepped=stepped, moving=moving
    )


def test_silent_heartbeat_is_a_hang() -> None:
    cfg = DetectorConfig(heartbeat_timeout_s=1.0)
    hung = find_hung_ranks({0: _obs(9.5, 9.5), 1: _obs(8.9, 9.5)}, now=10.0, median_step_s=0.1, config=cfg)
    assert list(hung) == [1] and "no heartbeat" in hung[1]


def test_a_rank_before_its_first_step_may_be_silent_longer() -> None:
    # its first step pays lazy initialisation with the GIL held: on a saturated machine the
    # heartbeat thread starved past 1 s and a healthy job lost a rank before its first commit
    cfg = DetectorConfig(heartbeat_timeout_s=1.0)
    fresh = {0: _obs(6.5, 6.5, stepped=False)}
    assert not find_hung_ranks(fresh, now=10.0, median_step_s=None, config=cfg)  # 3.5 s < 10 s
    assert find_hung_ranks({0: _obs(-0.5, -0.5, stepped=False)}, now=10.0, median_step_s=None, config=cfg)
    assert find_hung_ranks({0: _obs(8.5, 8.5)}, now=10.0, median_step_s=0.1, config=cfg)  # once stepped: 1 s


def test_stalled_rank_is_blamed_not_its_waiting_peers() -> None:
    cfg = DetectorConfig(hang_factor=10, hang_min_s=1.0)
    obs = {0: _obs(99.9, 90.0, coll=True), 1: _obs(99.9, 90.0, coll=False), 2: _obs(99.9, 90.0, coll=True)}
    hung = find_hung_ranks(obs, now=100.0, median_step_s=0.2, config=cfg)
    assert list(hung) == [1] and "no step progress" in hung[1]


def test_every_rank_stalled_at_once_gets_a_longer_limit() -> None:
    """Found in a loaded CI run: all four ranks of a DDP job 3.2-3.4 s without a step (limit 3 s),
    none in a collective, and the whole job was killed. One hung rank leaves its peers in a
    collective; all stalled at once is the machine, so the limit is JOB_STALL_FACTOR x longer."""
    cfg = DetectorConfig(hang_factor=10, hang_min_s=3.0)
    everyone = {0: _obs(99.9, 96.0), 1: _obs(99.9, 96.5)}
    assert not find_hung_ranks(everyone, now=100.0, median_step_s=0.1, config=cfg)  # 4 s < 9 s
    longer = {0: _obs(99.9, 90.0), 1: _obs(99.9, 96.5)}
    late = find_hung_ranks(longer, now=100.0, median_step_s=0.1, config=cfg)
    assert list(late) == [0] and "limit 9.00s" in late[0]  # past 3 x 3 s: still found
    # one rank out of a collective while its peer waits in one: that rank, at the usual limit
    one = {0: _obs(99.9, 96.0), 1: _obs(99.9, 96.0, coll=True)}
    assert list(find_hung_ranks(one, now=100.0, median_step_s=0.1, config=cfg)) == [0]
    # a silent rank is not a stalled one: the others keep the usual limit
    silent = {0: _obs(99.9, 96.0), 1: _obs(97.0, 96.0)}
    assert find_hung_ranks(silent, now=100.0, median_step_s=0.1, config=cfg).keys() == {0, 1}


def test_a_rank_still_moving_gets_the_longer_limit_and_a_stuck_one_does_not() -> None:
    """Found in CI: a stall fault on rank 1 with a 1 s limit, two CPU burners and another test
    job beside it; rank 0 waited in the allreduce, but rank 2, starved on its way there, went
    1.17 s without a step and was killed with rank 1. A rank whose training thread still moves
    between heartbeats is slow, not stuck: JOB_STALL_FACTOR x the limit; a sleeping or blocked
    one (rank 1's stall) keeps the usual limit."""
    cfg = DetectorConfig(hang_factor=5, hang_min_s=1.0)
    seen = {
        0: _obs(99.9, 98.8, coll=True),  # waits in the allreduce
        1: _obs(99.9, 98.9),  # the stalled rank: asleep, not moving
        2: _obs(99.9, 98.83, moving=True),  # starved, still running its step
    }
    assert list(find_hung_ranks(seen, now=100.0, median_step_s=0.01, config=cfg)) == [1]
    # a rank that moves but never arrives (a loop that never ends) is still found, later
    looping = {0: _obs(99.9, 96.0, coll=True), 2: _obs(99.9, 96.5, moving=True)}
    late = find_hung_ranks(looping, now=100.0, median_step_s=0.01, config=cfg)
    assert list(late) == [2] and "limit 3.00s" in late[2]


def test_progress_limit_scales_with_median_and_has_a_floor() -> None:
    cfg = DetectorConfig(hang_factor=10, hang_min_s=3.0)
    obs = {0: _obs(99.9, 96.0)}
    assert find_hung_ranks(obs, now=100.0, median_step_s=0.1, config=cfg)  # 4s > max(1s, 3s)
    assert not find_hung_ranks(obs, now=100.0, median_step_s=0.5, config=cfg)  # 4s < 5s
    # before its first step only the (long) startup grace applies
    assert not find_hung_ranks({0: _obs(99.9, 50.0, stepped=False)}, now=100.0, median_step_s=0.1, config=cfg)


def test_classify_exit() -> None:
    assert classify_exit(-9, killed_for_hang=False) is FailureKind.KILLED
    assert classify_exit(-9, killed_for_hang=True) is FailureKind.HANG
    assert classify_exit(3, killed_for_hang=False) is FailureKind.EXIT


def test_stage_transitions_are_ordered_and_skip_nothing() -> None:
    assert next_stage(Stage.LAUNCH, launched=False, restored=True, ready=True, stepped=True) is Stage.LAUNCH
    assert next_stage(Stage.LAUNCH, launched=True, restored=False, ready=True, stepped=True) is Stage.RESTORE
    assert (
        next_stage(Stage.RESTORE, launched=True, restored=True, ready=False, stepped=False) is Stage.REBUILD
    )
    assert next_stage(Stage.REBUILD, launched=True, restored=True, ready=True, stepped=True) is Stage.DONE
    assert Stage.DONE.is_terminal and not Stage.RESUME.is_terminal


def test_reconfiguration_report_times_each_stage() -> None:
    f = Failure(
        kind="kill", rank=1, spawn_id=4, detail="signal SIGKILL", detected_at=100.05, step=7, fault_at=100.0
    )
    r = Reconfiguration(generation=2, world_size=2, failures=[f], restore_step=7)
    r.marks = {
        "detect": 100.05,
        "plan": 100.06,
        "launch": 100.07,
        "restore": 100.10,
        "rebuild": 100.15,
        "resume": 100.35,
    }
    (rec,) = r.report()
    assert rec["detect_s"] == pytest.approx(0.05)
    assert rec["stages"]["restore"] == pytest.approx(0.03)
    assert rec["training_again_s"] == pytest.approx(0.15)
    assert rec["mttr_s"] == pytest.approx(0.35)
    assert sum(rec["stages"].values()) == pytest.approx(rec["mttr_s"])


def test_stages_of_an_earlier_failure_include_the_interrupted_attempt() -> None:
    first = Failure(kind="kill", rank=1, spawn_id=1, detail="", detected_at=10.0, step=3, fault_at=9.9)
    second = Failure(kind="kill", rank=2, spawn_id=2, detail="", detected_at=10.4, step=3)
    r = Reconfiguration(generation=3, world_size=3, failures=[first, second], restore_step=3, replans=1)
    r.marks = {
        "detect": 10.4,
        "plan": 10.41,
        "launch": 10.42,
        "restore": 10.5,
        "rebuild": 10.6,
        "resume": 10.9,
    }
    rec1, rec2 = r.report()
    assert rec1["stages"]["replan"] == pytest.approx(0.4) and rec2["stages"]["replan"] == 0
    for rec in (rec1, rec2):
        assert sum(rec["stages"].values()) == pytest.approx(rec["mttr_s"])
