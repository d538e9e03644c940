"""``--snapshot-budget``: the interval a measured stall calls for, announced ahead to every rank
(policy/cadence.py); the worker's schedule switches at the announced step."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from nonstop.cli.flags.snapshot import snapshot_args, snapshot_config
from nonstop.config import ENV, JobConfig, SnapshotConfig, WorkerEnv
from nonstop.errors import UsageError
from nonstop.policy.cadence import (
    DEFAULT_BUDGET,
    MAX_EVERY,
    SKIP,
    WINDOW,
    Cadence,
    CadenceTuner,
    choose_every,
)
from nonstop.protocol.worker import ResumeMsg
from nonstop.train.snapshots import LoopSnapshots
from tests.conftest import events_named, run_nodes_job


def test_the_interval_is_the_smallest_within_the_budget() -> None:
    # 40 ms per snapshot, 5 s steps: 0.86 % of the time every step; within 0.1 % from K = 8 on
    assert choose_every(0.04, 5.0, budget=0.001) == 8
    assert 0.04 / 8 <= 0.001 * 5.0 < 0.04 / 7
    assert choose_every(0.04, 5.0, budget=0.01) == 1  # within the budget every step
    assert choose_every(0.04, 5.0, budget=0.01, floor=4) == 4  # never below --snapshot-every
    assert choose_every(10.0, 0.1, budget=0.001) == MAX_EVERY  # never beyond the cap
    assert choose_every(0.0, 1.0, budget=0.001) == 1
    # at most max_age_s of steps between two snapshots: 5 s steps, 30 s -> 6, though 8 fit the budget
    assert choose_every(0.04, 5.0, budget=0.001, max_age_s=30.0) == 6
    assert choose_every(0.04, 5.0, budget=0.001, max_age_s=60.0) == 8  # a bound not reached
    assert choose_every(0.04, 5.0, budget=0.001, max_age_s=1.0, floor=4) == 4  # --snapshot-every wins
    with pytest.raises(ValueError):
        choose_every(0.04, 5.0, budget=0.0)


def test_a_cadence_counts_from_its_first_step() -> None:
    c = Cadence(every=5, since=23)
    assert [s for s in range(23, 40) if c.due(s)] == [23, 28, 33, 38]
    assert [s for s in range(1, 13) if Cadence(every=4).due(s)] == [4, 8, 12]  # --snapshot-every 4
    with pytest.raises(ValueError):
        Cadence(every=0)


def _report(
    tuner: CadenceTuner,
    step: int,
    *,
    ranks: int = 2,
    stall: float = 0.04,
    step_s: float = 0.1,
    rests: tuple[str, ...] | None = None,
) -> Cadence | None:
    """Every rank's report of ``step`` (each step snapshotted by the current cadence; after step
    SKIP each rank's digest, ``rests[r]``, alike by default); the last report's answer."""
    out = None
    for r in range(ranks):
        snapped = tuner.current.due(step)
        rest = (rests[r] if rests is not None else "alike") if step == SKIP else None
        out = tuner.on_step(
            step=step,
            step_s=step_s + 0.01 * r,
            snap_s=stall if snapped else 0.0,
            snapped=snapped,
            world_size=ranks,
            rank=r,
            rest=rest,
        )
    return out


def test_the_tuner_measures_a_window_of_whole_steps_then_announces_ahead() -> None:
    tuner = CadenceTuner(budget=0.05)
    assert tuner.current.every == 1
    announced = [(s, c) for s in range(1, SKIP + WINDOW + 2) if (c := _report(tuner, s)) is not None]
    # the job's first SKIP steps are not measured; the window closes once WINDOW steps are whole
    ((at, c),) = announced
    assert at == SKIP + WINDOW - 1
    # stall 40 ms per snapshot, slowest rank's step 110 ms: 0.04 / (0.05 * 0.11) = 7.3 -> 8
    assert c.every == 8 and tuner.measured == pytest.approx((0.04, 0.11))
    assert c.since > at + 1  # ahead of the newest step reported, for every rank to hear it first
    # measured again under the new interval: the same stall per snapshot, no new announcement
    assert all(_report(tuner, s) is None for s in range(at + 1, c.since + 2 * WINDOW + 8 * WINDOW))


def test_the_tuner_keeps_the_committed_step_within_its_max_age() -> None:
    # a budget no stall fits would take the widest interval; 0.5 s of 110 ms steps allow 4
    tuner = CadenceTuner(budget=1e-6, max_age_s=0.5)
    (c,) = [c for s in range(1, SKIP + WINDOW + 2) if (c := _report(tuner, s)) is not None]
    assert c.every == 4 and c.every * tuner.measured[1] <= 0.5 < (c.every + 1) * tuner.measured[1]


def test_a_step_not_every_rank_reported_is_not_measured() -> None:
    tuner = CadenceTuner(budget=0.05)
    for s in range(1, 60):  # rank 1 never reports (it failed): no window closes
        assert tuner.on_step(step=s, step_s=0.1, snap_s=0.04, snapped=True, world_size=2) is None
    assert tuner.measured is None


def test_the_interval_widens_only_where_a_lost_rank_could_take_a_survivors_state() -> None:
    # seeded per rank: a rank lost between two snapshots would take the job back to the older one
    per_rank = CadenceTuner(budget=0.05)
    assert all(_report(per_rank, s, rests=("a", "b")) is None for s in range(1, 4 * WINDOW))
    assert per_rank.current == Cadence(every=1) and per_rank.refusal is not None
    assert "differ" in per_rank.refusal
    # FSDP without replicas: every rank its own copy group, nothing could stand in for it
    fsdp = CadenceTuner(budget=0.05, copy_group=lambda rank: rank)
    assert all(_report(fsdp, s) is None for s in range(1, 4 * WINDOW))
    assert fsdp.refusal is not None and "no other copy" in fsdp.refusal
    # HSDP, 2 replica groups of 2: alike within each copy group (ranks 0, 2 and 1, 3) is enough
    hsdp = CadenceTuner(budget=0.05, copy_group=lambda rank: rank % 2)
    widened = [
        c for s in range(1, 2 * WINDOW) if (c := _report(hsdp, s, ranks=4, rests=("x", "y", "x", "y")))
    ]
    assert widened and widened[0].every > 1 and hsdp.refusal is None


def test_the_digests_compared_are_of_one_step() -> None:
    """A job resumed past step SKIP, or a generation whose ranks reported at different steps
    (RNGs move every step): the tuner waits for every rank's digest of one generation's step."""
    tuner = CadenceTuner(budget=0.05)
    for s in range(1, 2 * WINDOW):  # rank 1's digest is of another step: not known yet, no verdict
        for r in range(2):
            rest = "d" if (r, s) in ((0, SKIP), (1, SKIP + 2)) else None
            assert (
                tuner.on_step(step=s, step_s=0.1, snap_s=0.04, snapped=True, world_size=2, rank=r, rest=rest)
                is None
            )
    assert tuner.refusal is None
    late = 2 * WINDOW + 1  # a new generation: both report its first step
    new = [
        tuner.on_step(
            step=s,
            step_s=0.1,
            snap_s=0.04,
            snapped=True,
            world_size=2,
            rank=r,
            rest="e" if s == late else None,
        )
        for s in range(2 * WINDOW, 4 * WINDOW)
        for r in range(2)
    ]
    assert any(c is not None and c.every > 1 for c in new)


def test_a_small_change_is_not_announced() -> None:
    tuner = CadenceTuner(budget=0.05, floor=8)
    # 7.3 -> 8: the floor already; then a stall that asks for 9 (< 25 % more): kept
    assert all(_report(tuner, s, stall=0.045) is None for s in range(1, 4 * WINDOW))
    assert tuner.current == Cadence(every=8)


def test_a_restarted_coordinator_takes_up_the_interval_its_ranks_run() -> None:
    tuner = CadenceTuner(budget=0.05, floor=2, most=64)
    assert not tuner.adopt(Cadence(every=2, since=0))  # what it runs already
    assert not tuner.adopt(Cadence(every=128, since=30))  # beyond this job's bounds: not its own
    assert tuner.adopt(Cadence(every=8, since=30)) and tuner.current == Cadence(every=8, since=30)
    assert not tuner.adopt(Cadence(every=4, since=40))  # a narrower one arms no rescue
    # measured from there on as if it had announced it: the same stall, nothing new to announce
    assert all(_report(tuner, s) is None for s in range(31, 31 + 4 * WINDOW))
    assert tuner.current == Cadence(every=8, since=30)


def test_what_a_reconnecting_rank_says_is_checked_before_it_is_taken_up() -> None:
    from types import SimpleNamespace

    from nonstop.coordinator.workers import WorkerProtocol, cadence_tuner

    emitted: list[object] = []
    unused: Any = SimpleNamespace()  # (collaborators a reconnect's cadence does not touch)
    workers = WorkerProtocol(
        view=unused,
        io=unused,
        events=SimpleNamespace(emit=emitted.append),  # type: ignore[arg-type]
        life=unused,
        cadence=cadence_tuner(JobConfig(script="x", snapshot=SnapshotConfig(budget=0.01)), None),
        snapshot_every=1,
        start=unused,
        setup=unused,
        resumes=unused,
    )
    assert workers.cadence is not None and not workers.rescues
    for bad in (None, "8", {"every": "8", "since": 3}, {"every": 0, "since": 3}, {"every": True, "since": 3},
                {"every": 8, "since": -1}, {"every": 8}, {"every": 10**6, "since": 3}):  # fmt: skip
        workers.resumed_cadence(ResumeMsg.decode({"cadence": bad}).cadence)
    assert workers.cadence.current == Cadence(every=1) and emitted == []
    workers.resumed_cadence(ResumeMsg.decode({"cadence": {"every": 8, "since": 3}}).cadence)
    assert workers.rescues and workers.cadence.current == Cadence(every=8, since=3)
    (said,) = emitted
    assert (said.every, said.since, said.stall_s) == (8, 3, None)  # type: ignore[attr-defined]


def test_the_worker_switches_at_the_announced_step(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s")
    env = {
        ENV.JOB_ID: "j",
        ENV.CONTROL: "127.0.0.1:1",
        ENV.SECRET_FILE: str(secret),
        ENV.SNAPSHOT_BUDGET: "0.01",
    }
    snaps = LoopSnapshots(WorkerEnv.from_environ(env))
    assert all(snaps.due(s, final=False, pause_at=None) for s in range(1, 10))
    assert not snaps.may_skip  # every step snapshotted: nothing to rescue on a failure
    assert snaps.announced() == Cadence(every=1)
    snaps.schedule(Cadence(every=4, since=12))
    assert snaps.may_skip  # announced: rescued from now on
    assert snaps.announced() == Cadence(every=4, since=12)  # what a reconnect tells a new coordinator
    due = [s for s in range(10, 30) if snaps.due(s, final=False, pause_at=None)]
    assert due == [10, 11, 12, 16, 20, 24, 28]
    assert snaps.due(29, final=True, pause_at=None)


def test_a_budget_reaches_the_config_and_a_bad_one_fails_at_start() -> None:
    p = argparse.ArgumentParser()
    snapshot_args(p)
    cfg = JobConfig(script="x", snapshot=snapshot_config(p.parse_args(["--snapshot-budget", "0.002"])))
    assert cfg.snapshot.budget == 0.002 and cfg.snapshot.max_age_s == 600.0
    aged = snapshot_config(p.parse_args(["--snapshot-budget", "0.002", "--snapshot-max-age", "60"]))
    assert JobConfig(script="x", snapshot=aged).snapshot.max_age_s == 60.0
    for age in (0.0, -1.0, float("inf")):
        with pytest.raises(UsageError, match="--snapshot-max-age must be > 0 seconds"):
            JobConfig(script="x", snapshot=SnapshotConfig(max_age_s=age))
    for bad in (-0.1, 1.0):
        with pytest.raises(UsageError, match="--snapshot-budget must be a fraction"):
            JobConfig(script="x", snapshot=SnapshotConfig(budget=bad))


@pytest.mark.slow
def test_a_budget_widens_the_interval_and_a_kill_after_it_is_rescued_bitwise(tmp_path: Path) -> None:
    """A real job whose budget no stall fits: the coordinator measures, announces the widest
    interval ahead, every rank switches at the announced step, and a rank killed after it is
    replaced by a spare that takes a survivor's rescued step: only the step in flight is redone
    and the final weights are those of an uninterrupted run, bit for bit."""
    steps = 40
    reference = run_nodes_job(tmp_path / "reference", nnodes=3, spares=0, steps=steps)
    assert reference.out is not None, reference.result.error
    run = run_nodes_job(
        tmp_path / "job",
        nnodes=3,
        spares=1,
        steps=steps,
        snapshot_budget=1e-6,
        faults=("kill:rank=0,step=34",),
        rescue_wait_s=30.0,  # a saturated machine's survivors must get their reports in
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference.out["final_hash"]
    (cadence,) = events_named(run.events, "snapshot_cadence")
    since = int(cadence["since"])
    # the widest interval whose steps take at most the default --snapshot-max-age (600 s)
    widest = choose_every(
        cadence["stall_s"], cadence["step_s"], budget=1e-6, max_age_s=JobConfig(script="x").snapshot.max_age_s
    )
    assert cadence["every"] == widest > 34 and SKIP + WINDOW <= since < 34, cadence
    assert cadence["stall_s"] > 0 and cadence["step_s"] > 0
    (failure,) = run.result.failures
    assert failure["restore_step"] == 34 and failure["lost_steps"] == 0 and failure["redone_steps"] <= 1
    # after the switch only its first step, the rescued one and the last were committed
    replicated = {e["step"] for e in events_named(run.events, "replicated")}
    assert {s for s in replicated if s > since} <= {34, steps}, replicated


def test_the_simulator_takes_the_interval_the_runtime_would_tune() -> None:
    from nonstop.sim.api import JobSpec
    from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams

    job = JobSpec(num_gpus=1024, days=1)  # 128 nodes, 5 s steps
    fixed = Nonstop(job=job, params=NonstopParams(stall_s=0.04, snapshot_budget=0.0))
    tuned = Nonstop(job=job, params=NonstopParams(stall_s=0.04, snapshot_budget=0.001))
    assert fixed.every == 1 and tuned.every == choose_every(0.04, 5.0, budget=0.001) == 8
    default = Nonstop(job=job, params=NonstopParams(stall_s=0.04))  # the runtime's default budget
    assert default.every == choose_every(0.04, 5.0, budget=DEFAULT_BUDGET) == 80 and default.rescues
    assert tuned.rescues and not fixed.rescues  # between two snapshots, failures are rescued
    aged = Nonstop(job=job, params=NonstopParams(stall_s=0.04, snapshot_budget=0.001, snapshot_max_age_s=30))
    assert aged.every == 6  # 30 s of 5 s steps, as the runtime's --snapshot-max-age bounds it
    assert tuned.steady_fraction < fixed.steady_fraction / 4
    # FSDP without replicas: nothing could stand in for a lost rank, the runtime keeps the interval
    fsdp = Nonstop(job=job, params=NonstopParams(stall_s=0.04, snapshot_budget=0.001, replica_nodes=128))
    assert fsdp.every == 1 and not fsdp.rescues


@pytest.mark.slow
def test_ranks_seeded_apart_keep_the_interval_and_the_job_says_why(tmp_path: Path) -> None:
    """A real job whose ranks reseed their RNG by rank: a rank lost between two snapshots could
    not take a survivor's state, so however small the budget the interval stays 1, and the
    event log says why."""
    run = run_nodes_job(
        tmp_path / "job",
        nnodes=2,
        spares=0,
        steps=40,
        snapshot_budget=1e-6,
        script_extra=("--step-delay", "0.1", "--seed-per-rank"),
    )
    assert run.out is not None, run.result.error
    (cadence,) = events_named(run.events, "snapshot_cadence")
    assert cadence["every"] == 1 and "differ" in cadence["refused"], cadence
    replicated = {e["step"] for e in events_named(run.events, "replicated")}
    assert len(replicated) > 3 and max(replicated) > SKIP + WINDOW  # still snapshotted (and replicated) on
