"""A job's directories: one job per job dir and per checkpoint root.

One job at a time (:func:`hold_job`): the launcher of a job (node 0, the job's owner) holds an
exclusive ``flock`` on ``JOB_DIR/.nonstop.lock`` and, when its checkpoints are on a local file
system, on ``ROOT/.nonstop.lock`` of the checkpoint root, from before it creates, clears or
overwrites anything in either until the job has ended. A second job given either is refused
with a one-line :class:`~nonstop.errors.UsageError` (exit status 2) before it has touched
anything. The other nodes of the same job share the job dir without the lock: they read node
0's secret and add files of their own (``logs/``, ``.secret-node-N``), never clear it. The lock
file stays behind when the job ends (unlinking a flock'ed file races with the next taker). Not
locked: a checkpoint root on an object store (an fsspec URL; one writer per such root stays
the user's to ensure) and a file system that refuses ``flock`` (some NFS mounts: the job goes on
and says so in a warning).

Permissions: a job dir or checkpoint root created here is 0700 (what is in a job dir -- events,
logs, the control address, the secret -- is its user's alone; see
:class:`~nonstop.snapshot.durable.local.LocalStorage` for checkpoint files). An existing
directory keeps its mode: a user who wants their group to read a job's files creates the dir
with the mode they want.

The job's secret is :mod:`nonstop.control.secret`'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from nonstop.errors import UsageError

__all__ = [
    "LOCK_FILE",
    "local_root",
    "hold_dir",
    "hold_job",
]

log = logging.getLogger(__name__)

LOCK_FILE = ".nonstop.lock"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# ---------------------------------------------------------------------------- one job per dir
def _not_writable(what: str, directory: Path, option: str, e: OSError) -> UsageError:
    return UsageError(
        f"{what} {str(directory)!r} is not writable ({e.strerror or e}): choose another with {option}"
    )


def _holder(fd: int) -> str:
    """`` (pid P on HOST)`` of the lock's holder as it wrote itself down, or ``""``."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f" (pid {int(info['pid'])} on {info['host']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _lock_dir(directory: Path, *, what: str, option: str) -> int | None:
    """Create ``directory`` (0700) if missing and take its lock; the fd that holds it (None
    where the file system has no flock). UsageError when another process holds it."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as e:
        raise _not_writable(what, directory, option, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise UsageError(
            f"{what} {str(directory)!r} is in use by another job{holder}: wait for it to end, "
            f"or choose another with {option}"
        ) from None
    except OSError as e:
        os.close(fd)
        log.warning("cannot lock %s (%s): a second job given it would not be refused", directory, e)
        return None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise _not_writable(what, directory, option, e) from None
    return fd


def local_root(url: str) -> Path | None:
    """The directory of a checkpoint location on a local file system; None for other URLs."""
    if url.startswith("file://"):
        return Path(url[len("file://") :] or "/")
    return None if "://" in url else Path(url)


@contextlib.contextmanager
def hold_dir(directory: Path, *, what: str, option: str) -> Iterator[None]:
    """Hold ``directory``'s lock for the ``with`` body (created 0700 if missing). UsageError
    naming ``what`` and the ``option`` to choose another, nothing touched, when another
    process holds it. For a command that clears a directory before it runs jobs in it (the
    demo): lock the directory above the job dirs, which the jobs lock themselves."""
    fd = _lock_dir(directory, what=what, option=option)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def hold_job(job_dir: Path, checkpoint_url: str) -> Iterator[None]:
    """Hold the job dir's lock and (local roots) the checkpoint root's for the ``with`` body;
    both are taken before anything in them is created, cleared or overwritten, the job dir's
    first. UsageError (nothing touched) when another job holds either."""
    with contextlib.ExitStack() as held:
        held.enter_context(hold_dir(job_dir, what="job dir", option="--job-dir"))
        root = local_root(checkpoint_url)
        if root is not None and root.resolve() != job_dir.resolve():
            held.enter_context(hold_dir(root, what="checkpoint root", option="--persist"))
        yield
