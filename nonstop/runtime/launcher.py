"""``nonstop run``: start one single-node job and see it through.

Order of events: validate input (fail before anything starts), create the job
dir, the per-job secret (0600 file) and a lock file in shared memory that the
launcher holds for its lifetime (``nonstop gc`` uses it to tell live jobs
from orphans), start the control server on the given address, spawn the
workers and spares, and run the coordinator until the job is done or fails.
Whatever happens — normal end, SIGINT/SIGTERM, an exception — every child is
stopped and every shared-memory segment of the job is deleted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from nonstop.config import ENV, JobConfig
from nonstop.control.channel import ControlServer, new_secret
from nonstop.errors import SnapshotMissingError, UsageError
from nonstop.faults import faults_to_json, parse_fault
from nonstop.runtime.agent import Agent
from nonstop.runtime.coordinator import Coordinator, JobResult
from nonstop.runtime.eventlog import EventLog
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import DurableStore, LoadedCheckpoint
from nonstop.snapshot.persist import Persister

log = logging.getLogger(__name__)

__all__ = ["default_shm_dir", "lock_path", "run_job", "worker_command"]


def default_shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")


def lock_path(shm_dir: Path, job_id: str) -> Path:
    return shm_dir / f"nonstop-{job_id}.lock"


def worker_command(script: str, args: tuple[str, ...]) -> list[str]:
    """The command line of a worker: ``-m module`` or a script path."""
    if script.startswith("-m "):
        return [sys.executable, "-u", "-m", script[3:].strip(), *args]
    path = Path(script)
    if not path.is_file():
        raise UsageError(f"training script {script!r} not found: give the path of a Python file")
    return [sys.executable, "-u", str(path), *args]


def _prepare_job_dir(job_dir: Path) -> None:
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        probe = job_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(
            f"job dir {str(job_dir)!r} is not writable ({e.strerror or e}): choose another with --job-dir"
        ) from None
    for sub in ("rdzv", "faults"):
        shutil.rmtree(job_dir / sub, ignore_errors=True)
        (job_dir / sub).mkdir()


def run_job(
    config: JobConfig, *, redirect_output: bool = False, stop: threading.Event | None = None
) -> JobResult:
    """Run the job described by ``config`` to the end; always cleans up.

    Raises UsageError for bad input before starting anything.
    """
    command = worker_command(config.script, config.script_args)
    faults = [parse_fault(f) for f in config.faults]
    for f in faults:
        if f.rank >= config.nproc_per_node:
            raise UsageError(
                f"fault {f.to_text()!r} names rank {f.rank}, but the job has ranks "
                f"0..{config.nproc_per_node - 1}"
            )
    job_dir = config.job_dir.resolve()
    _prepare_job_dir(job_dir)
    durable = DurableStore(config.checkpoint_url, keep=config.keep)  # a bad URL fails here
    resume = _load_resume(config) if config.resume else None
    job_id = uuid.uuid4().hex[:12]
    shm_dir = default_shm_dir()
    secret = new_secret()
    events = EventLog(job_dir / "events.jsonl")
    stop = stop or threading.Event()
    try:  # bind first: a busy port must leave no secret file behind
        server = ControlServer(
            host=config.host,
            port=config.port,
            secret=secret,
            on_refused=lambda peer, why: events.emit("refused", peer=peer, reason=why),
        )
    except BaseException:
        events.close()
        raise
    secret_file = job_dir / "secret"
    fd = os.open(secret_file, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    os.write(fd, secret)
    os.close(fd)
    lock = lock_path(shm_dir, job_id)
    lock_fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    os.write(lock_fd, json.dumps({"pid": os.getpid(), "job_dir": str(job_dir)}).encode())

    env = dict(os.environ)
    env.update(dict(config.extra_env))
    env.update(
        {
            ENV.JOB_ID: job_id,
            ENV.JOB_DIR: str(job_dir),
            ENV.CONTROL: f"{server.address[0]}:{server.address[1]}",
            ENV.SECRET_FILE: str(secret_file),
            ENV.SHM_DIR: str(shm_dir),
            ENV.FAULTS: faults_to_json(faults),
            ENV.HEARTBEAT_INTERVAL: str(config.detector.heartbeat_interval_s),
            ENV.REBUILD_TIMEOUT: str(config.rebuild_timeout_s),
            ENV.SNAPSHOT: config.snapshot,
        }
    )
    if config.host in ("127.0.0.1", "localhost", "::1"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # Like torchrun: do not let N workers each start one thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // config.nproc_per_node)))

    agent = Agent(
        job_id=job_id,
        job_dir=job_dir,
        shm_dir=shm_dir,
        command=command,
        env=env,
        redirect_output=redirect_output,
    )
    initial_step = None
    if resume is not None:
        agent.install(resume.step, resume.ranks)
        initial_step = resume.step
        events.emit("resume", url=config.resume, step=resume.step, world_size=resume.world_size)
    persister = Persister(
        durable=durable,
        shm_dir=shm_dir,
        job_id=job_id,
        world_size=config.nproc_per_node,
        codec=CodecConfig(lossy=config.lossy, lossy_bits=config.lossy_bits),
        every=config.persist_every,
        emit=events.emit,
    )
    coordinator = Coordinator(
        config=config,
        agent=agent,
        server=server,
        events=events,
        persister=persister,
        initial_step=initial_step,
    )
    _write_job_info(job_dir, job_id=job_id, control=server.address, checkpoints=durable.url)
    restore_handlers = _install_signal_handlers(stop)
    events.emit(
        "job_start",
        job_id=job_id,
        nproc=config.nproc_per_node,
        spares=config.spares,
        control=f"{server.address[0]}:{server.address[1]}",
        command=command,
        faults=[f.to_text() for f in faults],
    )
    t0 = time.monotonic()
    persister.start()
    try:
        result = coordinator.run(stop)
    finally:
        # Before exit (done, failed, SIGTERM): make the committed step durable while the
        # snapshot memory still exists.
        done = persister.flush(config.persist_timeout_s)
        if done is None and persister.last_error:
            log.warning("final persist failed: %s", persister.last_error)
        persister.stop()
        agent.shutdown()
        server.close()
        events.emit(
            "job_end",
            state=str(coordinator.state),
            seconds=time.monotonic() - t0,
            generation=coordinator.generation,
            error=coordinator.error,
        )
        events.close()
        restore_handlers()
        shutil.rmtree(job_dir / "rdzv", ignore_errors=True)
        os.close(lock_fd)
        lock.unlink(missing_ok=True)
        secret_file.unlink(missing_ok=True)
        (job_dir / JOB_INFO).unlink(missing_ok=True)
    return result


JOB_INFO = "job.json"


def _write_job_info(job_dir: Path, *, job_id: str, control: tuple[str, int], checkpoints: str) -> None:
    """What ``nonstop persist`` needs to reach this job (the secret is a separate 0600 file)."""
    info = {
        "job_id": job_id,
        "pid": os.getpid(),
        "control": f"{control[0]}:{control[1]}",
        "checkpoints": checkpoints,
    }
    tmp = job_dir / f".{JOB_INFO}.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(job_dir / JOB_INFO)


def _load_resume(config: JobConfig) -> LoadedCheckpoint:
    """The newest good checkpoint at ``--resume``, checked against the job's world size."""
    assert config.resume is not None
    try:
        return DurableStore(config.resume, keep=config.keep).load(world_size=config.nproc_per_node)
    except SnapshotMissingError as e:
        raise UsageError(f"--resume {config.resume}: no loadable checkpoint ({e})") from None


def _install_signal_handlers(stop: threading.Event) -> Callable[[], None]:
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore
