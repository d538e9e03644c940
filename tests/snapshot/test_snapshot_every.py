"""``--snapshot-every K``: a rank snapshots every K-th step, the run's last step and a swap's
boundary; the committed step moves only with a snapshot; a failure redoes the uncommitted steps
and the result is still bitwise that of an uninterrupted run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from nonstop.cli.flags.snapshot import snapshot_args, snapshot_config
from nonstop.config import ENV, JobConfig, SnapshotConfig, WorkerEnv
from nonstop.coordinator.view import JobView
from nonstop.errors import UsageError
from nonstop.protocol import wire
from nonstop.train.snapshots import LoopSnapshots
from tests.conftest import events_named, run_nodes_job


def _worker_env(tmp_path: Path, every: str | None) -> dict[str, str]:
    secret = tmp_path / "secret"
    secret.write_text("s")
    env = {ENV.JOB_ID: "j", ENV.CONTROL: "127.0.0.1:1", ENV.SECRET_FILE: str(secret)}
    if every is not None:
        env[ENV.SNAPSHOT_EVERY] = every
    return env


def test_a_bad_interval_fails_at_start_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--snapshot-every must be >= 1"):
        JobConfig(script="x", snapshot=SnapshotConfig(every=0))
    for bad in ("0", "-3", "four"):
        with pytest.raises(UsageError, match="NONSTOP_SNAPSHOT_EVERY"):
            WorkerEnv.from_environ(_worker_env(tmp_path, bad))
    assert WorkerEnv.from_environ(_worker_env(tmp_path, None)).snapshot_every == 1
    assert WorkerEnv.from_environ(_worker_env(tmp_path, "8")).snapshot_every == 8


def test_the_command_line_reaches_the_config() -> None:
    p = argparse.ArgumentParser()
    snapshot_args(p)
    assert (
        JobConfig(
            script="x", snapshot=snapshot_config(p.parse_args(["--snapshot-every", "5"]))
        ).snapshot.every
        == 5
    )
    assert snapshot_config(p.parse_args([])).every == 1
    assert snapshot_config(p.parse_args(["--rescue-wait", "5"])).rescue_wait_s == 5.0
    with pytest.raises(UsageError, match="--rescue-wait must be between 0 and 60"):
        JobConfig(script="x", snapshot=SnapshotConfig(rescue_wait_s=-1.0))


def test_due_steps_are_the_kth_the_last_and_a_boundary(tmp_path: Path) -> None:
    every4 = LoopSnapshots(WorkerEnv.from_environ(_worker_env(tmp_path, "4")))
    due = [s for s in range(1, 13) if every4.due(s, final=False, pause_at=None)]
    assert due == [4, 8, 12]
    assert every4.due(10, final=True, pause_at=None)  # the run's last step: its result is restorable
    assert every4.due(6, final=False, pause_at=6)  # a swap's boundary: the joiner fetches it
    assert every4.due(7, final=False, pause_at=6)  # past a boundary asked late: paused there
    assert not every4.due(5, final=False, pause_at=6)
    every1 = LoopSnapshots(WorkerEnv.from_environ(_worker_env(tmp_path, None)))
    assert all(every1.due(s, final=False, pause_at=None) for s in range(1, 20))


def test_an_unsnapshotted_step_is_progress_not_a_committed_step() -> None:
    got = wire.decode_worker({"t": "step", "gen": 1, "step": 5, "step_s": 0.1, "snapped": False})
    assert isinstance(got, wire.Step) and not got.snapped and not got.again
    old = wire.decode_worker({"t": "step", "gen": 1, "step": 5, "step_s": 0.1})  # a worker of before K
    assert isinstance(old, wire.Step) and old.snapped
    again = wire.decode_worker({"t": "step", "gen": 1, "step": 6, "step_s": 0.0, "again": True})
    assert isinstance(again, wire.Step) and again.again
    v = JobView(job_id="j", world_size=2)
    v.latest_step, v.reached_step = {0: 4, 1: 4}, {0: 7, 1: 6}
    v.rewind(4)  # a recovery back to the committed step: later progress is void
    assert v.reached_step == {0: 4, 1: 4}
    v.reached_step = {0: 9, 1: 9, 2: 9}
    v.renumber({0: 0, 2: 1}, 2)
    assert v.reached_step == {0: 9, 1: 9}


@pytest.mark.slow
def test_failures_and_a_migration_between_snapshots_are_bitwise(tmp_path: Path, reference_hash: str) -> None:
    """K beyond the run's length: only step 0, the migration's boundary and the last step are
    ever snapshotted, so the boundary is snapshotted because it is one (whatever step it falls
    on). Each kill is rescued (train/rescue.py): the survivors write the state after the step
    they completed, the spare takes a survivor's, and only the step in flight is redone; with
    rescues off (``rescue_wait_s=0``) a kill before the boundary goes back to step 0. The second kill
    is at step 14: the boundary is 3 steps past the newest step reported when the migration is
    asked for, and under a CPU load that was step 11, the step of an earlier version's kill (the
    failure then ended the swap's generation and the migration was reported aborted)."""
    faults = ("kill:rank=0,step=2", "migrate:rank=1,step=5,to=2", "kill:rank=2,step=14")
    # a wait long enough for a saturated machine: a survivor's report of the rescue must come in
    run = run_nodes_job(
        tmp_path / "job", nnodes=3, spares=1, snapshot_every=1000, faults=faults, rescue_wait_s=30.0
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    (done,) = events_named(run.events, "migration_done")
    boundary = int(done["boundary"])
    assert 5 < boundary < 14
    first, second = run.result.failures
    # killed at the start of step 2 (0-based): the survivors were in step 2, rescued the state after 2
    assert first["restore_step"] == 2 and first["redone_steps"] <= 1 and first["lost_steps"] == 0
    assert first["replacement"] == "spare"
    assert second["restore_step"] == 14 and second["lost_steps"] == 0 and second["redone_steps"] <= 1
    # only snapshotted steps (the rescued ones among them) were ever committed, and so replicated
    replicated = {e["step"] for e in events_named(run.events, "replicated")}
    assert replicated and replicated <= {0, 2, boundary, 14, 16}, replicated


@pytest.mark.slow
def test_without_rescues_a_kill_goes_back_to_the_last_snapshot(tmp_path: Path, reference_hash: str) -> None:
    run = run_nodes_job(
        tmp_path / "job",
        nnodes=3,
        spares=1,
        snapshot_every=1000,
        faults=("kill:rank=0,step=4",),
        rescue_wait_s=0.0,
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    (failure,) = run.result.failures
    assert failure["restore_step"] == 0 and 4 <= failure["redone_steps"] <= 5 and failure["lost_steps"] == 0
