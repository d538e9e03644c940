"""``nonstop gc``: find and remove what a crashed launcher left behind.

A live launcher holds an exclusive ``flock`` on ``nonstop-<job>.lock`` in the
shared-memory directory for the whole job, and every node agent one on
``nonstop-<job>.<node>.lock`` (:func:`hold_lock`). A job none of whose locks is
held (or whose segments have no lock file at all) is an orphan: its segments
are deleted and any process still carrying its ``NONSTOP_JOB_ID`` is killed.

Races: a lock file appears under its name already locked (:func:`hold_lock`
writes it under a temporary name gc does not look at, locks it, then links it
into place), so gc never takes a starting job for an orphan; gc holds an
orphan's locks while it deletes its segments and unlinks the lock files (only
the file it holds: a holder that takes over a stale lock of the same name checks
that it still is the file under that name). What gc cannot open or delete
(another user's files) it leaves alone, logs, and lists in
:attr:`GcReport.skipped`; a job with a lock file gc cannot open is left alone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nonstop.config import ENV

__all__ = ["GcReport", "collect_garbage", "hold_lock", "lock_path", "processes_of_job", "release_lock"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^nonstop-([0-9a-f]+)(?:\.lock|[.-].*)$")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class GcReport:
    jobs: list[str] = field(default_factory=list)
    segments: list[Path] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    live_jobs: list[str] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)  # could not be opened or deleted: left alone


def lock_path(shm_dir: Path, name: str) -> Path:
    """The lock file of ``name``: a job id (its launcher) or ``<job>.<node>`` (a node agent)."""
    return shm_dir / f"nonstop-{name}.lock"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def hold_lock(shm_dir: Path, name: str, job_dir: Path) -> tuple[int, Path]:
    """Take ``name``'s lock (exclusive flock) for the caller's lifetime: while it is held,
    ``nonstop gc`` leaves the job's memory and processes alone. Returns (fd, path); give it
    back with :func:`release_lock`. The file is never visible unlocked (see the module); a
    stale file of the same name is taken over once its holder is gone (blocks until then)."""
    lock = lock_path(shm_dir, name)
    info = json.dumps({"pid": os.getpid(), "job_dir": str(job_dir)}).encode()
    while True:
        tmp = shm_dir / f".nonstop-tmp-{os.getpid()}-{secrets.token_hex(4)}.lock"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | _CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows this name: at once
            os.write(fd, info)
            os.link(tmp, lock)
            return fd, lock
        except FileExistsError:
            os.close(fd)
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        try:  # a lock file of this name exists: a holder's, or a stale one
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | _CLOEXEC)
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, lock):
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
            return fd, lock
        os.close(fd)  # gc removed it while we waited: start again


def release_lock(fd: int, lock: Path) -> None:
    """Give back a lock :func:`hold_lock` took: its file is removed while still held."""
    if _same_file(fd, lock):
        lock.unlink(missing_ok=True)
    os.close(fd)


def _probe(lock: Path, report: GcReport) -> int | Literal["live", "unknown"] | None:
    """Look at one lock file: ``"live"`` when a holder has it, None when it is gone,
    ``"unknown"`` when it could not be opened or locked (reported), else the fd of the lock,
    now held by us."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("gc: cannot open %s (%s): leaving its job alone", lock, e.strerror or e)
        report.skipped.append(lock)
        return "unknown"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "live"
    except OSError as e:
        os.close(fd)
        log.warning("gc: cannot lock %s (%s): leaving its job alone", lock, e.strerror or e)
        report.skipped.append(lock)
        return "unknown"
    return fd


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
    """Delete the segments of every orphaned job in ``shm_dir`` and kill its processes (see
    the module); with ``dry_run`` only report what would go. Never raises for a file or
    process it may not touch: that is logged and reported in ``skipped``."""
    report = GcReport()
    jobs = set()
    for path in shm_dir.glob("nonstop-*"):
        m = _NAME.match(path.name)
        if m:
            jobs.add(m.group(1))
    for job_id in sorted(jobs):
        # the launcher's lock, and one per node agent (nonstop-<job>.<node>.lock)
        locks = [lock_path(shm_dir, job_id), *shm_dir.glob(f"nonstop-{job_id}.*.lock")]
        held: list[tuple[Path, int]] = []
        verdict: str | None = None  # "live", "unknown" (left alone), None: an orphan so far
        for lock in locks:
            probe = _probe(lock, report)
            if isinstance(probe, str):
                verdict = probe
                if probe == "live":
                    break
            elif probe is not None:
                held.append((lock, probe))
        try:
            if verdict is not None:
                if verdict == "live":
                    report.live_jobs.append(job_id)
                continue
            report.jobs.append(job_id)
            _remove_orphan(shm_dir, job_id, report, dry_run=dry_run)
            if not dry_run:
                for lock, fd in held:
                    if _same_file(fd, lock):
                        _unlink(lock, report)
        finally:
            for _, fd in held:
                os.close(fd)
    return report


def _unlink(path: Path, report: GcReport) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("gc: cannot remove %s (%s): left in place", path, e.strerror or e)
        report.skipped.append(path)


def _remove_orphan(shm_dir: Path, job_id: str, report: GcReport, *, dry_run: bool) -> None:
    """Kill an orphaned job's processes and delete its segments (the caller holds its locks)."""
    for pid in processes_of_job(job_id):
        if dry_run:
            report.killed.append(pid)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except PermissionError:
            log.warning("gc: may not kill pid %d of job %s: left running", pid, job_id)
            continue
        report.killed.append(pid)
    segments = [
        p
        for p in shm_dir.glob(f"nonstop-{job_id}*")
        if p.name.startswith((f"nonstop-{job_id}-", f"nonstop-{job_id}.")) and not p.name.endswith(".lock")
    ]
    report.segments.extend(segments)
    if not dry_run:
        for seg in segments:
            _unlink(seg, report)
