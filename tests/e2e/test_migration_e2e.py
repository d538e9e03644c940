"""Live migration with real processes: a rank moves to a hot spare on another node while the job
trains; every rank continues from the same step and the result is bitwise equal to an
uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    STEPS,
    DemoRun,
    NodesInBackground,
    events_named,
    run_nodes_job,
    sampled_nodes_config,
)

pytestmark = pytest.mark.slow


def test_migrate_a_rank_to_another_node_bitwise(tmp_path: Path, reference_hash: str) -> None:
    """With the swap fetching the boundary as a delta against the step the catch-up brought."""
    # paced: the joiner must prepare before the other 12 steps are done, or the move is aborted
    # ("the job finished first": seen under a competing CPU load at the default 0.1 s a step)
    run = run_nodes_job(
        tmp_path / "job",
        nnodes=3,
        spares=1,
        faults=("migrate:rank=1,step=4,to=2",),
        swap_transfer="delta",
        script_extra=("--step-delay", "0.4"),
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    (done,) = events_named(run.events, "migration_done")
    assert done["rank"] == 1 and done["source"] == "1" and done["target"] == "2"
    assert done["max_step_gap_s"] is not None and done["pause_ratio"] is not None
    assert {"fetched", "prepared", "paused", "resumed"} <= set(done["stages"])
    assert run.result.failures == [] and events_named(run.events, "failure") == []
    gen = next(g for g in events_named(run.events, "generation") if g.get("migration") == 1)
    assert gen["nodes"]["1"] == "2" and gen["restore_step"] == done["boundary"]
    # nothing was rolled back: the swap generation starts where every rank stopped
    assert gen["restore_step"] > 4
    # the target caught up with a delta against the step the prepare fetch brought
    rounds = events_named(run.events, "catchup")
    assert rounds and rounds[0]["ok"] and rounds[0]["delta"], rounds
    assert rounds[0]["wire_bytes"] < rounds[0]["raw_bytes"]
    assert done["catchup_rounds"] == len(rounds) and done["swap_delta"] is True


def test_leaver_death_mid_migration_falls_back_to_recovery(tmp_path: Path, reference_hash: str) -> None:
    """The leaver dies before the swap: the migration is aborted (its joiner stopped) and ordinary
    recovery restores the rank from the replica. The joiner's prepare is held 3 s
    (``slow:...,at=prepare``) and the leaver is SIGKILLed once the migration has started, so the
    death falls inside the migration however loaded the machine is."""
    config = sampled_nodes_config(
        tmp_path / "job",
        STEPS,
        ("migrate:rank=1,step=4,to=2", "slow:rank=1,step=0,seconds=3,at=prepare"),
        nproc_per_node=1,
        spares=1,
        nnodes=3,
    )
    job = NodesInBackground(config)
    job.wait_event("migration_start", timeout=120)
    gen = job.events("generation")[-1]
    pid = next(e["pid"] for e in job.events("spawned") if e["spawn_id"] == gen["members"]["1"])
    os.kill(pid, signal.SIGKILL)
    result = job.result(timeout=300)
    assert result.error is None, result.error
    events = job.events()
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash
    (aborted,) = events_named(events, "migration_aborted")
    assert aborted["rank"] == 1 and "failed" in aborted["error"]
    assert events_named(events, "migration_done") == []
    (f,) = result.failures
    assert f["rank"] == 1 and f["kind"] == "kill" and f["lost_steps"] == 0


def test_joiner_death_mid_migration_aborts_and_training_goes_on(tmp_path: Path, reference_hash: str) -> None:
    """The joiner dies while it prepares: the migration is aborted; no rank failed, nobody rolled
    back, the job ends in its first generation."""
    run = run_nodes_job(
        tmp_path / "job",
        nnodes=3,
        spares=1,
        faults=("migrate:rank=1,step=4,to=2", "kill:rank=1,step=0,at=prepare"),
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    (aborted,) = events_named(run.events, "migration_aborted")
    assert "joiner" in aborted["error"] and aborted["phase"] == "prepare"
    assert run.result.failures == [] and run.result.generation == 1


def test_status_and_drain_of_a_running_job(tmp_path: Path, reference_hash: str) -> None:
    """`nonstop status` and `nonstop drain` against a running job over the authenticated client
    channel: the drained node's rank moves to a node with a spare, bitwise."""
    import threading
    import time

    from nonstop.cli import main
    from nonstop.launch.job_client import request_migration, request_status

    job_dir = tmp_path / "job"
    box: list[DemoRun] = []
    t = threading.Thread(
        target=lambda: box.append(
            run_nodes_job(job_dir, nnodes=3, spares=1, script_extra=("--step-delay", "0.3"), replicas=1)
        ),
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + 120
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            st = request_status(job_dir)
        except Exception:  # not up yet
            time.sleep(0.2)
            continue
        spare_up = (st.get("nodes") or {}).get("1", {}).get("idle_spares") == 1  # late on a loaded machine
        if st.get("state") == "running" and (st.get("replicated_step") or 0) >= 1 and spare_up:
            break
        time.sleep(0.1)
    assert st["world_size"] == 3 and st["ranks"]["1"]["node"] == "1"
    assert st["nodes"]["1"]["idle_spares"] == 1 and st["migration"] is None
    assert main(["status", "--job-dir", str(job_dir)]) == 0
    from nonstop.protocol.client import DrainMsg

    (answer,) = request_migration(job_dir, DrainMsg(node="1"), timeout=120)
    assert answer.ok, answer
    assert answer.rank == 1 and answer.source == "1" and answer.target in ("0", "2")
    t.join(timeout=300)
    run = box[0]
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    assert run.result.failures == []


def test_preemption_notice_drains_the_node_within_its_grace(tmp_path: Path, reference_hash: str) -> None:
    """Node 2 gets a preemption notice with 30 s of grace: its rank moves live to another node,
    the node is released, nothing failed."""
    run = run_nodes_job(tmp_path / "job", nnodes=3, spares=1, faults=("preempt:node=2,step=4,grace=30",))
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    (notice,) = events_named(run.events, "preempt_notice")
    assert notice["node"] == "2" and notice["ranks"] == [2]
    (done,) = events_named(run.events, "migration_done")
    assert done["rank"] == 2 and done["reason"] == "preempt" and done["target"] in ("0", "1")
    assert [e["node"] for e in events_named(run.events, "node_released")] == ["2"]
    assert done["stages"]["resumed"] + done["stages"]["paused"] < 30
    assert run.result.failures == []


def test_preemption_without_time_to_drain_recovers_elsewhere(tmp_path: Path, reference_hash: str) -> None:
    """A notice with 0.2 s of grace: the node cannot be drained in time; its agent stops at the end of
    the grace and the rank is recovered on another node from its replica, no committed step lost."""
    run = run_nodes_job(tmp_path / "job", nnodes=3, spares=1, faults=("preempt:node=2,step=4,grace=0.2",))
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash
    assert [e["node"] for e in events_named(run.events, "node_lost")] == ["2"]
    assert len(run.result.failures) == 1, run.result.failures
    (f,) = run.result.failures
    assert f["rank"] == 2 and f["kind"] == "node" and f["lost_steps"] == 0
