"""Reading checkpoints back: :class:`Loader` (used by :class:`DurableStore`), with every
checksum verified and, for ``load(step=None)``, fallback to the next good checkpoint.

Contract: nothing here writes. A rank's bytes are returned only when its file, meta and
every chunk (and, for a delta, its base's) pass their checksums and its meta decodes
against its data; anything else -- any bytes at all, a manifest forged with a valid
checksum included -- raises SnapshotCorruptError (one line, naming the checkpoint, rank
and file), and nothing of a size a manifest claims is allocated before the files back the
claim (see :meth:`Loader._rank_data`). ``load(None)`` logs
one warning line per unusable checkpoint on the ``nonstop.durable`` logger before trying
the next older one. Safe to use from several threads (each call reads on its own; decoding
uses ``threads`` threads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError, UsageError
from nonstop.snapshot import codec as _codec
from nonstop.snapshot.durable.catalog import Catalog
from nonstop.snapshot.durable.format import LATEST, Manifest, RankRecord, layout_of, one_line, step_dir
from nonstop.snapshot.validate import alloc, decoding, parse_meta

__all__ = ["LoadedCheckpoint", "Loader"]

log = logging.getLogger("nonstop.durable")
T = TypeVar("T")
Blobs = dict[int, memoryview]  # rank -> its file's bytes, read once per load of a checkpoint


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A whole-job checkpoint read back: ``ranks[r]`` is rank ``r``'s (meta, raw data)."""

    step: int
    world_size: int
    codec: str
    created_at: float
    ranks: list[tuple[bytes, bytearray]]

    def meta(self, rank: int) -> bytes:
        return self.ranks[rank][0]

    def data(self, rank: int) -> bytearray:
        return self.ranks[rank][1]


class Loader:
    """Loads and verifies the checkpoints of one :class:`~.catalog.Catalog`."""

    def __init__(self, catalog: Catalog, threads: int) -> None:
        self.catalog = catalog
        self.threads = threads

    def _blob(self, m: Manifest, rank: int, blobs: Blobs, where: str) -> memoryview:
        """Rank ``rank``'s whole file of checkpoint ``m`` (read once per load: ``blobs``), exactly
        as long as its manifest says (at most ``file_len + 1`` bytes are read)."""
        if rank not in blobs:
            rec = m.ranks[rank]
            path = f"{step_dir(m.step)}/{rec.file}"
            try:
                blob = self.catalog.storage.read(path, 0, rec.file_len + 1)
            except SnapshotMissingError:
                raise SnapshotCorruptError(f"{where}: {rec.file} is missing") from None
            if len(blob) != rec.file_len:
                what = "truncated" if len(blob) < rec.file_len else "longer than recorded"
                raise SnapshotCorruptError(
                    f"{where}: {rec.file} is {what} ({len(blob)} bytes, manifest says {rec.file_len})"
                )
            if not any(r.owners and rank in r.owners for r in m.ranks if r.rank > rank):
                return memoryview(blob)  # no other rank's chunks in it: not kept
            blobs[rank] = memoryview(blob)
        return blobs[rank]

    def _rank_data(self, m: Manifest, rec: RankRecord, base: bytearray | None, blobs: Blobs) -> bytearray:
        """The rank's data, decoded and verified. Nothing the size of what the manifest claims is
        allocated before the files are read (its own and those of the lower ranks holding its
        shared chunks, each at most ``file_len + 1`` bytes), the meta is checked against
        ``data_len`` (:func:`~nonstop.snapshot.validate.parse_meta`) and every chunk's sizes
        against its payload (:func:`~nonstop.snapshot.codec.check_chunks`)."""
        where = f"{self.catalog.where(m.step)} rank {rec.rank}"
        files = {rec.owner(i) for i in range(len(rec.chunks))} | {rec.rank}
        views = {}
        for owner in sorted(files):
            try:
                views[owner] = self._blob(
                    m, owner, blobs, where if owner == rec.rank else f"{where} (shared)"
                )
            except SnapshotCorruptError as e:
                if owner == rec.rank:
                    raise
                raise SnapshotCorruptError(
                    f"{where}: rank {owner}'s file, which holds chunks of it: {e}"
                ) from None
        if _codec.checksum(rec.meta) != rec.meta_crc:
            raise SnapshotCorruptError(f"{where}: meta fails its checksum")
        then = "the checkpoint is not used"
        parse_meta(rec.meta, rec.data_len, f"{where}: its meta", then)
        chunks = [
            (info, views[rec.owner(i)][off : off + info.enc_len]) for i, (info, off) in enumerate(rec.chunks)
        ]
        try:
            _codec.check_chunks(chunks, rec.data_len)
        except SnapshotCorruptError as e:
            raise SnapshotCorruptError(f"{where}: {rec.file}: {one_line(e)}") from None
        out = alloc(rec.data_len, f"{where}: {rec.file}", then)
        try:
            with decoding(f"{where}: {rec.file}", then):
                _codec.decode(chunks, out, base, threads=self.threads)
        except SnapshotCorruptError as e:
            raise SnapshotCorruptError(f"{where}: {rec.file}: {one_line(e)}") from None
        return out

    def _load_rank(
        self, m: Manifest, rank: int, bases: dict[int, Manifest], blobs: Blobs | None = None
    ) -> tuple[bytes, bytearray]:
        if not 0 <= rank < m.world_size:
            raise SnapshotMissingError(
                f"{self.catalog.where(m.step)} has no rank {rank} (world size {m.world_size})"
            )
        rec = m.ranks[rank]
        base_data = None
        if rec.base_step is not None:
            where = f"{self.catalog.where(m.step)} rank {rank}"
            b = rec.base_step
            bm = bases.get(b)
            if bm is None:
                try:
                    bm = self.catalog.read_manifest(b)
                except SnapshotError as e:
                    raise SnapshotCorruptError(
                        f"{where}: its base checkpoint step {b} is unusable ({one_line(e)})"
                    ) from None
                bases[b] = bm
            if rank >= bm.world_size:
                raise SnapshotCorruptError(f"{where}: its base checkpoint step {b} has no rank {rank}")
            brec = bm.ranks[rank]
            if brec.base_step is not None:
                raise SnapshotCorruptError(f"{where}: its base checkpoint step {b} is not a full checkpoint")
            if brec.data_len != rec.data_len or layout_of(brec.meta) != layout_of(rec.meta):
                raise SnapshotCorruptError(f"{where}: tensor layout differs from its base step {b}")
            try:
                base_data = self._rank_data(bm, brec, None, {})
            except SnapshotCorruptError as e:
                raise SnapshotCorruptError(f"{where}: its base is unusable: {one_line(e)}") from None
        return rec.meta, self._rank_data(m, rec, base_data, {} if blobs is None else blobs)

    def load_rank(self, step: int, rank: int) -> tuple[bytes, bytearray]:
        """(meta, raw data) of ``rank`` in checkpoint ``step``, every checksum verified."""
        with decoding(self.catalog.where(step), "it is not loaded"):
            return self._load_rank(self.catalog.read_manifest(step), rank, {})

    def _load_step(self, step: int, world_size: int | None) -> LoadedCheckpoint:
        # The boundary of every decoder of this checkpoint's bytes: whatever escapes them
        # (RecursionError, MemoryError, ...) makes the checkpoint unusable, not the load fail.
        with decoding(self.catalog.where(step), "it is not loaded"):
            return self._load_step_unguarded(step, world_size)

    def _load_step_unguarded(self, step: int, world_size: int | None) -> LoadedCheckpoint:
        m = self.catalog.read_manifest(step)
        if world_size is not None and world_size != m.world_size:
            raise UsageError(
                f"{self.catalog.where(step)} has {m.world_size} ranks but this job has {world_size}; "
                f"run with --nproc-per-node {m.world_size}"
            )
        bases: dict[int, Manifest] = {}
        blobs: Blobs = {}  # a file holding other ranks' shared chunks is read once
        ranks = [self._load_rank(m, r, bases, blobs) for r in range(m.world_size)]
        return LoadedCheckpoint(
            step=m.step, world_size=m.world_size, codec=m.codec, created_at=m.created_at, ranks=ranks
        )

    def load(self, step: int | None = None, *, world_size: int | None = None) -> LoadedCheckpoint:
        """Checkpoint ``step``, or with ``step=None`` the newest good one (see the format).
        SnapshotMissingError when there is none; UsageError when ``world_size`` differs."""
        if step is not None:
            return self._load_step(step, world_size)
        return self.first_good(lambda s: self._load_step(s, world_size))

    def candidates(self) -> list[int]:
        """The steps ``load(None)`` tries, in order: the one ``latest`` names, then every older
        committed step, newest first (no ``latest``, or a corrupt one: every committed step)."""
        committed = self.catalog.steps()
        first, problem = self.catalog.read_latest()
        if problem is not None:
            log.warning("%s; using the newest committed checkpoint instead", problem)
        if first is None:
            if committed and problem is None:
                log.info(
                    "no %s pointer in %s; using the newest committed checkpoint", LATEST, self.catalog.url
                )
            return committed[::-1]
        return [first] + [s for s in committed[::-1] if s < first]

    def first_good(self, read: Callable[[int], T], *, defer_warnings: bool = False) -> T:
        """``read(step)`` of the first of :meth:`candidates` it succeeds on: a SnapshotError
        makes it try the next older step, with one warning line per unusable checkpoint (with
        ``defer_warnings``, logged only once a good one is found: a failure then says it all in
        its one line). SnapshotMissingError when no step is usable."""
        order = self.candidates()
        warnings: list[str] = []
        last = ""
        for i, s in enumerate(order):
            try:
                found = read(s)
            except SnapshotError as e:
                last = one_line(e)
                nxt = f"falling back to step {order[i + 1]}" if i + 1 < len(order) else "no older checkpoint"
                warnings.append(f"durable checkpoint unusable: {last}; {nxt}")
                if not defer_warnings:
                    log.warning("%s", warnings[-1])
                continue
            for w in warnings if defer_warnings else ():
                log.warning("%s", w)
            return found
        if not order:
            raise SnapshotMissingError(f"no committed checkpoint in {self.catalog.url}")
        why = f"; the last: {last}" if defer_warnings else ""
        raise SnapshotMissingError(f"no loadable checkpoint in {self.catalog.url} (tried steps {order}){why}")

    def verify(self, step: int) -> list[str]:
        """Problems of checkpoint ``step`` (empty when good): reads and checks every byte."""
        where = self.catalog.where(step)
        try:
            with decoding(where, "it is not loaded"):
                m = self.catalog.read_manifest(step)
        except SnapshotError as e:
            return [one_line(e)]
        problems = []
        bases: dict[int, Manifest] = {}
        blobs: Blobs = {}
        for r in range(m.world_size):
            try:
                with decoding(f"{where} rank {r}", "it is not loaded"):
                    self._load_rank(m, r, bases, blobs)
            except SnapshotError as e:
                problems.append(one_line(e))
        return problems
