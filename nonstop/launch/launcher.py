"""``nonstop run``: start one single-node job and see it through.

Order of events: validate input (fail before anything starts), take the job
dir's and the checkpoint root's locks (one job per dir: :mod:`.jobdir`; a
second job is refused before anything is touched), create the job dir, the
per-job secret (0600 file) and a lock file in shared memory that the
launcher holds for its lifetime (``nonstop gc`` uses it to tell live jobs
from orphans), start the control server on the given address, spawn the
workers and spares, and run the coordinator until the job is done or fails.
Whatever happens — normal end, SIGINT/SIGTERM, an exception — every child is
stopped and every shared-memory segment of the job is deleted.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nonstop import events as ev
from nonstop.agent.gc import hold_lock, release_lock
from nonstop.agent.node import NodeAgent
from nonstop.config import ENV, JobConfig, PersistConfig, job_config_to_json, security_environ
from nonstop.control.jobstore import JobStore
from nonstop.control.listener import ControlServer
from nonstop.control.secret import SECRET_FILE, coordinator_secret, write_secret
from nonstop.control.store import open_store
from nonstop.coordinator.loop import Coordinator, JobResult, JobState
from nonstop.coordinator.persistence import ClusterPersister
from nonstop.coordinator.status_server import StatusServer, start_status_server
from nonstop.devices.nccl import device_groups_mode
from nonstop.errors import ControlError, JobFailedError, UsageError
from nonstop.events.log import EventLog
from nonstop.faults import NODE_KINDS, FaultSpec, faults_to_json, parse_fault
from nonstop.launch.jobdir import hold_job
from nonstop.launch.jobfiles import (
    COORDINATOR_RESULT,
    COORDINATOR_SPEC,
    JOB_INFO,
    declare_resume,
    load_resume,
    result_from_json,
    write_job_info,
)
from nonstop.launch.node_run import (
    default_shm_dir,
    install_signal_handlers,
    node_devices,
    node_env,
    node_spec,
    prepare_job_dir,
    run_node,
)
from nonstop.policy.decisions import describe_exit
from nonstop.replica.peer import local_store_id
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.persist import Persister

log = logging.getLogger(__name__)

__all__ = ["default_shm_dir", "run_job", "worker_command"]


def worker_command(script: str, args: tuple[str, ...]) -> list[str]:
    """The command line of a worker: ``-m module`` or a script path."""
    if script.startswith("-m "):
        return [sys.executable, "-u", "-m", script[3:].strip(), *args]
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"training script {script!r} not found: give the path of a Python file")
    return [sys.executable, "-u", str(path), *args]


def check_faults(config: JobConfig) -> list[FaultSpec]:
    faults = [parse_fault(f) for f in config.faults]
    for f in faults:
        if f.kind in NODE_KINDS:  # node, preempt, degrade (issue 21)
            if f.node >= config.nnodes:
                raise UsageError(
                    f"fault {f.to_text()!r} names node {f.node}, but the job has nodes 0..{config.nnodes - 1}"
                )
            if f.node == 0:
                raise UsageError(f"fault {f.to_text()!r}: node 0 hosts the coordinator; name another node")
        elif f.rank >= config.world_size:
            raise UsageError(
                f"fault {f.to_text()!r} names rank {f.rank}, but the job has ranks 0..{config.world_size - 1}"
            )
    return faults


def run_job(
    config: JobConfig, *, redirect_output: bool = False, stop: threading.Event | None = None
) -> JobResult:
    """Run this process's part of the job described by ``config`` to the end; always cleans up.

    Node 0 (every single-node job) hosts the coordinator and runs its own node
    agent on a thread, holding the job dir's and checkpoint root's locks throughout; any
    other node runs only its agent. Raises UsageError for bad input, or a job dir or
    checkpoint root another job holds, before starting anything; and when a training script
    reported its own mistake (a :class:`UsageError` in ``Session.steps``/``run``: a bad
    ``state=`` object, a loop body outside ``with step:``), with that script's line.
    """
    with security_environ(
        config.control
    ):  # --tls, --etcd-*: every process and thread of the job inherits them
        result = _run_job(config, redirect_output=redirect_output, stop=stop)
    if result.usage_error and result.error:
        raise UsageError(result.error)  # the training script's mistake: exit 2 with its line
    return result


def _run_job(config: JobConfig, *, redirect_output: bool, stop: threading.Event | None) -> JobResult:
    command = worker_command(config.script, config.script_args)
    faults = check_faults(config)
    node_devices(config)  # an oversubscribed device node fails here, before anything starts
    device_groups_mode({**os.environ, **dict(config.extra_env)})  # so does a bad group mode
    job_dir = config.job_dir.resolve()
    stop = stop or threading.Event()
    if config.node_rank != 0:
        return run_node(config, command=command, job_dir=job_dir, stop=stop, redirect_output=redirect_output)
    with hold_job(job_dir, config.checkpoint_url):
        prepare_job_dir(job_dir, owner=True)
        if config.control.uses_store:
            return run_store_node0(
                config, command=command, job_dir=job_dir, stop=stop, redirect_output=redirect_output
            )
        return serve_coordinator(
            config,
            job_id=uuid.uuid4().hex[:12],
            command=command,
            faults=faults,
            stop=stop,
            redirect_output=redirect_output,
        )


def serve_coordinator(
    config: JobConfig,
    *,
    job_id: str,
    command: list[str],
    faults: list[FaultSpec],
    stop: threading.Event,
    redirect_output: bool = False,
    jobs: JobStore | None = None,
) -> JobResult:
    """Run the job's coordinator to the end: in this process with node 0's agent on a thread
    (embedded store), or alone (``jobs``: the control store holds the job's state, node 0's agent
    runs in the launcher and this process may be restarted).

    In phases: the durable tier and a resume checked; the control server bound and its secret
    written (:func:`_open_control`); the job's lock; the coordinator built; node 0's agent made
    (:func:`_local_node`); the status server; the job's info, the signal handlers and the start
    logged; then the run, and everything closed again in the reverse order (:func:`_wind_down`)."""
    job_dir = config.job_dir.resolve()
    durable = DurableStore(config.checkpoint_url, keep=config.persist.keep)  # a bad URL fails here
    resume = load_resume(config) if config.persist.resume else None
    if resume is not None and config.persist.resume is not None:
        declare_resume(durable, config.persist.resume, resume.step)
    shm_dir = config.snapshot.shm_dir or default_shm_dir()
    serving = _open_control(config, job_dir)
    events, server = serving.events, serving.server
    serving.lock_fd, serving.lock = hold_lock(shm_dir, job_id, job_dir)
    worker_env = _worker_env(config, faults, store_mode=jobs is not None)
    codec = CodecConfig(lossy=config.persist.lossy, lossy_bits=config.persist.lossy_bits)
    if config.nnodes == 1 and jobs is None:  # the whole job's memory is in this process's node
        serving.persister = _node_persister(config, durable, shm_dir, job_id, codec, events)
    persister = serving.persister
    coordinator = Coordinator(
        config=config,
        server=server,
        events=events,
        job_id=job_id,
        worker_env=worker_env,
        persister=persister
        if persister is not None
        else _cluster_persister(config.persist, durable, codec, events),
        durable_url=durable.url,
        initial_step=resume.step if resume is not None else None,
        jobs=jobs,
    )
    if resume is not None:
        events.emit(
            ev.Resume(
                url=config.persist.resume,
                step=resume.step,
                world_size=config.world_size,
                checkpoint_world_size=resume.world_size,
            )
        )
    node: NodeAgent | None = None
    if jobs is None:  # node 0's agent lives here; in store mode it is the launcher's
        node = _local_node(config, serving, command=command, shm_dir=shm_dir, redirect_output=redirect_output)
    try:
        serving.metrics = start_status_server(
            coordinator, events=events, secret=serving.secret, job_dir=job_dir
        )
    except BaseException:  # a busy --metrics-port: nothing of the job stays behind
        server.close()
        events.close()
        serving.release_lock()
        serving.remove_secret()
        raise
    write_job_info(
        job_dir,
        job_id=job_id,
        control=server.address,
        checkpoints=durable.url,
        secret_file=serving.secret_file,
        metrics=serving.metrics,
    )
    restore_handlers = install_signal_handlers(stop)
    events.emit(
        ev.JobStart(
            job_id=job_id,
            nnodes=config.nnodes,
            nproc=config.nproc_per_node,
            spares=config.spares,
            control=f"{server.address[0]}:{server.address[1]}",
            command=command,
            faults=[f.to_text() for f in faults],
        )
    )
    t0 = time.monotonic()
    if persister is not None:
        persister.start()
    if serving.node_thread is not None:
        serving.node_thread.start()
    try:
        result = coordinator.run(stop)
    finally:
        _wind_down(serving, coordinator, t0=t0, restore_handlers=restore_handlers)
    if node is not None and node.memory is not None and node.memory.error is not None:
        raise UsageError(node.memory.error)  # its memory tier is too small: exit 2 with the line
    return result


@dataclass
class _Serving:
    """What :func:`serve_coordinator` opened and must close: the event log, the control server,
    the secret (``secret_file``, removed at the end unless the user gave it: ``own_secret``), the
    job's lock, one node's persister, node 0's agent's thread and what it waits on, the status
    server."""

    config: JobConfig
    job_dir: Path
    events: EventLog
    server: ControlServer
    secret: bytes
    secret_file: Path
    own_secret: bool
    lock_fd: int = -1
    lock: Path | None = None
    persister: Persister | None = None
    node_stop: threading.Event = field(default_factory=threading.Event)
    keep_memory: threading.Event = field(default_factory=threading.Event)  # freed after the final persist
    node_thread: threading.Thread | None = None
    metrics: StatusServer | None = None

    def release_lock(self) -> None:
        if self.lock is not None:
            release_lock(self.lock_fd, self.lock)

    def remove_secret(self) -> None:
        if self.own_secret:
            self.secret_file.unlink(missing_ok=True)


def _open_control(config: JobConfig, job_dir: Path) -> _Serving:
    """The coordinator's secret, the event log and the control server, bound first: a busy port
    must leave no secret file behind; then the secret written (unless the user gave its file)."""
    secret = coordinator_secret(config.control)
    events = EventLog(job_dir / "events.jsonl")
    host, port = config.coordinator_addr
    try:
        server = ControlServer(
            host=host,
            port=port,
            secret=secret,
            on_refused=lambda peer, why: events.emit(ev.Refused(peer=peer, reason=why)),
        )
    except BaseException:
        events.close()
        raise
    own_secret = config.control.secret_file is None
    secret_file = config.control.secret_file or job_dir / SECRET_FILE
    if own_secret:
        try:
            write_secret(secret_file, secret)
        except BaseException:
            server.close()
            events.close()
            raise
    return _Serving(
        config=config,
        job_dir=job_dir,
        events=events,
        server=server,
        secret=secret,
        secret_file=secret_file,
        own_secret=own_secret,
    )


def _local_node(
    config: JobConfig, serving: _Serving, *, command: list[str], shm_dir: Path, redirect_output: bool
) -> NodeAgent:
    """Node 0's agent, in this process (its thread made, started with the run): its memory is
    kept until ``serving.keep_memory`` is set, after the final persist."""
    node = NodeAgent(
        spec=node_spec(config),
        coordinator=serving.server.address,
        secret=serving.secret,
        secret_file=serving.secret_file,
        command=command,
        env=node_env(config, config.coordinator_addr[0]),
        job_dir=serving.job_dir,
        shm_dir=shm_dir,
        redirect_output=redirect_output,
        in_process=True,
    )
    node.release = serving.keep_memory
    serving.node_thread = threading.Thread(
        target=node.run, args=(serving.node_stop,), name="nonstop-node", daemon=True
    )
    return node


def _wind_down(
    serving: _Serving, coordinator: Coordinator, *, t0: float, restore_handlers: Callable[[], None]
) -> None:
    """Before exit (done, failed, SIGTERM): make the committed step durable while the snapshot
    memory still exists; then stop node 0's agent, close the servers, log the job's end and give
    back the lock, the secret and the job's info."""
    config, persister, job_dir = serving.config, serving.persister, serving.job_dir
    try:
        if persister is not None:
            done = persister.flush(config.persist.timeout_s)
            if done is None and persister.last_error:
                log.warning("final persist failed: %s", persister.last_error)
            persister.stop()
    finally:
        serving.keep_memory.set()
        serving.node_stop.set()
        if serving.node_thread is not None:
            serving.node_thread.join(timeout=30.0)
        serving.server.close()
        if serving.metrics is not None:
            serving.metrics.close(job_dir)
        serving.events.emit(
            ev.JobEnd(
                state=str(coordinator.state),
                seconds=time.monotonic() - t0,
                generation=coordinator.generation,
                error=coordinator.error,
                replication=coordinator.replication_stats(),
            )
        )
        serving.events.close()
        restore_handlers()
        serving.release_lock()
        serving.remove_secret()
        (job_dir / JOB_INFO).unlink(missing_ok=True)


def _worker_env(config: JobConfig, faults: list[FaultSpec], *, store_mode: bool) -> dict[str, str]:
    """What every worker process of the job finds in its environment from the coordinator (the
    settings it reads as :class:`~nonstop.config.WorkerEnv`), beside torchrun's variables."""
    return {
        ENV.FAULTS: faults_to_json(faults),
        ENV.HEARTBEAT_INTERVAL: str(config.detection.detector.heartbeat_interval_s),
        ENV.REBUILD_TIMEOUT: str(config.detection.rebuild_timeout_s),
        ENV.SNAPSHOT: config.snapshot.mode,
        ENV.SNAPSHOT_EVERY: str(config.snapshot.every),
        ENV.SNAPSHOT_BUDGET: str(config.snapshot.budget),
        ENV.RECONNECT: str(config.control.reconnect_s if store_mode else 0),
        **({ENV.MESH: config.mesh} if config.mesh is not None else {}),
        ENV.ELASTIC: "1" if config.min_world < config.world_size else "0",
        ENV.KEEP_GROUPS: "1" if config.keep_groups else "0",
        ENV.NODE_COPY: str(config.node_copy_groups),  # (WorkerEnv.node_copy: not "0")
    }


def _node_persister(
    config: JobConfig, durable: DurableStore, shm_dir: Path, job_id: str, codec: CodecConfig, events: EventLog
) -> Persister:
    """A job of one node: its memory is all in this process's node, persisted from here."""
    return Persister(
        durable=durable,
        shm_dir=shm_dir,
        job_id=local_store_id(job_id, "0"),
        world_size=config.nproc_per_node,
        codec=codec,
        every=config.persist.every,
        emit=events.emit,
    )


MAX_COORDINATOR_RESTARTS = 20


def run_store_node0(
    config: JobConfig, *, command: list[str], job_dir: Path, stop: threading.Event, redirect_output: bool
) -> JobResult:
    """Node 0 with ``--store etcd://``: the coordinator runs as its own process (restarted here
    when it dies, resuming from the store), node 0's agent runs in this process like any
    other node's. Returns the coordinator's result."""
    DurableStore(config.checkpoint_url, keep=config.persist.keep)  # a bad URL fails here
    if config.persist.resume:
        load_resume(config)
    secret = coordinator_secret(config.control)
    try:
        open_store(config.control.store, secret=secret.decode()).close()  # reachable, credentials good
    except ControlError as e:
        raise UsageError(f"--store {config.control.store}: {e}") from None
    job_id = uuid.uuid4().hex[:12]
    spec = job_dir / COORDINATOR_SPEC
    spec.write_text(json.dumps({"job_id": job_id, "config": job_config_to_json(config)}))
    result_file = job_dir / COORDINATOR_RESULT
    result_file.unlink(missing_ok=True)
    (job_dir / JOB_INFO).unlink(missing_ok=True)
    (job_dir / "logs").mkdir(exist_ok=True)
    supervisor = threading.Thread(
        target=_supervise_coordinator,
        args=(spec, job_dir / "logs" / "coordinator.log", result_file, stop),
        name="nonstop-coordinator-supervisor",
        daemon=True,
    )
    supervisor.start()
    deadline = time.monotonic() + 60.0
    while not (job_dir / JOB_INFO).exists():
        if not supervisor.is_alive() or time.monotonic() > deadline:
            raise JobFailedError(f"the coordinator did not start; see {job_dir / 'logs' / 'coordinator.log'}")
        time.sleep(0.02)
    node = run_node(
        config,
        command=command,
        job_dir=job_dir,
        stop=stop,
        redirect_output=redirect_output,
    )
    supervisor.join(timeout=config.persist.timeout_s + 60.0)
    try:
        return result_from_json(result_file.read_text())
    except (OSError, ValueError, KeyError) as e:
        return JobResult(
            state=JobState.FAILED, generation=0, final_step=0, error=node.error or f"no result: {e}"
        )


def _supervise_coordinator(spec: Path, log_path: Path, result_file: Path, stop: threading.Event) -> None:
    """Run the coordinator process; start it again (it resumes from the store) until the job ended."""
    for restart in range(MAX_COORDINATOR_RESTARTS + 1):
        cmd = [sys.executable, "-m", "nonstop.launch.coordproc", str(spec), str(restart)]
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        signalled = False
        while proc.poll() is None:
            if stop.is_set() and not signalled:
                proc.send_signal(signal.SIGTERM)  # it persists and ends the job
                signalled = True
            time.sleep(0.05)
        if result_file.exists() or stop.is_set():
            return
        log.warning("the coordinator exited (%s); starting it again", describe_exit(proc.returncode))
        time.sleep(0.1)
    log.error("the coordinator died %d times; giving up", MAX_COORDINATOR_RESTARTS + 1)


def _cluster_persister(
    persist: PersistConfig, durable: DurableStore, codec: CodecConfig, events: EventLog
) -> ClusterPersister:
    """Persist rounds across the nodes (the coordinator attaches itself to send them)."""
    return ClusterPersister(
        durable=durable,
        codec=codec,
        every=persist.every,
        timeout_s=persist.timeout_s,
        emit=events.emit,
    )
