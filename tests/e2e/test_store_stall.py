"""A control-store stall (a real etcd frozen with SIGSTOP) while the coordinator still hears every
node: nothing is fenced, the coordinator keeps its leadership, and the job ends bitwise equal to
an uninterrupted run -- on the default lease TTL (1 s), with stalls three times as long."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nonstop.config import JobConfig
from nonstop.coordinator.loop import JobState
from nonstop.demo.runner import demo_job_config
from tests.conftest import STEPS, EtcdServer, NodesInBackground, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _on_etcd(job_dir: Path, etcd: EtcdServer, **kw: Any) -> JobConfig:
    """A 3-node demo job (one rank and one spare per node, tiny model) with its state in ``etcd``
    and the default lease TTL."""
    args: dict[str, Any] = dict(
        steps=STEPS, script_extra=("--step-delay", "0.3"), nnodes=3, nproc_per_node=1, spares=1,
        coordinator=f"127.0.0.1:{free_port()}", store=etcd.url, secret_file=etcd.secret_file,
    )  # fmt: skip
    args.update(kw)
    return demo_job_config(result=job_dir / "result.json", model="tiny", batch=4, job_dir=job_dir, **args)


@contextmanager
def frozen(etcd: EtcdServer) -> Iterator[None]:
    """etcd stopped (SIGSTOP) for the body; always resumed."""
    pid = int((etcd.state / "etcd.pid").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_store_stall_of_3s_fences_nothing_while_the_coordinator_hears_every_node(
    tmp_path: Path, etcd_server: EtcdServer, reference_hash: str
) -> None:
    job_dir = tmp_path / "job"
    config = _on_etcd(job_dir, etcd_server)
    assert config.detection.lease_ttl_s == 1.0  # the defaults are what is tested
    job = NodesInBackground(config)
    job.wait_replicated(2)
    with frozen(etcd_server):
        time.sleep(3.0)
    job.wait_replicated(5)
    with frozen(etcd_server):
        time.sleep(3.0)
    result = job.result(timeout=400)
    assert result.state is JobState.DONE, result.error
    assert not list(job_dir.glob("fenced-node-*.json")), [p.read_text() for p in job_dir.glob("fenced-*")]
    assert not job.events("node_lost") and job.events("failure") == [] and result.generation == 1
    assert not job.events("coordinator_resumed")  # the coordinator kept its leadership
    # a lease that ended in the stall was kept while the node was heard, and registered again
    lapsed = sorted(e["node"] for e in job.events("node_lease_lapsed"))
    assert lapsed == sorted(e["node"] for e in job.events("node_lease_renewed"))
    out = json.loads((job_dir / "result.json").read_text())
    assert out["final_hash"] == reference_hash
