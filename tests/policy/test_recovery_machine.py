"""The generation machine (``Reconfiguration``): pure, events in and actions out, time from the
events; the coordinator executes it (tick by tick against fake peers) and the simulator times it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nonstop.coordinator.generation_setup import GenerationSetup
from nonstop.policy import reconfiguration as recovery
from nonstop.policy.reconfiguration import (
    Failure,
    FetchDone,
    Finished,
    Joined,
    KillLaggards,
    Launched,
    Rebuild,
    Reconfiguration,
    Reconfigure,
    Restored,
    Resumed,
    Stage,
    StageEnded,
    Stepped,
    Tick,
)
from nonstop.sim import recoverysim
from nonstop.sim.recoverysim import RecoveryCosts, time_recovery
from tests.coord_fakes import Harness


def fresh(world: int = 3, **kw: Any) -> Reconfiguration:
    f = Failure(kind="killed", rank=0, spawn_id=7, detail="signal 9", detected_at=10.0, step=5, fault_at=9.5)
    r = Reconfiguration(generation=2, world_size=world, failures=[f], restore_step=4, **kw)
    r.marks["detect"], r.marks["plan"] = 10.0, 10.5
    return r


def kinds(actions: list[recovery.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_a_recovery_runs_stage_by_stage_on_the_events_times() -> None:
    r = fresh()
    r.waiting_launch.add(0)  # a cold replacement
    r.waiting_fetch.add(0)  # its node fetches the step from a peer meanwhile
    out = r.start(11.0)
    assert out == [Reconfigure(1), Reconfigure(2)] and r.stage is Stage.LAUNCH
    assert r.on_event(Launched(0, 12.0)) == []  # still fetching: not told yet
    out = r.on_event(FetchDone(0, 13.0))
    assert out == [Reconfigure(0), StageEnded(Stage.LAUNCH, 2.5, 13.0)] and r.stage is Stage.RESTORE
    for rank in (0, 1):
        assert r.on_event(Restored(rank, 14.0)) == []
    assert r.on_event(Restored(2, 15.0)) == [StageEnded(Stage.RESTORE, 2.0, 15.0), Rebuild()]
    out = [a for rank in range(3) for a in r.on_event(Joined(rank, 16.0))]
    assert out == [StageEnded(Stage.REBUILD, 1.0, 16.0), Resumed(16.0)]
    out = [a for rank in range(3) for a in r.on_event(Stepped(rank, 17.5))]
    assert kinds(out) == ["StageEnded", "Finished"] and r.stage is Stage.DONE
    [report] = out[1].reports if isinstance(out[1], Finished) else []
    assert report["mttr_s"] == pytest.approx(17.5 - 9.5)
    assert report["stages"]["launch"] == pytest.approx(2.5) and report["detect_s"] == pytest.approx(0.5)
    assert r.on_event(Stepped(0, 20.0)) == [] and r.on_event(Tick(99.0)) == []  # done: nothing more


def test_the_survivors_gap_runs_from_their_last_step_to_their_first_in_the_generation() -> None:
    r = fresh()
    r.survivors_since = {1: 9.0, 2: 9.4}  # rank 0 is the replacement: no gap of its own
    r.start(11.0)
    for rank in range(3):
        r.on_event(Restored(rank, 12.0))
    for rank in range(3):
        r.on_event(Joined(rank, 13.0))
    r.on_event(Stepped(1, 14.0))
    r.on_event(Stepped(1, 15.0))  # only a rank's first step counts
    r.on_event(Stepped(0, 16.0))
    out = r.on_event(Stepped(2, 14.2))
    [report] = out[-1].reports if isinstance(out[-1], Finished) else []
    assert r.survivor_gaps == {1: 5.0, 2: pytest.approx(4.8)}
    assert report["survivor_gap_s"] == 5.0
    r.survivor_gaps.clear()  # no survivor: no gap
    assert r.report()[0]["survivor_gap_s"] is None


def test_the_machine_is_deterministic_and_tells_a_rank_once() -> None:
    def play() -> list[recovery.Action]:
        r = fresh(world=2)
        r.waiting_launch.add(1)
        out = r.start(11.0)
        for ev in (Launched(1, 12.0), Launched(1, 12.1), Restored(0, 12.5), Restored(1, 13.0)):
            out += r.on_event(ev)
        return out

    first = play()
    assert first == play()
    assert first.count(Reconfigure(1)) == 1 and first.count(Reconfigure(0)) == 1


def test_a_stage_that_overruns_its_timeout_kills_its_laggards_once_per_period() -> None:
    r = fresh(timeout_s=5.0)
    r.start(11.0)
    assert r.stage is Stage.RESTORE  # nobody waited for a launch or a fetch
    r.on_event(Restored(1, 12.0))
    assert r.on_event(Tick(12.0)) == []  # the stage's deadline is set: 17.0
    assert r.on_event(Tick(16.9)) == []
    assert r.on_event(Tick(17.1)) == [KillLaggards((0, 2), "stage restore timed out")]
    assert r.on_event(Tick(20.0)) == []  # one kill round per period
    assert r.on_event(Tick(22.2)) == [KillLaggards((0, 2), "stage restore timed out")]
    r.on_event(Restored(0, 23.0))
    r.on_event(Restored(2, 23.0))
    assert r.stage is Stage.REBUILD and r.deadline == 0.0  # each stage gets its own period
    assert fresh(timeout_s=0.0).on_event(Tick(1e9)) == []


def test_the_simulator_times_the_machine() -> None:
    k = RecoveryCosts(launch_s=3.0, fetch_s=1.0, restore_s=0.5, rebuild_s=2.0, step_s=1.5)
    t = time_recovery(k)
    # the fetch overlaps the launch; the group waits for the replacement's restore
    assert dict(t.stages) == pytest.approx({"launch": 3.0, "restore": 0.5, "rebuild": 2.0, "resume": 1.5})
    assert [n for n, _ in t.pause] == ["launch", "restore", "rebuild"]
    assert t.actions[:3] == ("Reconfigure", "Reconfigure", "StageEnded") and t.actions[-1] == "Finished"
    slow_fetch = time_recovery(
        RecoveryCosts(launch_s=1.0, fetch_s=4.0, restore_s=0.5, rebuild_s=2.0, step_s=1.5)
    )
    assert slow_fetch.stage("launch") == pytest.approx(4.0)
    shrink = time_recovery(
        RecoveryCosts(launch_s=None, fetch_s=None, restore_s=0.5, rebuild_s=2.0, step_s=1.5)
    )
    assert shrink.stage("launch") == 0.0 and shrink.stage("restore") == pytest.approx(0.5)


def test_the_runtime_transition_decides_the_simulated_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator calls the runtime's stage transition through its module: change it, the
    simulated recovery changes (as the swap and policy tests do)."""
    k = RecoveryCosts(launch_s=1.0, fetch_s=None, restore_s=0.5, rebuild_s=2.0, step_s=1.5)
    time_recovery.cache_clear()
    before = time_recovery(k)
    real = recovery.next_stage

    def no_rebuild(stage: Stage, **done: bool) -> Stage:  # a group that needs no rebuild
        return real(stage, **{**done, "ready": True})

    monkeypatch.setattr(recovery, "next_stage", no_rebuild)
    time_recovery.cache_clear()
    after = time_recovery(k)
    time_recovery.cache_clear()
    assert before.stage("rebuild") == pytest.approx(2.0) and after.stage("rebuild") == 0.0


def test_bad_recovery_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="step_s"):
        RecoveryCosts(launch_s=1.0, fetch_s=None, restore_s=1, rebuild_s=1, step_s=0.0)
    with pytest.raises(ValueError, match="restore_s"):
        RecoveryCosts(launch_s=1.0, fetch_s=None, restore_s=-1, rebuild_s=1, step_s=1.0)
    with pytest.raises(ValueError, match="replaced rank"):
        RecoveryCosts(launch_s=None, fetch_s=1.0, restore_s=1, rebuild_s=1, step_s=1.0)


def test_the_coordinator_carries_out_the_machines_actions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recovery on the coordinator (fake peers): the actions it executed are the machine's, in
    the order the simulator sees them for the same shape of recovery (a spare, no fetch)."""
    executed: list[str] = []
    real = GenerationSetup._execute

    def spy(self: GenerationSetup, r: Reconfiguration, actions: list[recovery.Action]) -> None:
        executed.extend(type(a).__name__ for a in actions)
        real(self, r, actions)

    monkeypatch.setattr(GenerationSetup, "_execute", spy)
    h = Harness(tmp_path, nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", lease_ttl_s=60.0)
    h.add_node("0", nproc=1, spares=1)
    h.add_node("1", nproc=1, spares=1)
    h.tick()
    h.bring_up()
    h.step_all(2)
    executed.clear()
    h.exit(h.coord.view.members[1])
    h.resume_all(3)
    stages = [e["stage"] for e in h.events("stage") if e["generation"] == 2]
    assert stages == ["launch", "restore", "rebuild", "resume"]
    sim = time_recovery(RecoveryCosts(launch_s=None, fetch_s=None, restore_s=0.1, rebuild_s=0.1, step_s=0.1))
    assert executed == list(sim.actions)  # both: Reconfigure x2, launch, restore, Rebuild, ...
    assert recoverysim.REPLACED == 0 and executed.count("Reconfigure") == 2
