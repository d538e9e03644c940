"""Checkpoints on any fsspec file system (``memory://``, ``s3://``, ``gs://``, ``file://``,
...): :class:`FsspecStorage`. Named ``remote`` so that it never shadows the ``fsspec``
package it imports.

Contract: :meth:`FsspecStorage.write` returns once the object is published. Object stores
publish an object whole when its upload completes; on fsspec's local file system the object
is written under a temporary name (:data:`~.format.TMP_MARK`), fsynced and moved into
place; a failed write is discarded, never published. Thread safety is that of the
underlying fsspec file system (the common ones allow concurrent calls).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from typing import Any

from nonstop.errors import SnapshotMissingError, UsageError
from nonstop.snapshot.codec import Buffer
from nonstop.snapshot.durable.format import TMP_MARK, one_line
from nonstop.snapshot.durable.storage import byte_view, check_rel, fsync_dir

__all__ = ["FsspecStorage"]


def _fsspec_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec.core
    except ImportError:
        raise UsageError(f"checkpoint URL {url} needs fsspec: pip install fsspec") from None
    protocol = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ValueError as e:
        raise UsageError(f"checkpoint URL {url}: unknown protocol {protocol!r} ({one_line(e)})") from None
    except ImportError as e:
        raise UsageError(f"checkpoint URL {url}: {one_line(e)}") from None
    return fs, str(root).rstrip("/")


class FsspecStorage:
    """Any fsspec file system (``memory://``, ``s3://``, ``gs://``, ``file://``, ...).

    Object stores publish an object whole when its writer closes, so a reader never sees a
    partial object; on fsspec's local file system the object is written to a temporary name,
    fsynced and moved into place. A failed write is discarded, never published.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        if "://" not in url:
            raise ValueError(f"FsspecStorage needs a URL with a protocol (got {url!r}); use LocalStorage")
        self.url = url.rstrip("/")
        self.fs, self.root = _fsspec_fs(url, storage_options)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._local = "file" in protocols or "local" in protocols

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _full(self, path: str) -> str:
        parts = check_rel(path)
        return "/".join([self.root, *parts]) if parts else self.root

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        full = self._full(path)
        parent = full.rsplit("/", 1)[0]
        target = f"{full}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}" if self._local else full
        if self._local:
            self.fs.makedirs(parent, exist_ok=True)
        f = self.fs.open(target, "wb")
        total = 0
        try:
            if self._local:  # the owner's alone, as LocalStorage's (object stores: their ACLs)
                os.fchmod(f.fileno(), 0o600)
            for chunk in chunks:
                mv = byte_view(chunk)
                f.write(mv)
                total += len(mv)
            if self._local:
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            discard = getattr(f, "discard", None)
            try:
                if callable(discard):
                    discard()
                f.close()
            finally:
                if self.fs.exists(target):
                    self.fs.rm(target)
            raise
        f.close()
        if self._local:
            self.fs.mv(target, full)
            fsync_dir(parent)
        return total

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self._full(path)
        end = None if length is None else offset + length
        try:
            return bytes(self.fs.cat_file(full, start=offset, end=end))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def listdir(self, path: str) -> list[str]:
        full = self._full(path)
        try:
            self.fs.invalidate_cache(full)
            entries = self.fs.ls(full, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != full}
        return sorted(n for n in names if n)

    def remove_tree(self, path: str) -> None:
        full = self._full(path)
        try:
            if self.fs.exists(full):
                self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None
