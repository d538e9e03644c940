"""``nonstop gc``: find and remove what a crashed launcher left behind.

A live launcher holds an exclusive ``flock`` on ``nonstop-<job>.lock`` in the
shared-memory directory for the whole job, and every node agent one on
``nonstop-<job>.<node>.lock`` (:func:`hold_lock`). A job none of whose locks is
held (or whose segments have no lock file at all) is an orphan: its segments
are deleted and any process still carrying its ``NONSTOP_JOB_ID`` is killed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.config import ENV

__all__ = ["GcReport", "collect_garbage", "hold_lock", "lock_path", "processes_of_job"]

_NAME = re.compile(r"^nonstop-([0-9a-f]+)(?:\.lock|[.-].*)$")


@dataclass
class GcReport:
    jobs: list[str] = field(default_factory=list)
    segments: list[Path] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    live_jobs: list[str] = field(default_factory=list)


def lock_path(shm_dir: Path, name: str) -> Path:
    """The lock file of ``name``: a job id (its launcher) or ``<job>.<node>`` (a node agent)."""
    return shm_dir / f"nonstop-{name}.lock"


def hold_lock(shm_dir: Path, name: str, job_dir: Path) -> tuple[int, Path]:
    """Take ``name``'s lock (exclusive flock) for the caller's lifetime: while it is held,
    ``nonstop gc`` leaves the job's memory and processes alone. Returns (fd, path)."""
    lock = lock_path(shm_dir, name)
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "job_dir": str(job_dir)}).encode())
    return fd, lock


def _is_live(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def processes_of_job(job_id: str) -> list[int]:
    """PIDs of live processes (other than this one) started for ``job_id``."""
    needle = f"{ENV.JOB_ID}={job_id}".encode()
    node_needle = needle + b"."  # a node's processes carry <job>.<node>
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            if any(v == needle or v.startswith(node_needle) for v in env):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def collect_garbage(shm_dir: Path, *, dry_run: bool = False) -> GcReport:
    report = GcReport()
    jobs = set()
    for path in shm_dir.glob("nonstop-*"):
        m = _NAME.match(path.name)
        if m:
            jobs.add(m.group(1))
    for job_id in sorted(jobs):
        # the launcher's lock, and one per node agent (nonstop-<job>.<node>.lock)
        locks = [lock_path(shm_dir, job_id), *shm_dir.glob(f"nonstop-{job_id}.*.lock")]
        if any(_is_live(lock) for lock in locks):
            report.live_jobs.append(job_id)
            continue
        report.jobs.append(job_id)
        for pid in processes_of_job(job_id):
            report.killed.append(pid)
            if not dry_run:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        segments = [
            p
            for p in shm_dir.glob(f"nonstop-{job_id}*")
            if p.name.startswith((f"nonstop-{job_id}-", f"nonstop-{job_id}."))
            and not p.name.endswith(".lock")
        ]
        report.segments.extend(segments)
        if not dry_run:
            for seg in segments:
                seg.unlink(missing_ok=True)
            for lock in locks:
                lock.unlink(missing_ok=True)
    return report
