"""One node's agent run in this process: where its data plane listens (the route to the
coordinator), its devices, its spec and environment, its job dir checked, the signals that stop
it -- and the whole run of a node other than 0 (:func:`run_node`: its agent until the job ends or
the node is fenced). Node 0 runs its agent beside the coordinator (:mod:`.launcher`) with the
same spec and environment."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from nonstop.agent.node import NodeAgent, NodeSpec
from nonstop.agent.notice import NoticePoller, parse_headers
from nonstop.config import JobConfig
from nonstop.control.secret import node_secret
from nonstop.coordinator.loop import JobResult, JobState
from nonstop.devices.inventory import Devices, check_fits, detect_devices
from nonstop.errors import ControlError, UsageError

__all__ = [
    "default_shm_dir",
    "install_signal_handlers",
    "node_env",
    "node_spec",
    "prepare_job_dir",
    "run_node",
]


def default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")


def prepare_job_dir(job_dir: Path, *, owner: bool) -> None:
    """Create (0700) and check the job dir; the owner (node 0), holding the job dir's lock, also
    clears the fault markers."""
    try:
        job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = job_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"job dir {str(job_dir)!r} is not writable ({e.strerror or e}): choose another with --job-dir"
        ) from None
    if owner:
        shutil.rmtree(job_dir / "faults", ignore_errors=True)
        (job_dir / "faults").mkdir()
    else:
        (job_dir / "faults").mkdir(exist_ok=True)


def _route_to(addr: tuple[str, int]) -> str:
    """The local address this machine uses to reach ``addr`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError as e:
        raise UsageError(
            f"no route to the coordinator {addr[0]}:{addr[1]} ({e}); pass --data-host ADDRESS"
        ) from None


def node_devices(config: JobConfig) -> Devices:
    """This node's accelerators (devices/inventory.py); UsageError (exit 2, one line) when its ranks
    and spares are more processes than it has devices."""
    devices = detect_devices({**os.environ, **dict(config.extra_env)})
    check_fits(nproc=config.nproc_per_node, spares=config.spares, devices=devices)
    return devices


def node_spec(config: JobConfig) -> NodeSpec:
    name = str(config.node_rank)
    if config.data_host is not None:
        host = config.data_host
    elif config.nnodes == 1:
        host = config.host
    elif config.node_rank == 0:
        host = config.coordinator_addr[0]
    else:
        host = _route_to(config.coordinator_addr)
    return NodeSpec(
        node=name,
        nproc=config.nproc_per_node,
        spares=config.spares,
        domain=config.domain or name,
        data_host=host,
        replica_bandwidth_mb_s=config.replication.bandwidth_mb_s,
        devices=node_devices(config),
        probes=config.detection.probes,  # issue 21: the agent's health probes
    )


def node_env(config: JobConfig, host: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(dict(config.extra_env))
    if host in ("127.0.0.1", "localhost", "::1"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run_node(
    config: JobConfig, *, command: list[str], job_dir: Path, stop: threading.Event, redirect_output: bool
) -> JobResult:
    """A node other than 0: run its agent until the job ends or the node is fenced."""
    prepare_job_dir(job_dir, owner=False)
    secret, secret_file = node_secret(config, job_dir)  # from $NONSTOP_SECRET: a private file
    shm_dir = config.snapshot.shm_dir or default_shm_dir()
    spec = node_spec(config)
    node = NodeAgent(
        spec=spec,
        coordinator=config.coordinator_addr,
        secret=secret,
        secret_file=secret_file,
        command=command,
        env=node_env(config, spec.data_host),
        job_dir=job_dir,
        shm_dir=shm_dir,
        redirect_output=redirect_output,
    )
    node.preempt_grace_s = config.operations.preempt_grace_s
    if config.operations.preempt_url is not None and config.node_rank != 0:
        node.notice = NoticePoller(
            config.operations.preempt_url.replace("{node}", str(config.node_rank)),
            headers=parse_headers(config.operations.preempt_headers),
            interval_s=config.operations.preempt_poll_s,
            default_grace_s=config.operations.preempt_grace_s,
        )
    on_term = node.preempt_signal.set if config.node_rank != 0 else None  # node 0 hosts the coordinator
    restore_handlers = install_signal_handlers(stop, on_term=on_term)
    try:
        rc = node.run(stop)
    except (ControlError, OSError) as e:
        raise UsageError(
            f"node {config.node_rank}: cannot join the job at {config.coordinator}: {e}"
        ) from None
    finally:
        restore_handlers()
    if node.memory is not None and node.memory.error is not None:
        raise UsageError(node.memory.error)  # its memory tier is too small: exit 2 with the line
    state = JobState.DONE if rc == 0 else JobState.FAILED
    error = None if rc == 0 else (node.fenced or "the job failed (see node 0's events)")
    return JobResult(state=state, generation=0, final_step=0, error=error)


def install_signal_handlers(
    stop: threading.Event, *, on_term: Callable[[], None] | None = None
) -> Callable[[], None]:
    """SIGINT and SIGTERM stop (``on_term``: what the first SIGTERM does instead, e.g. a node's
    preemption notice; a second one stops)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    terms = [0]

    def handler(signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGTERM and on_term is not None and terms[0] == 0:
            terms[0] += 1
            on_term()
            return
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore
