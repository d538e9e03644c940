"""``nonstop gc``: find and remove what a crashed launcher left behind.

A live launcher holds an exclusive ``flock`` on ``nonstop-<job>.lock`` in the
shared-memory directory for the whole job. A job whose lock can be taken (or
whose segments have no lock file at all) is an orphan: its segments are
deleted and any process still carrying its ``NONSTOP_JOB_ID`` is killed.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.config import ENV
from nonstop.runtime.agent import remove_segments

__all__ = ["GcReport", "collect_garbage", "processes_of_job"]

_NAME = re.compile(r"^nonstop-([0-9a-f]+)(?:\.lock|-.*)$")


@dataclass
class GcReport:
    jobs: list[str] = field(default_factory=list)
    segments: list[Path] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    live_jobs: list[str] = field(default_factory=list)


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
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
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
        lock = shm_dir / f"nonstop-{job_id}.lock"
        if _is_live(lock):
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
        if dry_run:
            report.segments.extend(shm_dir.glob(f"nonstop-{job_id}-*"))
        else:
            report.segments.extend(remove_segments(shm_dir, job_id))
            lock.unlink(missing_ok=True)
    return report
