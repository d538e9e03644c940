"""A small tmpfs of a test's own, as a container's ``/dev/shm`` would be (root only; the test is
skipped otherwise), unmounted afterwards whatever happens."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.snapshot.space import free_bytes


def mount_tmpfs(size: str, *, name: str = "smallshm") -> Iterator[Path]:
    """Yield the mount point of a fresh tmpfs of ``size`` (e.g. ``"4m"``) under /tmp."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs)")
    where = Path(f"/tmp/{name}-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, check=False
    )
    if done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill_tmpfs(shm: Path, leave: int) -> Path:
    """A file that leaves ``leave`` bytes free in ``shm`` (another process filling /dev/shm)."""
    filler = shm / "other-process-data"
    fd = os.open(filler, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free_bytes(shm) - leave)
    finally:
        os.close(fd)
    return filler
