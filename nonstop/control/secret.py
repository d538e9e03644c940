"""A job's secret, the root of every key its channels derive, and the files that hold it: a
secret file no other local user can read, replace or redirect.

The secret: at least :data:`MIN_SECRET_BYTES` bytes wherever it comes from (``--secret-file``,
``$NONSTOP_SECRET``, ``JOB_DIR/secret``). A secret file is written by :func:`write_secret`
(0600, under a fresh name opened ``O_EXCL|O_NOFOLLOW``, then renamed into place: a planted file
or symlink is replaced, never written through) and read by :func:`read_secret_file`, which
refuses one that other users may read or write.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from nonstop.config import ENV, ControlConfig, JobConfig
from nonstop.control.channel import MIN_SECRET_BYTES, new_secret
from nonstop.errors import UsageError

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_FILE",
    "check_secret",
    "coordinator_secret",
    "node_secret",
    "read_secret_file",
    "write_secret",
]

SECRET_FILE = "secret"  # JOB_DIR/secret: node 0's secret, when none was given
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


def coordinator_secret(control: ControlConfig) -> bytes:
    """Node 0's secret: ``--secret-file``, else ``$NONSTOP_SECRET``, else a fresh one."""
    if control.secret_file is not None:
        return read_secret_file(control.secret_file, what="--secret-file")
    env = os.environ.get(ENV.SECRET)
    if env:
        return check_secret(env.encode(), f"${ENV.SECRET}")
    return new_secret()


def node_secret(config: JobConfig, job_dir: Path) -> tuple[bytes, Path]:
    """Another node's secret and the file its workers read it from: ``--secret-file``; else
    ``$NONSTOP_SECRET``, written to this node's private ``JOB_DIR/.secret-node-N``; else node 0's
    ``JOB_DIR/secret`` (a shared job dir)."""
    if config.control.secret_file is not None:
        return read_secret_file(config.control.secret_file, what="--secret-file"), config.control.secret_file
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
