"""Lazy persistence: committed snapshots from shared memory to the durable tier.

The :class:`Persister` runs in the agent (which outlives every worker) on one
background thread at the process's own priority: a nice-19 thread held the agent's
GIL while the kernel left it unscheduled on a busy CPU, and the agent's (and the
coordinator's) loop waited with it (``benchmarks/bench_persist_isolation.py``; a node
fenced itself for want of lease acknowledgements in a loaded test job). The ranks run
in sessions of their own, so with the kernel's autogroups a nice value here never
ranked the persist below training anyway. It persists the **committed step** (the newest step
whose snapshot is complete for every rank):

* every ``every`` steps (when the committed step has advanced that far since the
  last persist), and
* on demand (:meth:`Persister.request` / :meth:`Persister.flush`): ``nonstop
  persist``, SIGTERM, and the end of the job.

Each rank's slot is copied out under a pin (the worker writes elsewhere
meanwhile, see :meth:`RankSnapshotStore.copy_out`), encoded off the critical
path (XOR delta against the rank's last FULL checkpoint, shuffle, zstd; a full
base every ``codec.full_every`` persists or whenever the layout changes), and
written with :class:`~nonstop.snapshot.durable.DurableStore`'s atomic commit.
In lossy mode only deltas are quantised; full bases stay exact, so a reader's
base is bit-identical to the one the encoder used and every chunk checksum holds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.errors import NonstopError, SnapshotMissingError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.codec import Buffer, ChunkInfo, CodecConfig, Encoder, Segment, segments_for
from nonstop.snapshot.durable import CheckpointWriter, DurableStore
from nonstop.snapshot.flatten import tensor_at
from nonstop.snapshot.store import RankSnapshotStore, RawSnapshot
from nonstop.snapshot.validate import decoding

__all__ = ["PersistResult", "Persister", "RankEncoder", "SharedChunks", "lossy_roles"]

log = logging.getLogger(__name__)

Emit = Callable[..., None]
_Base = tuple[int, list[Any], np.ndarray]  # (step, tensor layout, raw bytes) of a FULL checkpoint
POLL_S = 0.05
COPY_ATTEMPTS = 20


@dataclass(frozen=True)
class PersistResult:
    step: int
    raw_bytes: int
    stored_bytes: int
    seconds: float
    full: bool

    @property
    def mb_per_s(self) -> float:
        return self.raw_bytes / max(self.seconds, 1e-9) / 1e6


def lossy_roles(doc: dict[str, Any]) -> dict[int, str]:
    """Tensor index -> lossy kind for a parsed snapshot meta: model floats and Adam-style
    first moments are ``linear``, second moments (``exp_avg_sq``) ``sqrt``; the rest (step
    counters, RNG, integer buffers, extras) stays exact."""
    with decoding("a snapshot's meta", "it is not persisted"):  # bytes from shared memory
        tensors = [TensorEntry.from_json(raw) for raw in doc["tensors"]]
    floats = {"float32", "bfloat16", "float16"}
    roles: dict[int, str] = {}

    def walk(obj: Any, role: str | None) -> None:
        if isinstance(obj, dict):
            if "__t__" in obj:
                i = obj["__t__"]
                if role is not None and tensor_at(tensors, i).dtype in floats:
                    roles[i] = role
                return
            if "__dict__" in obj:
                for key, value in obj["__dict__"]:
                    walk(value, _child_role(role, key))
                return
            for key, value in obj.items():
                walk(value, _child_role(role, key))
        elif isinstance(obj, list):
            for value in obj:
                walk(value, role)

    with decoding("a snapshot's tree", "it is not persisted"):
        tree = doc["tree"]
        if isinstance(tree, dict):
            walk(tree.get("model"), "linear")
            optimizer = tree.get("optimizer")
            if isinstance(optimizer, dict):
                walk(optimizer.get("state"), "moments")
    return {i: r for i, r in roles.items() if r in ("linear", "sqrt")}


def _child_role(role: str | None, key: object) -> str | None:
    if role == "moments":
        return {"exp_avg": "linear", "exp_avg_sq": "sqrt"}.get(str(key), "moments")
    return role


def _whole(view: np.ndarray) -> np.ndarray:
    """The array a copy-out view was cut from (or the array itself)."""
    return view.base if isinstance(view.base, np.ndarray) else view


def _runs(segments: list[Segment]) -> list[tuple[int, int, list[Segment]]]:
    """(start, end, segments) of each run of adjacent segments, in offset order."""
    runs: list[tuple[int, int, list[Segment]]] = []
    for seg in sorted(segments, key=lambda sg: sg.offset):
        if runs and runs[-1][1] == seg.offset:
            lo, _, run = runs[-1]
            runs[-1] = (lo, seg.end, [*run, seg])
        else:
            runs.append((seg.offset, seg.end, [seg]))
    return runs


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two uint8 arrays hold the same bytes (compared 8 at a time where they allow)."""
    if len(a) != len(b):
        return False
    n = len(a) // 8 * 8
    if n and a[:n].ctypes.data % 8 == 0 and b[:n].ctypes.data % 8 == 0:
        if not np.array_equal(a[:n].view(np.uint64), b[:n].view(np.uint64)):
            return False
        return bool(np.array_equal(a[n:], b[n:]))
    return bool(np.array_equal(a, b))


@dataclass
class _Stored:
    rank: int
    info: ChunkInfo
    data: np.ndarray  # the owner's data bytes of the chunk
    base: np.ndarray | None  # the owner's base bytes of it (a delta chunk)


class SharedChunks:
    """The chunks of one checkpoint that ranks written before stored, for the next ranks to share
    (the format's shared chunks, :mod:`nonstop.snapshot.durable.format`).

    A rank's chunk is shared instead of written when a lower rank stored a chunk of the same
    data range that is exactly what this rank's own encoding would be: its data bytes are equal,
    it is lossless (a lossy chunk is never shared), and both are full or both deltas over equal
    base bytes. The comparison is of the bytes themselves (no hash: no collision can make two
    ranks' different states one). Lossless segments are cut into chunk-sized pieces here (the
    cut the encoder would make), so the bytes a rank differs in (RNG, extras, a diverged rank)
    cost it only the chunks they fall in."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._stored: dict[tuple[int, int], _Stored] = {}  # (offset, length) -> the first rank's

    def _pieces(self, seg: Segment) -> list[Segment]:
        if seg.lossy is not None:
            return [seg]  # the encoder cuts it by quantisation blocks; never shared
        step = max(self.chunk_bytes // seg.typesize * seg.typesize, seg.typesize)
        return [
            dataclasses.replace(seg, offset=o, length=min(step, seg.end - o))
            for o in range(seg.offset, seg.end, step)
        ]

    def split(
        self, rank: int, data: np.ndarray, base: np.ndarray | None, segments: list[Segment]
    ) -> tuple[list[Segment], list[tuple[ChunkInfo, int]]]:
        """(segments rank ``rank`` encodes itself, (info, owner) of the chunks it shares)."""
        own: list[Segment] = []
        same: list[tuple[ChunkInfo, int]] = []
        for seg in segments:
            for piece in self._pieces(seg):
                hit = self._stored.get((piece.offset, piece.length))
                if (
                    hit is not None
                    and hit.rank < rank
                    and (hit.base is None) == (base is None)
                    and _same_bytes(hit.data, data[piece.offset : piece.end])
                    and (
                        base is None
                        or hit.base is None
                        or _same_bytes(hit.base, base[piece.offset : piece.end])
                    )
                ):
                    same.append((hit.info, hit.rank))
                else:
                    own.append(piece)
        return own, same

    def add(
        self,
        rank: int,
        data: np.ndarray,
        base: np.ndarray | None,
        own: list[Segment],
        chunks: list[tuple[ChunkInfo, Buffer]],
    ) -> None:
        """Record rank ``rank``'s lossless chunks (encoded from ``own``) for the ranks after it."""
        lossless = {seg.offset for seg in own if seg.lossy is None}
        for info, _ in chunks:
            if info.offset in lossless and (info.offset, info.length) not in self._stored:
                end = info.offset + info.length
                self._stored[(info.offset, info.length)] = _Stored(
                    rank, info, data[info.offset : end], None if base is None else base[info.offset : end]
                )


class RankEncoder:
    """Encodes ranks' snapshots into a checkpoint writer, with per-rank delta bases.

    Each rank's data is an XOR delta against that rank's last FULL checkpoint written
    through this encoder, or a full base: every ``codec.full_every`` writes, when the
    rank has no base here (new on this node), or when its layout changed. Not
    thread-safe: one writer thread. :meth:`reset` after a failed write (a base may be
    what went wrong); copy-out buffers are reused through :meth:`scratch`."""

    def __init__(self, codec: CodecConfig) -> None:
        self.codec = codec
        self._encoder = Encoder(codec)
        # rank -> (step, tensor layout, raw bytes) of its last FULL checkpoint: the delta base
        self._bases: dict[int, _Base] = {}
        self._since_full = 0
        self._scratch: dict[int, np.ndarray | None] = {}  # rank -> reusable copy-out buffer

    def scratch(self, rank: int) -> np.ndarray | None:
        """A buffer to copy rank ``rank``'s next snapshot into (None: allocate)."""
        return self._scratch.get(rank)

    def reset(self) -> None:
        """Forget every base: the next write is full."""
        self._bases.clear()
        self._since_full = 0

    def forget_others(self, ranks: set[int]) -> None:
        """Drop the bases and buffers of ranks not in ``ranks`` (they moved to another node)."""
        for rank in [r for r in self._bases if r not in ranks]:
            del self._bases[rank]
        for rank in [r for r in self._scratch if r not in ranks]:
            del self._scratch[rank]

    def write(self, writer: CheckpointWriter, snaps: list[RawSnapshot]) -> tuple[int, int, bool]:
        """Add every snapshot's rank to ``writer``, in rank order; return (raw bytes, stored
        bytes, any full). A chunk whose payload a lower rank of ``snaps`` already stored is
        shared, not written again (:class:`SharedChunks`)."""
        step = writer.step
        full = self._since_full == 0 or self._since_full >= self.codec.full_every
        raw_total = stored_total = 0
        new_bases: dict[int, _Base] = {}
        shared = SharedChunks(self.codec.chunk_bytes)
        for snap in sorted(snaps, key=lambda sn: sn.rank):
            layout = snap.doc["tensors"]
            base = self._bases.get(snap.rank)
            use_base = not full and base is not None and base[1] == layout
            base_data = base[2] if use_base and base else None
            lossy = lossy_roles(snap.doc) if self.codec.lossy and use_base else None
            segments = segments_for(snap.entries(), len(snap.data), lossy)
            own, same = shared.split(snap.rank, snap.data, base_data, segments)
            chunks = self._encode(snap.data, own, base_data)
            stored_total += writer.add_rank(
                snap.rank, snap.meta, len(snap.data), chunks, base[0] if use_base and base else None, same
            )
            shared.add(snap.rank, snap.data, base_data, own, chunks)
            raw_total += len(snap.data)
            if not use_base:
                new_bases[snap.rank] = (step, layout, snap.data)
        return raw_total, stored_total, self._adopt(snaps, new_bases)

    def _encode(
        self, data: np.ndarray, segments: list[Segment], base: np.ndarray | None
    ) -> list[tuple[ChunkInfo, Buffer]]:
        """Encode the ``segments`` of ``data`` (not necessarily tiling it): each run of adjacent
        segments in one call, its chunks' offsets those in ``data``."""
        out: list[tuple[ChunkInfo, Buffer]] = []
        for lo, hi, run in _runs(segments):
            rel = [dataclasses.replace(seg, offset=seg.offset - lo) for seg in run]
            part = self._encoder.encode(data[lo:hi], rel, None if base is None else base[lo:hi])
            out.extend((dataclasses.replace(info, offset=info.offset + lo), p) for info, p in part)
        return out

    def _adopt(self, snaps: list[RawSnapshot], new_bases: dict[int, _Base]) -> bool:
        for snap in snaps:  # reuse this copy's memory next time, unless it became a base
            if snap.rank in new_bases:
                old = self._bases.get(snap.rank)  # the replaced base's memory is free now
                self._scratch[snap.rank] = None if old is None else _whole(old[2])
            else:
                self._scratch[snap.rank] = _whole(snap.data)
        self._bases.update(new_bases)
        self._since_full = 1 if new_bases else self._since_full + 1
        return bool(new_bases)

    def close(self) -> None:
        self._encoder.close()


class Persister:
    """Background persistence of one job's committed snapshots (see module docstring)."""

    def __init__(
        self,
        *,
        durable: DurableStore,
        shm_dir: Path,
        job_id: str,
        world_size: int,
        codec: CodecConfig,
        every: int = 0,
        emit: Emit | None = None,
    ) -> None:
        if every < 0:
            raise ValueError("every must be >= 0 (0: only on demand)")
        self.durable = durable
        self.world_size = world_size
        self.codec = codec
        self.every = every
        self._emit = emit or (lambda *_a, **_k: None)
        self._stores = [RankSnapshotStore(shm_dir=shm_dir, job_id=job_id, rank=r) for r in range(world_size)]
        self._encoder = RankEncoder(codec)
        self._cond = threading.Condition()
        self._requested = 0  # tickets handed out
        self._served = 0  # tickets satisfied (by a persist that started after they were asked)
        self._stop = False
        self.last: PersistResult | None = None
        self.last_error: str | None = None
        self._last_step = durable.latest_step() if durable.steps() else None
        self._thread = threading.Thread(target=self._loop, name="nonstop-persist", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- requests ------------------------------------------------------------------------
    def request(self) -> int:
        """Ask for a persist of the newest committed step; returns a ticket for :meth:`wait`."""
        with self._cond:
            self._requested += 1
            self._cond.notify_all()
            return self._requested

    def wait(self, ticket: int, timeout: float) -> bool:
        """True once a persist that started after ``ticket`` was asked has finished."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._served < ticket:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
            return True

    def flush(self, timeout: float) -> PersistResult | None:
        """Persist the committed step now and wait (bounded) for it."""
        if not self._thread.is_alive():
            self._persist_once()
            return self.last
        return self.last if self.wait(self.request(), timeout) else None

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self._encoder.close()
        for s in self._stores:
            s.close()

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        # (no nice 19 for this thread: see the module docstring)
        while True:
            with self._cond:
                if self._stop:
                    return
                self._cond.wait(POLL_S)
                wanted = self._requested
            if wanted > self._served or self._due():
                self._persist_once()
                with self._cond:
                    self._served = max(self._served, wanted)
                    self._cond.notify_all()

    def _committed(self) -> int | None:
        common: set[int] | None = None
        for s in self._stores:
            have = set(s.complete_steps())
            common = have if common is None else common & have
        return max(common) if common else None

    def _due(self) -> bool:
        if self.every <= 0:
            return False
        step = self._committed()
        if step is None:
            return False
        return step >= (self._last_step or 0) + self.every

    def _copy_committed(self) -> list[RawSnapshot] | None:
        for _ in range(COPY_ATTEMPTS):
            step = self._committed()
            if step is None:
                return None
            try:
                return [s.copy_out(step, out=self._encoder.scratch(s.rank)) for s in self._stores]
            except SnapshotMissingError:
                continue  # a writer overtook us between choosing and pinning: take the newer step
        return None

    def _persist_once(self) -> None:
        try:
            self._persist()
            self.last_error = None
        except (NonstopError, OSError, ValueError) as e:
            # Next attempt writes full checkpoints: a delta base may be what went wrong
            # (deleted or corrupted on the durable side: the writer refuses it, ValueError).
            self._encoder.reset()
            self.last_error = f"{type(e).__name__}: {e}"
            log.warning("persist failed: %s", self.last_error)
            self._emit("persist_failed", error=self.last_error)

    def _persist(self) -> None:
        t0 = time.monotonic()
        snaps = self._copy_committed()
        if snaps is None:
            return
        step = snaps[0].step
        if step == self._last_step:
            return  # already durable
        with self.durable.begin(step, self.world_size, self.codec.describe()) as writer:
            raw_total, stored_total, full = self._encoder.write(writer, snaps)
            writer.commit()
        self._last_step = step
        self.last = PersistResult(
            step=step,
            raw_bytes=raw_total,
            stored_bytes=stored_total,
            seconds=time.monotonic() - t0,
            full=full,
        )
        self._emit(
            "persist",
            step=step,
            raw_bytes=raw_total,
            stored_bytes=stored_total,
            seconds=round(self.last.seconds, 4),
            full=self.last.full,
            url=self.durable.storage.url if hasattr(self.durable, "storage") else None,
        )
