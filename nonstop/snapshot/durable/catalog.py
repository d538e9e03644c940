"""What checkpoints one root holds: :class:`Catalog` lists step directories, reads the
``latest`` pointer and manifests, and applies retention after a commit.

Contract: reads never modify the root; :meth:`Catalog.retain` is the only method that
removes anything, and it removes only what :func:`~.retention.to_delete` names (plus
leftover temporary objects), each checkpoint un-committed (its manifest removed) before its
files, so a crash mid-retention never leaves a manifest naming lost files. Thread safety is
that of the storage; retention assumes one writer per root at a time (see the format).
"""

from __future__ import annotations

from collections.abc import Callable

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot.durable import retention
from nonstop.snapshot.durable.format import (
    LATEST,
    LATEST_RE,
    MANIFEST,
    TMP_MARK,
    Manifest,
    decode_manifest,
    parse_step_dir,
    step_dir,
)
from nonstop.snapshot.durable.storage import Storage

__all__ = ["Catalog", "CrashHook"]

CrashHook = Callable[[str], None]


class Catalog:
    """The checkpoints under one :class:`~.storage.Storage` root."""

    def __init__(self, storage: Storage, keep: int) -> None:
        self.storage = storage
        self.url = storage.url
        self.keep = keep

    def where(self, step: int) -> str:
        """How error messages name checkpoint ``step``."""
        return f"checkpoint step {step} ({self.url.rstrip('/')}/{step_dir(step)})"

    # -- listing -------------------------------------------------------------------
    def step_dirs(self) -> dict[int, str]:
        """Every step directory, committed or not: step -> directory name."""
        out: dict[int, str] = {}
        for name in self.storage.listdir(""):
            s = parse_step_dir(name)
            if s is not None:
                out[s] = name
        return out

    def has_manifest(self, name: str) -> bool:
        """Whether step directory ``name`` holds a manifest (is committed; its files may
        still be corrupt)."""
        return self.storage.exists(f"{name}/{MANIFEST}")

    def steps(self) -> list[int]:
        """Committed steps (manifest present), ascending."""
        return sorted(s for s, d in self.step_dirs().items() if self.has_manifest(d))

    def read_latest(self) -> tuple[int | None, str | None]:
        """(step named by ``latest``, problem): (None, None) when there is no ``latest``."""
        try:
            raw = self.storage.read(LATEST, 0, 256)
        except SnapshotMissingError:
            return None, None
        try:
            m = LATEST_RE.match(raw.decode("ascii"))
        except UnicodeDecodeError:
            m = None
        if m is None:
            return None, f"{self.url.rstrip('/')}/{LATEST} is corrupt ({raw[:40]!r})"
        return int(m.group(1)[len("step-") :]), None

    def latest_step(self) -> int | None:
        """The step ``latest`` names; when it is missing or corrupt, the newest committed step."""
        step, _ = self.read_latest()
        if step is not None:
            return step
        committed = self.steps()
        return committed[-1] if committed else None

    def read_manifest(self, step: int) -> Manifest:
        """Checkpoint ``step``'s manifest, validated. SnapshotMissingError when it is not
        committed, SnapshotCorruptError when the manifest is bad."""
        where = self.where(step)
        try:
            raw = self.storage.read(f"{step_dir(step)}/{MANIFEST}")
        except SnapshotMissingError:
            raise SnapshotMissingError(f"{where}: no manifest (not committed)") from None
        m = decode_manifest(raw, where)
        if m.step != step:
            raise SnapshotCorruptError(f"{where}: manifest is for step {m.step}")
        return m

    def bases_of(self, step: int) -> set[int]:
        """The base steps checkpoint ``step``'s ranks need; none when its manifest is
        unreadable (such a checkpoint cannot load anyway, so nothing is needed for it)."""
        try:
            return {r.base_step for r in self.read_manifest(step).ranks if r.base_step is not None}
        except SnapshotError:
            return set()

    def protected(self) -> set[int]:
        """The checkpoint ``latest`` names and the bases it needs."""
        step, _ = self.read_latest()
        if step is None:
            return set()
        return {step} | self.bases_of(step)

    # -- retention -----------------------------------------------------------------
    def retain(self, current: int, hook: CrashHook) -> None:
        """Apply retention after checkpoint ``current`` was committed (see :mod:`.retention`);
        ``hook("retention_partial")`` once the first checkpoint is un-committed."""
        dirs = self.step_dirs()
        committed = [s for s, d in dirs.items() if s <= current and self.has_manifest(d)]
        heads = retention.kept(committed, current, self.keep)
        doomed = retention.to_delete(
            dirs, committed, current, self.keep, {s: self.bases_of(s) for s in heads}
        )
        first = True
        for s in doomed:
            # Un-commit first, so a crash mid-removal never leaves a manifest naming lost files.
            self.storage.remove_tree(f"{dirs[s]}/{MANIFEST}")
            if first:
                first = False
                hook("retention_partial")
            self.storage.remove_tree(dirs[s])
        for name in self.storage.listdir(""):
            if TMP_MARK in name:
                self.storage.remove_tree(name)
