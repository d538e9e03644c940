"""A job's directories and its secret: one job per job dir and per checkpoint root, and a
secret file no other local user can read, replace or redirect.

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

The secret: at least :data:`MIN_SECRET_BYTES` bytes wherever it comes from (``--secret-file``,
``$NONSTOP_SECRET``, ``JOB_DIR/secret``). A secret file is written by :func:`write_secret`
(0600, under a fresh name opened ``O_EXCL|O_NOFOLLOW``, then renamed into place: a planted file
or symlink is replaced, never written through) and read by :func:`read_secret_file`, which
refuses one that other users may read or write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

from nonstop.config import ENV, JobConfig
from nonstop.control.channel import MIN_SECRET_BYTES, new_secret
from nonstop.errors import UsageError

__all__ = [
    "LOCK_FILE",
    "MIN_SECRET_BYTES",
    "SECRET_FILE",
    "check_secret",
    "coordinator_secret",
    "local_root",
    "hold_dir",
    "hold_job",
    "node_secret",
    "read_secret_file",
    "write_secret",
]

log = logging.getLogger(__name__)

LOCK_FILE = ".nonstop.lock"
SECRET_FILE = "secret"  # JOB_DIR/secret: node 0's secret, when none was given
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


# ---------------------------------------------------------------------------- the secret
def check_secret(secret: bytes, where: str) -> bytes:
    """``secret`` when it is long enough; UsageError naming ``where`` it came from otherwise."""
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(
            f"{where} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}: use a real secret "
            "(e.g. the output of `openssl rand -hex 32`)"
        )
    return secret


def read_secret_file(path: Path, *, what: str, follow: bool = True) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped). UsageError when it cannot be
    read, is not a regular file, is a symlink (``follow=False``), other users may read or
    write it, or it is too short."""
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{what} {path} is not a regular file: give the path of a file")
        if st.st_mode & 0o077:
            raise UsageError(
                f"{what} {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}"
            )
        data = b""
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return check_secret(data.strip(), f"{what} {path}")


def write_secret(path: Path, secret: bytes) -> None:
    """Make ``path`` a 0600 file holding ``secret``: written under a fresh name (``O_EXCL |
    O_NOFOLLOW``: no planted file or symlink is reused), fsynced, renamed over ``path``
    (replacing whatever is there, never writing through it). UsageError when that fails."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600)
    except OSError as e:
        raise UsageError(f"cannot write the job secret to {path}: {e.strerror or e}") from None
    try:
        try:
            os.fchmod(fd, 0o600)  # the mode asked for, whatever the umask
            view = memoryview(secret)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write the job secret to {path}: {e.strerror or e}") from None


def coordinator_secret(config: JobConfig) -> bytes:
    """Node 0's secret: ``--secret-file``, else ``$NONSTOP_SECRET``, else a fresh one."""
    if config.secret_file is not None:
        return read_secret_file(config.secret_file, what="--secret-file")
    env = os.environ.get(ENV.SECRET)
    if env:
        return check_secret(env.encode(), f"${ENV.SECRET}")
    return new_secret()


def node_secret(config: JobConfig, job_dir: Path) -> tuple[bytes, Path]:
    """Another node's secret and the file its workers read it from: ``--secret-file``; else
    ``$NONSTOP_SECRET``, written to this node's private ``JOB_DIR/.secret-node-N``; else node 0's
    ``JOB_DIR/secret`` (a shared job dir)."""
    if config.secret_file is not None:
        return read_secret_file(config.secret_file, what="--secret-file"), config.secret_file
    env = os.environ.get(ENV.SECRET)
    if env:
        secret = check_secret(env.encode(), f"${ENV.SECRET}")
        path = job_dir / f".secret-node-{config.node_rank}"
        write_secret(path, secret)
        return secret, path
    path = job_dir / SECRET_FILE
    if not os.path.lexists(path):
        raise UsageError(
            f"node {config.node_rank}: no job secret: pass --secret-file (node 0 writes {path}) "
            f"or set {ENV.SECRET}"
        )
    return read_secret_file(path, what="the job secret file", follow=False), path
