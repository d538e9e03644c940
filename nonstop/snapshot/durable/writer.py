"""Writing one checkpoint: :class:`CheckpointWriter` (made by :meth:`DurableStore.begin` or
:meth:`DurableStore.contribute`).

Contract: :meth:`CheckpointWriter.add_rank` returns once the rank's ``.bin`` is durable;
:meth:`CheckpointWriter.commit` returns once the manifest and ``latest`` are durable (the
checkpoint is then the committed one) and retention has run; a failed retention is logged,
never raised. A writer is used by one thread at a time. It reaches the store only through
the narrow :class:`WriterCatalog` (where a step lives, its manifest, retention), never the
store's internals.

Errors: misuse of the API (a rank added twice, outside the world size, a bad delta base,
committing before every rank is in, using a committed or aborted writer) raises
ValueError; a contributor's record that fails validation raises SnapshotCorruptError.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot import codec as _codec
from nonstop.snapshot.codec import Buffer, ChunkInfo
from nonstop.snapshot.durable.format import (
    LATEST,
    MANIFEST,
    Manifest,
    ManifestError,
    RankRecord,
    check_coverage,
    check_shared,
    encode_manifest,
    layout_of,
    one_line,
    rank_doc,
    rank_file,
    rank_from_doc,
    step_dir,
)
from nonstop.snapshot.durable.storage import Storage, byte_view

__all__ = ["CheckpointWriter", "WriterCatalog", "WriterState"]

log = logging.getLogger("nonstop.durable")

CrashHook = Callable[[str], None]


class WriterCatalog(Protocol):
    """What a writer needs of the checkpoints already under its root."""

    @property
    def storage(self) -> Storage:
        """Where the writer's files go."""
        ...

    def where(self, step: int) -> str:
        """How error messages name checkpoint ``step``."""
        ...

    def read_manifest(self, step: int) -> Manifest:
        """Committed checkpoint ``step``'s manifest (a delta's base); SnapshotError if unusable."""
        ...

    def retain(self, current: int, hook: CrashHook) -> None:
        """Apply retention once checkpoint ``current`` is committed."""
        ...


class WriterState(enum.Enum):
    """OPEN → COMMITTED (owner only) | ABORTED. Only an OPEN writer adds, adopts or commits."""

    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


class CheckpointWriter:
    """Writes one checkpoint: :meth:`add_rank` for every rank, then :meth:`commit`.
    Made by :meth:`DurableStore.begin`; usable as a context manager (aborts on error).

    Several writers (processes, nodes) can share one checkpoint: the owner calls
    :meth:`DurableStore.begin`, each contributor :meth:`DurableStore.contribute`,
    adds its ranks and hands the owner :meth:`record` of each; the owner
    :meth:`adopt` s them (re-validated, files checked) and commits. A contributor
    never commits nor removes anything but its own files (on abort)."""

    def __init__(
        self,
        catalog: WriterCatalog,
        step: int,
        world_size: int,
        codec: str,
        crash_hook: CrashHook | None,
        *,
        part: bool = False,
    ) -> None:
        self.catalog = catalog
        self.step = step
        self.world_size = world_size
        self.codec = codec
        self.part = part
        self.state = WriterState.OPEN
        self._crash_hook = crash_hook
        self._dir = step_dir(step)
        self._ranks: dict[int, RankRecord] = {}
        self._bases: dict[int, Manifest] = {}

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and self.state is WriterState.OPEN:
            self.abort()

    def _hook(self, phase: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(phase)

    def _check_open(self) -> None:
        if self.state is not WriterState.OPEN:
            raise ValueError(f"checkpoint step {self.step} writer is already {self.state.value}")

    def _check_base(self, rank: int, meta: bytes, data_len: int, base_step: int) -> None:
        """ValueError unless ``base_step`` is a committed FULL checkpoint of ``rank`` with the
        same tensor layout."""
        if not 0 <= base_step < self.step:
            raise ValueError(f"rank {rank}: base_step {base_step} must be an older step than {self.step}")
        base = self._bases.get(base_step)
        if base is None:
            try:
                base = self.catalog.read_manifest(base_step)
            except SnapshotError as e:
                raise ValueError(
                    f"rank {rank}: base checkpoint step {base_step} is not usable ({one_line(e)}); "
                    "write a full checkpoint"
                ) from None
            self._bases[base_step] = base
        if rank >= base.world_size:
            raise ValueError(f"rank {rank}: base checkpoint step {base_step} has no rank {rank}")
        brec = base.ranks[rank]
        if brec.base_step is not None:
            raise ValueError(
                f"rank {rank}: base checkpoint step {base_step} is itself a delta (of step "
                f"{brec.base_step}); a delta must reference a FULL checkpoint"
            )
        if brec.data_len != data_len or layout_of(brec.meta) != layout_of(meta):
            raise ValueError(
                f"rank {rank}: tensor layout differs from base checkpoint step {base_step}; "
                "write a full checkpoint"
            )

    def add_rank(
        self,
        rank: int,
        meta: bytes,
        data_len: int,
        chunks: Sequence[tuple[ChunkInfo, Buffer]],
        base_step: int | None,
        shared: Sequence[tuple[ChunkInfo, int]] = (),
    ) -> int:
        """Write rank ``rank``'s chunk file (durable when this returns); return its size.

        ``chunks`` are the (info, payload) pairs of an :class:`~nonstop.snapshot.codec.Encoder`
        for this rank's data of ``data_len`` bytes; ``base_step`` the committed FULL
        checkpoint their delta chunks apply to (ignored when no chunk is a delta).
        ``shared``: (info, owner rank) of the rest of its data's chunks, whose identical
        payload a lower rank already added to this writer holds (see the format's shared
        chunks; the caller guarantees the payload is what this rank's own would be)."""
        self._check_open()
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        if rank in self._ranks:
            raise ValueError(f"rank {rank} was already added to checkpoint step {self.step}")
        meta = bytes(meta)
        try:
            meta_text = meta.decode("utf-8")
            json.loads(meta_text)
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"rank {rank}: meta must be the snapshot's JSON meta (UTF-8 JSON)") from None
        infos = [info for info, _ in chunks]
        placed = self._place_shared(rank, shared)
        try:
            check_coverage(infos + [info for info, _, _ in placed], data_len)
        except ManifestError as e:
            raise ValueError(f"rank {rank}: {e}") from None
        for info, payload in chunks:
            if len(byte_view(payload)) != info.enc_len:
                raise ValueError(f"rank {rank}: payload of chunk at {info.offset} is not enc_len bytes")
        if not any(info.delta for info in infos + [info for info, _ in shared]):
            base_step = None
        elif base_step is None:
            raise ValueError(f"rank {rank}: delta chunks need a base_step")
        else:
            self._check_base(rank, meta, data_len, base_step)

        hook = self._hook

        def payloads() -> Iterator[Buffer]:
            first = True
            for _, payload in chunks:
                yield payload
                if first:
                    first = False
                    hook("bin_partial")
            if first:
                hook("bin_partial")

        name = rank_file(rank)
        written = self.catalog.storage.write(f"{self._dir}/{name}", payloads())
        self._hook("bin_written")
        entries, pos = [], 0
        for info in infos:
            entries.append((info, pos, rank))
            pos += info.enc_len
        entries = sorted(entries + placed, key=lambda e: e[0].offset)
        owners = tuple(o for _, _, o in entries) if placed else ()
        self._ranks[rank] = RankRecord(
            rank=rank,
            data_len=data_len,
            meta=meta,
            meta_crc=_codec.checksum(meta),
            base_step=base_step,
            file=name,
            file_len=written,
            chunks=tuple((info, off) for info, off, _ in entries),
            owners=owners,
        )
        return written

    def _place_shared(
        self, rank: int, shared: Sequence[tuple[ChunkInfo, int]]
    ) -> list[tuple[ChunkInfo, int, int]]:
        """(info, file offset in the owner's file, owner) of each shared chunk; ValueError unless
        its owner is a lower rank already added that holds that very chunk itself."""
        out = []
        where: dict[int, dict[ChunkInfo, int]] = {}
        for info, owner in shared:
            rec = self._ranks.get(owner) if 0 <= owner < rank else None
            if rec is None:
                raise ValueError(
                    f"rank {rank}: a shared chunk's owner {owner} is not a lower rank added before"
                )
            if owner not in where:
                where[owner] = {c: off for k, (c, off) in enumerate(rec.chunks) if rec.owner(k) == owner}
            off = where[owner].get(info)
            if off is None:
                raise ValueError(
                    f"rank {rank}: rank {owner} holds no chunk like the one at data offset {info.offset}"
                )
            out.append((info, off, owner))
        return out

    def record(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s manifest entry (JSON-safe), for the checkpoint's owner to :meth:`adopt`."""
        if rank not in self._ranks:
            raise ValueError(f"rank {rank} was not added to checkpoint step {self.step}")
        return rank_doc(self._ranks[rank])

    def adopt(self, doc: Any) -> int:
        """Take a rank written by a contributor (its :meth:`record`); return the rank.

        The entry is validated like a manifest's, its file must exist with the recorded
        size, and a delta must reference a usable FULL base: a bad or foreign entry raises
        :class:`SnapshotCorruptError` (the checkpoint cannot commit without that rank)."""
        self._check_open()
        where = f"{self.catalog.where(self.step)} contributed rank"
        rank_v = doc.get("rank") if isinstance(doc, dict) else None
        if not isinstance(rank_v, int) or isinstance(rank_v, bool):
            raise SnapshotCorruptError(f"{where}: not a rank entry")
        rank = rank_v
        if not 0 <= rank < self.world_size or rank in self._ranks:
            raise SnapshotCorruptError(f"{where} {rank}: outside world size {self.world_size} or added twice")
        try:
            rec = rank_from_doc(doc, rank, self.step)
        except (ManifestError, SnapshotCorruptError, ValueError, TypeError, KeyError) as e:
            raise SnapshotCorruptError(f"{where} {rank}: {one_line(e)}") from None
        if rec.file != rank_file(rank):
            raise SnapshotCorruptError(f"{where} {rank}: file {rec.file!r} is not {rank_file(rank)!r}")
        if _codec.checksum(rec.meta) != rec.meta_crc:
            raise SnapshotCorruptError(f"{where} {rank}: meta fails its checksum")
        try:
            size = self.catalog.storage.size(f"{self._dir}/{rec.file}")
        except SnapshotMissingError:
            raise SnapshotCorruptError(f"{where} {rank}: its file is missing") from None
        if size != rec.file_len:
            raise SnapshotCorruptError(f"{where} {rank}: file is {size} bytes, the entry says {rec.file_len}")
        if rec.base_step is not None:
            try:
                self._check_base(rank, rec.meta, rec.data_len, rec.base_step)
            except ValueError as e:
                raise SnapshotCorruptError(f"{where} {rank}: {e}") from None
        self._ranks[rank] = rec
        return rank

    def commit(self) -> None:
        """Write the manifest, then ``latest``, then apply retention. Every rank must have
        been added (or adopted); a contributor's writer cannot commit."""
        self._check_open()
        if self.part:
            raise ValueError(f"checkpoint step {self.step}: a contributor cannot commit; its owner does")
        missing = [r for r in range(self.world_size) if r not in self._ranks]
        if missing:
            raise ValueError(f"checkpoint step {self.step}: ranks {missing} were not added; cannot commit")
        self._hook("bins_done")
        try:
            check_shared([self._ranks[r] for r in range(self.world_size)])
        except ManifestError as e:  # an adopted rank names a chunk its owner's file does not hold
            raise SnapshotCorruptError(f"{self.catalog.where(self.step)}: {e}") from None
        manifest = encode_manifest(
            self.step,
            self.world_size,
            time.time(),
            self.codec,
            [self._ranks[r] for r in range(self.world_size)],
        )
        half = len(manifest) // 2

        def manifest_parts() -> Iterator[bytes]:
            yield manifest[:half]
            self._hook("manifest_partial")
            yield manifest[half:]

        storage = self.catalog.storage
        storage.write(f"{self._dir}/{MANIFEST}", manifest_parts())
        self._hook("manifest_written")
        storage.write(LATEST, [f"{self._dir}\n".encode()])
        self.state = WriterState.COMMITTED
        self._hook("latest_written")
        try:
            self.catalog.retain(self.step, self._hook)
        except (OSError, SnapshotError) as e:
            # The checkpoint is committed; failing to delete old ones must not fail the persist.
            log.warning("retention in %s failed (old checkpoints kept): %s", storage.url, one_line(e))
        self._hook("retention_done")

    def abort(self) -> None:
        """Drop this checkpoint: remove what was written of it (a contributor: only its own
        rank files). Idempotent; a committed checkpoint is left alone."""
        if self.state is not WriterState.OPEN:
            return
        self.state = WriterState.ABORTED
        storage = self.catalog.storage
        if not self.part:
            storage.remove_tree(self._dir)
            return
        for rank in self._ranks:
            storage.remove_tree(f"{self._dir}/{rank_file(rank)}")
