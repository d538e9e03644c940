"""Run every node of a job on this machine: node 0 in this process, the others as
``nonstop run --node-rank K`` subprocesses.

Each node is a separate agent process with its own snapshot memory (its own
shared-memory names), its own data plane and its own lease, exactly as on
separate hosts; only the job dir (secret, fault markers, logs) is shared. Used
by ``nonstop demo --nnodes``, the tests and the benchmarks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from nonstop.config import JobConfig
from nonstop.coordinator.loop import JobResult
from nonstop.errors import JobFailedError
from nonstop.events.log import read_events
from nonstop.launch.jobfiles import JOB_INFO
from nonstop.launch.launcher import run_job
from nonstop.workerlog import LogConfig

__all__ = ["LocalNodesJob", "node_command", "run_local_nodes"]


def node_command(config: JobConfig, node_rank: int, coordinator: str) -> list[str]:
    """The ``nonstop run`` command line of node ``node_rank`` of ``config``'s job."""
    c = config
    det, ctl, ops = c.detection, c.control, c.operations
    cmd = [sys.executable, "-m", "nonstop.cli", "run"]
    cmd += ["--nnodes", str(c.nnodes), "--node-rank", str(node_rank), "--coordinator", coordinator]
    cmd += ["--nproc-per-node", str(c.nproc_per_node), "--spares", str(c.spares), "--job-dir", str(c.job_dir)]
    cmd += ["--lease-ttl", str(det.lease_ttl_s), "--replicas", str(c.replication.replicas)]
    cmd += ["--snapshot", c.snapshot.mode]
    cmd += ["--heartbeat-timeout", str(det.detector.heartbeat_timeout_s)]
    if c.replication.bandwidth_mb_s:
        cmd += ["--replica-bandwidth", str(c.replication.bandwidth_mb_s)]
    if ctl.secret_file is not None:
        cmd += ["--secret-file", str(ctl.secret_file)]
    if ctl.uses_store:
        cmd += ["--store", ctl.store, "--reconnect", str(ctl.reconnect_s)]
    for flag, path in (
        ("--etcd-ca", ctl.etcd_ca),
        ("--etcd-cert", ctl.etcd_cert),
        ("--etcd-key", ctl.etcd_key),
    ):
        if path is not None:
            cmd += [flag, str(path)]
    if ctl.tls:
        cmd += ["--tls"]
    cmd += ["--preempt-grace", str(ops.preempt_grace_s)]
    # issue 21: every node runs the job's health probes ('=': a command may start with '-')
    probes = det.probes
    cmd += [f"--probe-period={probes.period_s}", f"--health-timeout={probes.timeout_s}"]
    if probes.command is not None:
        cmd += [f"--health-cmd={probes.command}"]
    if ops.preempt_url is not None:
        cmd += ["--preempt-url", ops.preempt_url, "--preempt-poll", str(ops.preempt_poll_s)]
        for h in ops.preempt_headers:
            cmd += ["--preempt-header", h]
    logs = LogConfig.from_env(dict(c.extra_env))  # the CLI's log flags travel in extra_env
    cmd += ["--log-prefix", logs.prefix]
    if logs.log_dir is not None:
        cmd += ["--log-dir", str(logs.log_dir)]
    if logs.ranks is not None:
        cmd += ["--local-ranks-filter", ",".join(str(r) for r in sorted(logs.ranks))]
    script = c.script
    if script.startswith("-m "):
        cmd += ["-m", script[3:].strip()]
    else:
        cmd += [script]
    return cmd + list(c.script_args)


def run_local_nodes(
    config: JobConfig,
    *,
    redirect_output: bool = False,
    domains: dict[int, str] | None = None,
    wrap: Callable[[int, list[str]], list[str]] | None = None,
) -> JobResult:
    """Run all ``config.nnodes`` nodes here; return node 0's (the coordinator's) result.

    ``wrap(k, cmd)`` rewrites node ``k``'s command line (e.g. to run it in a network
    namespace with ``ip netns exec``)."""
    if config.nnodes == 1:
        return run_job(config, redirect_output=redirect_output)
    cfg0 = replace(config, node_rank=0, coordinator=config.coordinator or "127.0.0.1:0")
    box: list[JobResult | BaseException] = []

    def node0() -> None:
        try:
            box.append(run_job(cfg0, redirect_output=redirect_output))
        except BaseException as e:
            box.append(e)

    info = config.job_dir.resolve() / JOB_INFO
    info.unlink(missing_ok=True)
    thread = threading.Thread(target=node0, name="nonstop-node0", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not info.exists() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not info.exists():
        thread.join(timeout=5)
        if box and isinstance(box[0], BaseException):
            raise box[0]
        raise JobFailedError("node 0 did not start its coordinator within 60s")
    addr = json.loads(info.read_text())["control"]
    logs = config.job_dir.resolve() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for k in range(1, config.nnodes):
        cmd = node_command(config, k, addr)
        if domains and k in domains:
            cmd[cmd.index("--job-dir") : cmd.index("--job-dir")] = ["--domain", domains[k]]
        if wrap is not None:
            cmd = wrap(k, cmd)
        with (logs / f"node-{k}.log").open("ab") as log_file:
            procs.append(
                subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            )
    thread.join()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    got = box[0]
    if isinstance(got, BaseException):
        raise got
    return got


class LocalNodesJob:
    """:func:`run_local_nodes` on a thread, for a test or a benchmark that acts on the job while
    it trains: read its events, start a node again (a node joining the running job), wait for
    the result. Nodes started here are stopped (after 30 s) once the job has ended."""

    def __init__(self, config: JobConfig, **kw: Any) -> None:
        self.config = config
        self.job_dir = config.job_dir
        self._box: list[JobResult | BaseException] = []
        self._joined: list[subprocess.Popen[bytes]] = []

        def job() -> None:
            try:
                self._box.append(run_local_nodes(config, redirect_output=True, **kw))
            except BaseException as e:
                self._box.append(e)

        self._thread = threading.Thread(target=job, name="nonstop-local-nodes", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The events (named ``name``) logged so far."""
        path = self.job_dir / "events.jsonl"
        got = read_events(path) if path.exists() else []
        return [e for e in got if name is None or e["event"] == name]

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        """The first event named ``name``; JobFailedError if the job ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.events(name)
            if got:
                return got[0]
            if not self.running or time.monotonic() > deadline:
                raise JobFailedError(f"no {name} event within {timeout:g}s (job running: {self.running})")
            time.sleep(0.05)

    def start_node(self, node_rank: int) -> subprocess.Popen[bytes]:
        """Start node ``node_rank`` (again): it joins the running job (log: logs/node-K-rejoin.log)."""
        addr = json.loads((self.job_dir / JOB_INFO).read_text())["control"]
        log_path: Path = self.job_dir / "logs" / f"node-{node_rank}-rejoin.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                node_command(self.config, node_rank, addr),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._joined.append(proc)
        return proc

    def result(self, timeout: float) -> JobResult:
        """Node 0's result once the job ended; raises what the job raised, or JobFailedError when
        it did not end within ``timeout``."""
        self._thread.join(timeout=timeout)
        for p in self._joined:
            try:
                p.wait(timeout=30 if not self._thread.is_alive() else 0.01)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not self._box:
            raise JobFailedError(f"the job did not end within {timeout:g}s")
        got = self._box[0]
        if isinstance(got, BaseException):
            raise got
        return got
