"""With the job's state in a real etcd (``--store etcd://``), the coordinator process is SIGKILLed
mid-training and started again by node 0's launcher: the job goes on without a recovery (same
generation, no rank restarted) and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nonstop.config import JobConfig
from nonstop.control.jobstore import JobStore
from nonstop.control.store import open_store
from nonstop.coordinator.loop import JobState
from nonstop.demo.runner import demo_job_config
from nonstop.launch.jobfiles import JOB_INFO
from tests.conftest import STEPS, EtcdServer, NodesInBackground, free_port, run_demo_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _on_etcd(job_dir: Path, etcd: EtcdServer, **kw: Any) -> JobConfig:
    """A 3-node demo job (one rank and one spare per node, tiny model) with its state in ``etcd``."""
    args: dict[str, Any] = dict(
        steps=STEPS, script_extra=("--step-delay", "0.4"), nnodes=3, nproc_per_node=1, spares=1,
        coordinator=f"127.0.0.1:{free_port()}", store=etcd.url, secret_file=etcd.secret_file, lease_ttl_s=3.0,
    )  # fmt: skip
    args.update(kw)
    return demo_job_config(result=job_dir / "result.json", model="tiny", batch=4, job_dir=job_dir, **args)


def test_coordinator_restart_on_etcd_does_not_stop_the_job(
    tmp_path: Path, etcd_server: EtcdServer, reference_hash: str
) -> None:
    job_dir = tmp_path / "job"
    job = NodesInBackground(_on_etcd(job_dir, etcd_server))
    job.wait_replicated(4)
    first = json.loads((job_dir / JOB_INFO).read_text())["pid"]
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    result = job.result(timeout=400)
    assert result.state is JobState.DONE, result.error
    out = json.loads((job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash

    (resumed,) = job.events("coordinator_resumed")
    assert resumed["ts"] > killed_at and resumed["generation"] == 1 and resumed["lost"] == []
    # every node and every rank came back to the new coordinator; nobody was restarted
    assert sorted(e["node"] for e in job.events("node_reconnected")) == ["0", "1", "2"]
    back = {e["rank"] for e in job.events("connect") if e.get("resumed") and e["rank"] is not None}
    assert back == {0, 1, 2}
    assert job.events("failure") == [] and result.failures == [] and result.generation == 1
    assert not job.events("node_lost")
    # training went on while no coordinator ran: replication resumed past the kill's step, or --
    # the restart slower than the job's last steps (6 s under CI's load, 12 steps of 0.4 s) --
    # the ranks came back to the new coordinator done, and the job finished at once
    (finish,) = job.events("finish")
    went_on = max(e["step"] for e in job.events("replicated")) > 4
    assert went_on or finish["ts"] - resumed["ts"] < 1.0, (finish, resumed)


def test_coordinator_restart_mid_migration_ends_it_cleanly(
    tmp_path: Path, etcd_server: EtcdServer, reference_hash: str
) -> None:
    """The coordinator dies while a rank is being moved: the new one finds the migration in its
    record and aborts it (the joiner that prepared is replaced by a fresh spare, nothing rolls
    back), or finishes it if the swap had begun; the job goes on and ends bitwise equal."""
    job_dir = tmp_path / "job"
    job = NodesInBackground(_on_etcd(job_dir, etcd_server, faults=("migrate:rank=1,step=3,to=2",)))
    deadline = time.monotonic() + 300
    while not job.events("migration_start") and time.monotonic() < deadline and job.running:
        time.sleep(0.02)
    (start,) = job.events("migration_start")
    # the record in etcd is saved at the coordinator's next loop turn: give it that (the joiner's
    # prepare -- starting, restoring, warming up -- takes seconds more)
    time.sleep(0.5)
    assert not job.events("migration_done"), "the migration ended before the kill could land in it"
    first = json.loads((job_dir / JOB_INFO).read_text())["pid"]
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)  # the joiner is still preparing: restoring, warming up
    result = job.result(timeout=400)
    assert result.state is JobState.DONE, result.error
    out = json.loads((job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash

    (resumed,) = job.events("coordinator_resumed")
    assert resumed["ts"] > killed_at
    aborted = [e for e in job.events("migration_aborted") if e["ts"] > killed_at]
    finished = [e for e in job.events("operation_resumed") if e["ts"] > killed_at]
    assert len(aborted) + len(finished) == 1, (aborted, finished)
    if aborted:
        assert aborted[0]["error"] == "the coordinator restarted" and aborted[0]["rank"] == 1
        # a joiner that had taken rank 1 to prepare is stopped and a fresh spare takes its place;
        # one that had not been told yet (its node was still fetching) is an idle spare again
        # (an idle spare's exit at the job's end may come after the log's last event)
        exits = [e for e in job.events("exit") if e["spawn_id"] == start["joiner"]]
        assert all(e["role"] in ("retired", "spare") and e["rank"] is None for e in exits), exits
        if any(e["role"] == "retired" for e in exits):
            later = [e for e in job.events("spawn") if e["ts"] > killed_at]
            assert any(e["role"] == "spare" and e["node"] == "2" for e in later)
    assert job.events("failure") == [] and result.failures == []


def test_coordinator_restart_mid_grow_ends_it_and_the_job_grows_again(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """An elastic job shrunk by a lost node grows back when the node returns; the coordinator dies
    while the joiner prepares: the new one aborts the grow it finds in its record, grows again,
    and every step still trains on exactly the samples of an uninterrupted run."""
    from nonstop.demo.samples import check_sequence, read_log

    steps, batch = 140, 4  # room for a second grow after the restart, on a loaded machine too
    job_dir = tmp_path / "job"
    extra = ("--step-delay", "0.1", "--samples-log", str(job_dir / "samples"))
    faults = ("node:node=2,step=6",)
    cfg = _on_etcd(
        job_dir, etcd_server, steps=steps, script_extra=extra, spares=0, faults=faults, min_world_size=2
    )
    job = NodesInBackground(cfg)
    job.wait_event("shrink", timeout=300)
    job.start_node(2)
    job.wait_event("grow_start", timeout=300)
    # the record in etcd is saved at the coordinator's next loop turn, and a fresh spare can
    # prepare within a tenth of a second: kill as soon as the record holds the grow
    (start,) = job.events("job_start")
    jobs = JobStore(open_store(etcd_server.url, secret=etcd_server.secret), str(start["job_id"]))
    deadline = time.monotonic() + 30
    while not (jobs.load() or {}).get("grow") and time.monotonic() < deadline:
        time.sleep(0.005)
    first = json.loads((job_dir / JOB_INFO).read_text())["pid"]
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    result = job.result(timeout=400)
    assert result.state is JobState.DONE, result.error
    aborted = [e for e in job.events("grow_aborted") if e["ts"] > killed_at]
    resumed = [e for e in job.events("operation_resumed") if e["ts"] > killed_at]
    assert len(aborted) + len(resumed) == 1, (aborted, resumed)
    if aborted:  # it had not swapped: the new coordinator grows again
        assert aborted[0]["error"] == "the coordinator restarted"
        assert [e["world_size"] for e in job.events("grow_done")][-1:] == [3]
    out = json.loads((job_dir / "result.json").read_text())
    assert out["world_size"] == 3 and out["samples_seen"] == steps * 3 * batch
    assert check_sequence(read_log(job_dir / "samples"), steps=steps, num_shards=3, batch=batch) == []


def _wait(job: NodesInBackground, what: str, ok: Callable[[], bool], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert job.running and time.monotonic() < deadline, f"the job never got to: {what}"
        time.sleep(0.05)


def test_a_restarted_coordinator_takes_up_the_tuned_interval_and_still_rescues(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """``--snapshot-budget`` widened the interval, then the coordinator is SIGKILLed: the new one
    takes the interval up from its ranks' resume points (a fresh tuner would run at K = 1 and ask
    for no rescue while the ranks skip their snapshots), so a rank killed after the restart is
    replaced by a spare that takes a survivor's rescued step -- nothing lost, only the step in
    flight redone -- and the job ends bitwise equal to an uninterrupted run."""
    # the restart (a 3 s lease, then a new process: ~50 s on a saturated 2-core machine, past the
    # default --reconnect of 30 s) and the kill all fit, loaded too
    steps = 120
    ref = run_demo_job(tmp_path / "reference", spares=0, steps=steps)  # (3 ranks, as below)
    assert ref.out is not None, ref.result.error
    reference = ref.out["final_hash"]

    job_dir = tmp_path / "job"
    job = NodesInBackground(
        _on_etcd(
            job_dir, etcd_server, steps=steps, snapshot_budget=1e-6, rescue_wait_s=30.0, reconnect_s=120.0
        )
    )
    tuned = job.wait_event("snapshot_cadence", timeout=300)
    since = int(tuned["since"])
    # killed once the announcement has left (it is sent before it is logged): the ranks tell the
    # new coordinator the interval they heard, switched to or not yet ("replicated" events, which
    # are logged at most once a second, cannot say when step `since` was snapshotted)
    time.sleep(1.0)
    os.kill(json.loads((job_dir / JOB_INFO).read_text())["pid"], signal.SIGKILL)
    _wait(job, "the new coordinator taking the interval up", lambda: len(job.events("snapshot_cadence")) >= 2)
    (taken,) = job.events("snapshot_cadence")[1:]
    assert (taken["every"], taken["since"], taken["stall_s"]) == (tuned["every"], since, None)
    gen = job.events("generation")[-1]
    pid = next(e["pid"] for e in job.events("spawned") if e["spawn_id"] == gen["members"]["1"])
    os.kill(pid, signal.SIGKILL)
    result = job.result(timeout=400)
    assert result.state is JobState.DONE, result.error
    assert json.loads((job_dir / "result.json").read_text())["final_hash"] == reference
    (failure,) = result.failures
    # the step the rank died in, less one: a survivor's rescue (the last snapshot is `since`, up to
    # 127 steps back, which a coordinator that had not taken the interval up would go back to)
    assert failure["restore_step"] >= since, failure
    assert failure["lost_steps"] == 0 and failure["redone_steps"] <= 1, failure
