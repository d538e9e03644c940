"""Where checkpoints live: the :class:`Storage` contract every backend meets, the helpers the
backends share, and :func:`open_storage`, which picks the backend for a path or URL.

Contract (every backend): paths are relative to the backend's root and use ``/``; a path
that is absolute or climbs out of the root is refused (SnapshotError). :meth:`Storage.write`
returns only once the object is durable, and no reader ever sees it half-written under its
final name (temporary names carry :data:`~.format.TMP_MARK`). Backends may be called from
several threads at once for different paths; one path has one writer at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nonstop.errors import SnapshotError, UsageError
from nonstop.snapshot.codec import Buffer

__all__ = ["Storage", "byte_view", "check_rel", "fsync_dir", "open_storage"]


@runtime_checkable
class Storage(Protocol):
    """Where checkpoints live. Paths are relative to ``url`` and use ``/``."""

    url: str

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write the whole object ``path`` from ``chunks``; return its size. The object is
        durable when this returns and is never visible under ``path`` half-written."""
        ...

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``path`` (to its end when ``length`` is
        None; shorter when the object is). SnapshotMissingError if it does not exist."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path``, sorted; ``[]`` when it does not exist."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove the object or directory tree ``path``; no error when it does not exist."""
        ...

    def size(self, path: str) -> int:
        """Size of object ``path``; SnapshotMissingError if it does not exist."""
        ...


def open_storage(url: str | os.PathLike[str], **kw: Any) -> Storage:
    """Storage for ``url``: a plain path or ``file://`` URL gives :class:`LocalStorage`
    (keyword ``max_bytes_per_s``), any other fsspec protocol :class:`FsspecStorage` (keywords
    are fsspec storage options). UsageError for an empty location or unknown protocol."""
    # The backends import this module's helpers, so they are imported here, not at the top.
    from nonstop.snapshot.durable.local import LocalStorage
    from nonstop.snapshot.durable.remote import FsspecStorage

    s = os.fspath(url)
    if not isinstance(s, str) or not s.strip():
        raise UsageError("checkpoint location is empty: pass a directory path or an fsspec URL")
    if s.startswith("file://"):
        return LocalStorage(s[len("file://") :] or "/", **kw)
    if "://" not in s:
        return LocalStorage(s, **kw)
    protocol = s.split("://", 1)[0]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", protocol):
        raise UsageError(f"checkpoint URL {s}: malformed protocol {protocol!r}")
    return FsspecStorage(s, **kw)


# ---------------------------------------------------------------------------- backend helpers
def check_rel(path: str) -> list[str]:
    """The components of a storage path; SnapshotError when it is absolute or climbs out."""
    parts = [p for p in path.split("/") if p]
    if path.startswith("/") or any(p in (".", "..") for p in parts):
        raise SnapshotError(f"storage path {path!r} must be relative and stay below the root")
    return parts


def byte_view(chunk: Buffer) -> memoryview:
    """The bytes of a C-contiguous buffer, without a copy."""
    mv = chunk.data if isinstance(chunk, np.ndarray) else memoryview(chunk)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def fsync_dir(path: str) -> None:
    """Make the entries of local directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
