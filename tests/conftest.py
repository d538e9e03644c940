"""Shared helpers: run a real demo job and inspect what it left behind."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nonstop.agent.gc import processes_of_job
from nonstop.config import DetectorConfig
from nonstop.coordinator.loop import JobResult, JobState
from nonstop.demo.runner import demo_job_config
from nonstop.events.log import read_events
from nonstop.launch.launcher import default_shm_dir, run_job
from nonstop.launch.local_nodes import LocalNodesJob, run_local_nodes
from tests.tiers import EXTENDED

STEPS = 16
# The lease of a test job's node agents. A loaded 2-core machine can starve a process for seconds:
# 3 s leases fenced two nodes of one job at once beside a dense run of end-to-end tests (stop 44).
# A test's lost node is its agent SIGKILLed, seen at once by the closed connection, not by the
# lease; the tests of fencing itself (partitions, store stalls) set their own.
LEASE_TTL_S = 10.0


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Code under test may set ``os.environ`` (``nonstop.init()`` sets torchrun's variables in
    its process); whatever a test leaves there would reach every process later tests start."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@dataclass
class DemoRun:
    result: JobResult
    out: dict[str, Any] | None
    job_dir: Path
    events: list[dict[str, Any]]

    @property
    def job_id(self) -> str:
        return str(next(e["job_id"] for e in self.events if e["event"] == "job_start"))


def run_demo_job(
    job_dir: Path,
    *,
    nproc: int = 3,
    spares: int = 1,
    steps: int = STEPS,
    faults: tuple[str, ...] = (),
    model: str = "tiny",
    script_extra: tuple[str, ...] = (),
    **cfg: Any,
) -> DemoRun:
    result_file = job_dir / "result.json"
    config = demo_job_config(
        result=result_file,
        steps=steps,
        model=model,
        batch=4,
        script_extra=script_extra,
        nproc_per_node=nproc,
        spares=spares,
        job_dir=job_dir,
        faults=faults,
        detector=cfg.pop("detector", DetectorConfig()),
        **cfg,
    )
    if config.nnodes > 1:
        result = run_local_nodes(config, redirect_output=True)
    else:
        result = run_job(config, redirect_output=True)
    out = json.loads(result_file.read_text()) if result_file.exists() else None
    run = DemoRun(result, out, job_dir, read_events(job_dir / "events.jsonl"))
    if result.state is not JobState.DONE:  # pytest shows this output with a failed test's report
        print(why_it_failed(run))
    return run


def why_it_failed(run: DemoRun) -> str:
    """What to read when a job did not end done (CI keeps no job directory): its error, the
    failures it saw, and the tail of every process log that holds a traceback."""
    out = [f"job {run.result.state.value}: {run.result.error}"]
    said = ("failure", "generation", "exit", "fault_report", "recovery")
    out += [json.dumps(e) for e in run.events if e["event"] in said]
    logs = run.job_dir / "logs"
    for log in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        text = log.read_text(errors="replace")
        at = text.rfind("Traceback")
        if at >= 0:  # its end: the error, and the frames nearest to it
            out.append(f"--- {log.name} (the end of its last traceback)\n{text[at:][-5000:]}")
    return "\n".join(out)


# Steps while an elastic job runs shrunk, in the tests where a node rejoins to grow it back: the
# rejoining node's spare imports torch before it can join, which takes well over 10 s on a
# saturated 2-core machine; at full pace the run could end first and no grow would be seen.
SHRUNK_STEP_DELAY = ("--shrunk-step-delay", "0.5")


def sampled_nodes_config(
    job_dir: Path, steps: int, faults: tuple[str, ...], *, script_more: tuple[str, ...] = (), **kw: Any
) -> Any:
    """A tiny demo job of several local nodes (batch 4, 0.1 s steps) that logs every micro-batch
    it trains on to ``job_dir/samples`` (``nonstop.demo.samples``); ``script_more``: more script
    flags; ``kw`` goes to the config."""
    kw.setdefault("coordinator", "127.0.0.1:0")
    kw.setdefault("lease_ttl_s", LEASE_TTL_S)
    return demo_job_config(
        result=job_dir / "result.json",
        steps=steps,
        model="tiny",
        batch=4,
        script_extra=("--step-delay", "0.1", "--samples-log", str(job_dir / "samples"), *script_more),
        job_dir=job_dir,
        faults=faults,
        **kw,
    )


def run_nodes_job(job_dir: Path, **kw: Any) -> DemoRun:
    """A demo job of several local nodes (``nnodes`` in ``kw``), one rank per node by default."""
    kw.setdefault("nproc", 1)
    # steps long enough that replication rounds (tens of ms each) keep up, as with real steps
    kw.setdefault("script_extra", ("--step-delay", "0.1"))
    kw.setdefault("coordinator", "127.0.0.1:0")
    kw.setdefault("lease_ttl_s", LEASE_TTL_S)
    return run_demo_job(job_dir, **kw)


def events_named(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


class NodesInBackground(LocalNodesJob):
    """A job of several local nodes on a thread, for a test that acts on it while it trains."""

    def wait_replicated(self, step: int, timeout: float = 300.0) -> None:
        """Until every rank's step ``step`` is replicated (the job is well under way)."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            if any(e["step"] >= step for e in self.events("replicated")):
                return
            time.sleep(0.05)


def run_benchmark_quick(name: str, out: Path, *args: str, timeout: float) -> dict[str, Any]:
    """Run ``benchmarks/<name>.py --quick --out OUT ARGS`` as a subprocess; return its JSON report."""
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / f"{name}.py"), "--quick", "--out", str(out), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def stuck_stacks(job_dir: Path) -> str:
    """The stacks a rank's link wrote when its main thread did not take a reconfigure (train/link.py,
    ``_dump_if_stuck``), from the job's logs: what to read when a recovery stage timed out."""
    out = []
    for log in sorted((job_dir / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        at = text.find("its stacks:")
        if at >= 0:
            out.append(f"--- {log.name}\n{text[at : at + 6000]}")
    return "\n".join(out)


def leftovers(job_id: str) -> tuple[list[Path], list[int]]:
    """Shared-memory files and live processes a finished job left behind (must be none)."""
    shm = sorted(default_shm_dir().glob(f"nonstop-{job_id}*"))
    return shm, processes_of_job(job_id)


@pytest.fixture(scope="session")
def reference_hash(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Final weights of an uninterrupted 3-rank run of the tiny demo (the bitwise reference)."""
    run = run_demo_job(tmp_path_factory.mktemp("reference"), spares=0)
    assert run.out is not None, "the reference job failed"
    return str(run.out["final_hash"])


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the end-to-end variants ``make test`` leaves to ``make test-extended`` (tests/tiers.py)."""
    for item in items:
        name = item.nodeid.split("[", 1)[0].removeprefix("tests/")
        if name in EXTENDED:
            item.add_marker(pytest.mark.extended)


# ---------------------------------------------------------------- a real etcd (scripts/etcd.sh)
ETCD_SH = Path(__file__).resolve().parent.parent / "scripts" / "etcd.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    """A real etcd from ``scripts/etcd.sh``; restartable on the same ports and data."""

    state: Path
    port: int
    peer_port: int
    secret_file: Path
    secret: str

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [str(self.state), str(self.port), str(self.secret_file), str(self.peer_port)]
        proc = subprocess.run(
            [str(ETCD_SH), "start", *args], capture_output=True, text=True, timeout=600, check=False
        )
        assert proc.returncode == 0, f"scripts/etcd.sh start failed: {proc.stderr}"

    def stop(self) -> None:
        subprocess.run([str(ETCD_SH), "stop", str(self.state)], check=True, timeout=30)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    root = tmp_path_factory.mktemp("etcd")
    secret = secrets.token_hex(16)
    secret_file = root / "secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    server = EtcdServer(root / "state", free_port(), free_port(), secret_file, secret)
    server.start()
    yield server
    server.stop()
