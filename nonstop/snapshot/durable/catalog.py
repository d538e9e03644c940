"""What checkpoints one root holds: :class:`Catalog` lists step directories, reads the
``latest`` pointer and manifests, and applies retention after a commit.

Contract: reads never modify the root; :meth:`Catalog.retain` is the only method that
removes anything, and it removes only what :func:`~.retention.to_delete` names (plus
leftover temporary objects), each checkpoint un-committed (its manifest removed) before its
files, so a crash mid-retention never leaves a manifest naming lost files. What retention
cannot establish it does not delete in that pass: a manifest whose presence a probe cannot
tell, or that vanished from a step this catalog saw committed (until the next pass finds it
still gone), makes that step *uncertain*; a directory is deleted as abandoned only when two
probes, one before and one right before the deletion, find no manifest; a newer checkpoint
only when :meth:`Catalog.resumed_from` declared it part of the timeline the writer left.
A catalog instance remembers what it saw (it is used by one writer, one thread at a time);
retention assumes one writer per root at a time (see the format; the launcher locks a local
root, :mod:`nonstop.launch.jobdir`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot.durable import retention
from nonstop.snapshot.durable.format import (
    LATEST,
    LATEST_RE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TMP_MARK,
    Manifest,
    decode_manifest,
    parse_step_dir,
    step_dir,
)
from nonstop.snapshot.durable.storage import Storage

__all__ = ["Catalog", "CrashHook"]

CrashHook = Callable[[str], None]

log = logging.getLogger("nonstop.durable")


class Catalog:
    """The checkpoints under one :class:`~.storage.Storage` root."""

    def __init__(self, storage: Storage, keep: int) -> None:
        self.storage = storage
        self.url = storage.url
        self.keep = keep
        self._seen: set[int] = set()  # steps seen committed here: a later miss may be a glitch
        self._vanished: set[int] = set()  # ... found without one by the last pass, not seen since
        self._superseded: frozenset[int] = frozenset()  # see resumed_from

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
        found = sorted(s for s, d in self.step_dirs().items() if self.has_manifest(d))
        self._seen.update(found)
        self._vanished.difference_update(found)  # seen again since: not "still gone"
        return found

    def _manifest_state(self, name: str) -> bool | None:
        """Whether step directory ``name`` holds a manifest: True, False (positively absent),
        or None (the probe failed otherwise: unknown)."""
        try:
            self.storage.size(f"{name}/{MANIFEST}")
        except SnapshotMissingError:
            return False
        except Exception:  # any other failure (OSError, a backend's own errors) tells nothing
            return None
        return True

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
            # at most one byte past the cap: decode_manifest refuses an oversized one unread
            raw = self.storage.read(f"{step_dir(step)}/{MANIFEST}", 0, MAX_MANIFEST_BYTES + 1)
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

    def _needs(self, step: int) -> set[int] | None:
        """The base steps checkpoint ``step`` needs; none when its manifest is corrupt (it
        cannot load); None (unknown) when the manifest could not be read."""
        try:
            return {r.base_step for r in self.read_manifest(step).ranks if r.base_step is not None}
        except SnapshotCorruptError:
            return set()
        except (SnapshotError, OSError):
            return None

    # -- retention -----------------------------------------------------------------
    def resumed_from(self, step: int) -> None:
        """Declare that the job writing here resumed from checkpoint ``step`` of this root:
        every step directory newer than ``step`` now is of the timeline it left, and retention
        deletes it (see :mod:`.retention`) unless this catalog commits that step again.
        Directories that appear later are never taken for superseded."""
        self._superseded = frozenset(s for s in self.step_dirs() if s > step)

    def retain(self, current: int, hook: CrashHook) -> None:
        """Apply retention after checkpoint ``current`` was committed (see :mod:`.retention`);
        ``hook("retention_partial")`` once the first checkpoint is un-committed."""
        self._seen.add(current)
        self._superseded -= {current}
        dirs = self.step_dirs()
        committed, uncertain, vanished = {current}, set(), set()
        for s, d in dirs.items():
            state = True if s == current else self._manifest_state(d)
            if state:
                committed.add(s)
                self._seen.add(s)
            elif state is None:
                uncertain.add(s)
            elif s in self._seen:  # gone since we saw it: a glitch, or un-committed for good?
                if s in self._vanished:  # gone at the last pass too: for good
                    self._seen.discard(s)
                else:  # look again at the next pass
                    vanished.add(s)
                    uncertain.add(s)
        self._vanished = vanished
        if uncertain:
            log.warning(
                "retention in %s: cannot tell whether steps %s are committed; keeping them and "
                "every older checkpoint for now",
                self.url,
                sorted(uncertain),
            )
        policy = {"uncertain": uncertain, "superseded": self._superseded}
        alive = retention.survivors(dirs, committed, current, self.keep, **policy)
        bases = {s: self._needs(s) for s in alive}
        doomed = retention.to_delete(dirs, committed, current, self.keep, bases, **policy)
        first = True
        for s in doomed:
            if s not in committed and self._manifest_state(dirs[s]) is not False:
                # A second look found a manifest, or could not tell: keep it and everything
                # older (what it may need) for this pass.
                break
            # Un-commit first, so a crash mid-removal never leaves a manifest naming lost files.
            self.storage.remove_tree(f"{dirs[s]}/{MANIFEST}")
            self._seen.discard(s)
            if first:
                first = False
                hook("retention_partial")
            self.storage.remove_tree(dirs[s])
        for name in self.storage.listdir(""):
            if TMP_MARK in name:
                self.storage.remove_tree(name)
