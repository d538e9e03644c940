"""The durable tier's front door: :class:`DurableStore`, whole-job checkpoints under one root,
composed of a :class:`~.catalog.Catalog` (what is there, retention), writers
(:class:`~.writer.CheckpointWriter`), a :class:`~.loader.Loader` and the inspect report.

Contract: see :mod:`.format` for what is durable when (a checkpoint is committed once its
manifest is, and current once ``latest`` names it). One writer per root at a time; loads
may run alongside it (they see the old checkpoint or the new one, never a mix). Bad
arguments a person typed (the location, ``keep``) raise UsageError; other API misuse
raises ValueError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from nonstop.errors import UsageError
from nonstop.snapshot.durable import inspect as _inspect
from nonstop.snapshot.durable.catalog import Catalog, CrashHook
from nonstop.snapshot.durable.format import step_dir
from nonstop.snapshot.durable.loader import LoadedCheckpoint, Loader
from nonstop.snapshot.durable.storage import Storage, open_storage
from nonstop.snapshot.durable.writer import CheckpointWriter

__all__ = ["DurableStore"]

T = TypeVar("T")


def _check_step_args(step: int, world_size: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0 (got {step!r})")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1 (got {world_size!r})")


class DurableStore:
    """Whole-job checkpoints under one root (a path or fsspec URL, or a :class:`Storage`).

    ``keep`` committed checkpoints are retained, plus the bases they need. ``threads``
    decoder threads are used when loading (default: the CPU count, at most 8).
    ``_crash_hook`` (tests only) is called with the name of each phase of a persist
    (``bin_partial``, ``bin_written``, ``bins_done``, ``manifest_partial``,
    ``manifest_written``, ``latest_written``, ``retention_partial``, ``retention_done``)."""

    def __init__(
        self,
        url_or_storage: str | os.PathLike[str] | Storage,
        *,
        keep: int = 3,
        threads: int | None = None,
        _crash_hook: CrashHook | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise UsageError(f"keep must be an integer >= 1 (got {keep!r})")
        if threads is None:
            threads = min(8, os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1 (got {threads!r})")
        if isinstance(url_or_storage, str | os.PathLike):
            self.storage: Storage = open_storage(url_or_storage)
        elif isinstance(url_or_storage, Storage):
            self.storage = url_or_storage
        else:
            raise ValueError(f"checkpoint location must be a path, URL or Storage (got {url_or_storage!r})")
        self.url = self.storage.url
        self.keep = keep
        self.threads = threads
        self._crash_hook = _crash_hook
        self._catalog = Catalog(self.storage, keep)
        self._loader = Loader(self._catalog, threads)

    def __repr__(self) -> str:
        return f"DurableStore({self.url!r}, keep={self.keep})"

    # -- listing -------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps (manifest present), ascending."""
        return self._catalog.steps()

    def latest_step(self) -> int | None:
        """The step ``latest`` names; when it is missing or corrupt, the newest committed step."""
        return self._catalog.latest_step()

    def world_size_at(self, step: int) -> int:
        """How many ranks committed checkpoint ``step`` holds (reads its manifest only)."""
        return self._catalog.read_manifest(step).world_size

    # -- writing -------------------------------------------------------------------
    def resumed_from(self, step: int) -> None:
        """This job resumed from ``step`` of this root: the checkpoints newer than it now are
        the timeline it abandoned, which retention may delete (:meth:`Catalog.resumed_from`)."""
        self._catalog.resumed_from(step)

    def begin(self, step: int, world_size: int, codec: str) -> CheckpointWriter:
        """Start writing checkpoint ``step``. An existing directory of that step is removed
        first when it is abandoned, corrupt or not the current checkpoint (nor its base);
        overwriting the current good checkpoint is refused (ValueError)."""
        _check_step_args(step, world_size)
        name = step_dir(step)
        if self.storage.exists(name):
            # a second look before deleting: one failed look (a stale handle, an eventually
            # consistent listing) must not turn the current checkpoint into an abandoned one
            if (
                (self._catalog.has_manifest(name) or self._catalog.has_manifest(name))
                and step in self._catalog.protected()
                and not self.verify(step)
            ):
                raise ValueError(
                    f"{self._catalog.where(step)} is already committed and in use; persist a newer step"
                )
            self.storage.remove_tree(name)
        return CheckpointWriter(self._catalog, step, world_size, codec, self._crash_hook)

    def contribute(self, step: int, world_size: int, codec: str) -> CheckpointWriter:
        """Write some ranks of checkpoint ``step``, which another writer opened with
        :meth:`begin` and will commit (see :class:`CheckpointWriter`). Nothing is removed first."""
        _check_step_args(step, world_size)
        return CheckpointWriter(self._catalog, step, world_size, codec, self._crash_hook, part=True)

    # -- reading -------------------------------------------------------------------
    def load_rank(self, step: int, rank: int) -> tuple[bytes, bytearray]:
        """(meta, raw data) of ``rank`` in checkpoint ``step``, every checksum verified."""
        return self._loader.load_rank(step, rank)

    def load(self, step: int | None = None, *, world_size: int | None = None) -> LoadedCheckpoint:
        """Checkpoint ``step``, or with ``step=None`` the newest good one (see :mod:`.format`).
        SnapshotMissingError when there is none; UsageError when ``world_size`` differs."""
        return self._loader.load(step, world_size=world_size)

    def first_good(self, read: Callable[[int], T], *, defer_warnings: bool = False) -> T:
        """``read(step)`` of the newest step it succeeds on, in the order ``load(None)`` tries
        them (``latest``, then older committed steps); a SnapshotError moves on to the next
        (:meth:`Loader.first_good`). SnapshotMissingError when none is usable."""
        return self._loader.first_good(read, defer_warnings=defer_warnings)

    def verify(self, step: int) -> list[str]:
        """Problems of checkpoint ``step`` (empty when good): reads and checks every byte."""
        return self._loader.verify(step)

    def describe(self, *, verify: bool = True) -> dict[str, Any]:
        """A report of every checkpoint for ``nonstop inspect`` (see :func:`format_inspect`)."""
        return _inspect.describe(self._catalog, self.verify if verify else None)
