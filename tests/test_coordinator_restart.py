"""With the job's state in a real etcd (``--store etcd://``), the coordinator process is SIGKILLed
mid-training and started again by node 0's launcher: the job goes on without a recovery (same
generation, no rank restarted) and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.demo.runner import demo_job_config
from nonstop.runtime.coordinator import JobResult, JobState
from nonstop.runtime.eventlog import read_events
from nonstop.runtime.launcher import JOB_INFO
from nonstop.runtime.localnodes import run_local_nodes
from tests.conftest import STEPS, EtcdServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _events(job_dir: Path, name: str) -> list[dict[str, Any]]:
    path = job_dir / "events.jsonl"
    return [e for e in read_events(path) if e["event"] == name] if path.exists() else []


def test_coordinator_restart_on_etcd_does_not_stop_the_job(
    tmp_path: Path, etcd_server: EtcdServer, reference_hash: str
) -> None:
    job_dir = tmp_path / "job"
    cfg = demo_job_config(
        result=job_dir / "result.json",
        steps=STEPS,
        model="tiny",
        batch=4,
        script_extra=("--step-delay", "0.4"),
        nnodes=3,
        nproc_per_node=1,
        spares=1,
        job_dir=job_dir,
        coordinator=f"127.0.0.1:{free_port()}",
        store=etcd_server.url,
        secret_file=etcd_server.secret_file,
        lease_ttl_s=3.0,
    )
    box: list[JobResult | BaseException] = []

    def job() -> None:
        try:
            box.append(run_local_nodes(cfg, redirect_output=True))
        except BaseException as e:
            box.append(e)

    runner = threading.Thread(target=job, daemon=True)
    runner.start()
    deadline = time.monotonic() + 300
    while runner.is_alive() and time.monotonic() < deadline:
        if any(e["step"] >= 4 for e in _events(job_dir, "replicated")):
            break
        time.sleep(0.05)
    first = json.loads((job_dir / JOB_INFO).read_text())["pid"]
    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    runner.join(timeout=400)
    assert box, "the job did not end"
    result = box[0]
    assert not isinstance(result, BaseException), result
    assert result.state is JobState.DONE, result.error
    out = json.loads((job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash

    (resumed,) = _events(job_dir, "coordinator_resumed")
    assert resumed["ts"] > killed_at and resumed["generation"] == 1 and resumed["lost"] == []
    # every node and every rank came back to the new coordinator; nobody was restarted
    assert sorted(e["node"] for e in _events(job_dir, "node_reconnected")) == ["0", "1", "2"]
    back = {e["rank"] for e in _events(job_dir, "connect") if e.get("resumed") and e["rank"] is not None}
    assert back == {0, 1, 2}
    assert _events(job_dir, "failure") == [] and result.failures == [] and result.generation == 1
    assert not _events(job_dir, "node_lost")
    # training went on while no coordinator ran: replication resumed past the kill's step
    assert max(e["step"] for e in _events(job_dir, "replicated")) > 4
