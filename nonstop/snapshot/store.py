"""Per-rank snapshot slots in shared memory.

Ownership: the **agent** owns the memory (it deletes every slot of the job at
exit; ``nonstop gc`` deletes orphans), the **worker** playing the rank writes
it. Because slots are plain files in ``/dev/shm``, they survive the death of
the worker that wrote them, and a replacement worker maps the same files.

Threading: one writer per rank at a time (the worker playing it). Readers
read only slots whose header says COMPLETE; a write flips the header to
WRITING first and to COMPLETE last, so a torn write is never read as valid.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from nonstop.errors import SnapshotError, SnapshotMissingError
from nonstop.snapshot.api import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_FMT,
    HEADER_SIZE,
    MAGIC,
    SlotState,
    SnapshotInfo,
    TensorEntry,
)
from nonstop.snapshot.flatten import flatten_state, unflatten_state

__all__ = ["RankSnapshotStore", "segment_prefix", "slot_path"]


def segment_prefix(job_id: str) -> str:
    """File-name prefix of every shared-memory segment of ``job_id``."""
    return f"nonstop-{job_id}-"


def slot_path(shm_dir: Path, job_id: str, rank: int, slot: int) -> Path:
    return shm_dir / f"{segment_prefix(job_id)}r{rank}-s{slot}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SnapshotError(f"unknown dtype {name!r} in snapshot meta")
    return dt


class _Slot:
    """One mapped slot file. Grows (re-creates its mapping) only when needed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._views: list[torch.Tensor | None] = []
        self._views_plan = -1
        self.data_cap = 0
        self.meta_cap = 0

    # -- mapping -------------------------------------------------------------
    def _map(self, size: int, *, create: bool) -> None:
        self.close()
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def open_existing(self) -> bool:
        if self._mm is not None:
            self._refresh_caps()
            return True
        if not self.path.exists():
            return False
        self._map(0, create=False)
        if len(self._mm or b"") < HEADER_SIZE:
            self.close()
            return False
        self._refresh_caps()
        return True

    def _refresh_caps(self) -> None:
        hdr = self.header()
        if hdr is not None:
            self.data_cap, self.meta_cap = hdr[6], hdr[7]
            if self._mm is not None and len(self._mm) < HEADER_SIZE + self.data_cap + self.meta_cap:
                # Another process grew the file: remap to the new size.
                self._map(0, create=False)

    def ensure_capacity(self, data_len: int, meta_len: int) -> None:
        if self._mm is None:
            self.open_existing()
        if self._mm is not None and data_len <= self.data_cap and meta_len <= self.meta_cap:
            return
        data_cap = _align(max(data_len, self.data_cap))
        meta_cap = _align(max(int(meta_len * 1.5) + 4096, self.meta_cap))
        self.close()
        if self.path.exists():
            self.path.unlink()
        self._map(HEADER_SIZE + data_cap + meta_cap, create=True)
        self.data_cap, self.meta_cap = data_cap, meta_cap
        self._write_header(SlotState.EMPTY, -1, 0, 0, 0.0)

    def views(self, plan_id: int, entries: list[TensorEntry]) -> list[torch.Tensor | None]:
        """Destination tensors for ``entries`` in this slot (None for empty ones), made once
        per layout and mapping."""
        if self._views_plan != plan_id:
            data = self.data_view()
            self._views = [
                data[e.offset : e.offset + e.nbytes].view(_dtype_from_name(e.dtype)).view(e.shape)
                if e.nbytes
                else None
                for e in entries
            ]
            self._views_plan = plan_id
        return self._views

    def close(self) -> None:
        self._views, self._views_plan = [], -1
        self._bytes = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    # -- header --------------------------------------------------------------
    def header(self) -> tuple[Any, ...] | None:
        if self._mm is None:
            return None
        raw = struct.unpack_from(HEADER_FMT, self._mm, 0)
        if raw[0] != MAGIC:
            return None
        if raw[1] != FORMAT_VERSION:
            raise SnapshotError(
                f"{self.path}: snapshot format v{raw[1]}, this nonstop reads v{FORMAT_VERSION}"
            )
        return raw

    def _write_header(
        self, state: SlotState, step: int, data_len: int, meta_len: int, written_at: float
    ) -> None:
        assert self._mm is not None
        struct.pack_into(
            HEADER_FMT,
            self._mm,
            0,
            MAGIC,
            FORMAT_VERSION,
            int(state),
            step,
            data_len,
            meta_len,
            self.data_cap,
            self.meta_cap,
            written_at,
        )

    def data_view(self) -> torch.Tensor:
        assert self._bytes is not None
        return self._bytes[HEADER_SIZE : HEADER_SIZE + self.data_cap]

    def meta_view(self) -> memoryview:
        assert self._mm is not None
        start = HEADER_SIZE + self.data_cap
        return memoryview(self._mm)[start : start + self.meta_cap]


class RankSnapshotStore:
    """The snapshot slots of one rank.

    ``write(step, state)`` copies ``state`` (any nested structure accepted by
    :func:`~nonstop.snapshot.flatten.flatten_state`) into slot ``step %
    num_slots``. When it returns, the snapshot is complete and visible to any
    process that maps the same files, and ``state`` may be mutated freely.

    ``read(step)`` returns the state of ``step``. Tensors are fresh copies unless
    ``copy=False``, in which case they are views into shared memory that stay
    valid only until the slot is written again (use that only to feed a
    ``load_state_dict`` that copies, such as ``nn.Module``'s).
    """

    def __init__(self, *, shm_dir: Path, job_id: str, rank: int, num_slots: int = 2) -> None:
        if num_slots < 2:
            raise SnapshotError("a rank needs at least 2 snapshot slots (one to read while one is written)")
        self.rank = rank
        self.num_slots = num_slots
        self._slots = [_Slot(slot_path(shm_dir, job_id, rank, i)) for i in range(num_slots)]
        self._plan_key: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
        self._plan: list[TensorEntry] = []
        self._plan_json = "[]"
        self._plan_id = 0

    # -- writing ---------------------------------------------------------------
    def _layout(self, tensors: list[torch.Tensor]) -> list[TensorEntry]:
        """Offsets of ``tensors`` in a slot; recomputed only when dtypes or shapes change."""
        key = tuple((t.dtype, t.shape) for t in tensors)
        if key != self._plan_key:
            entries, off = [], 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                dtype = str(t.dtype).removeprefix("torch.")
                entries.append(TensorEntry(dtype=dtype, shape=tuple(t.shape), offset=off, nbytes=nbytes))
                off = _align(off + nbytes)
            self._plan_key, self._plan = key, entries
            self._plan_json = json.dumps([e.to_json() for e in entries], separators=(",", ":"))
            self._plan_id += 1
        return self._plan

    def write(self, step: int, state: Any) -> int:
        """Write the snapshot of ``step``; return the number of tensor bytes copied.

        Per call this only walks the state, copies each tensor into a destination
        view made once per (slot, layout), and writes a small JSON tree: no buffer
        is allocated while the layout stays the same.
        """
        tree, tensors = flatten_state(state)
        entries = self._layout(tensors)
        data_len = (entries[-1].offset + entries[-1].nbytes) if entries else 0
        tree_json = json.dumps(tree, separators=(",", ":"))
        meta = ('{"tree":' + tree_json + ',"tensors":' + self._plan_json + "}").encode()
        slot = self._slots[step % self.num_slots]
        slot.ensure_capacity(data_len, len(meta))
        slot._write_header(SlotState.WRITING, step, 0, 0, 0.0)
        for dst, t in zip(slot.views(self._plan_id, entries), tensors, strict=True):
            if dst is not None:
                dst.copy_(t)
        slot.meta_view()[: len(meta)] = meta
        slot._write_header(SlotState.COMPLETE, step, data_len, len(meta), time.time())
        return data_len

    # -- reading ---------------------------------------------------------------
    def info(self, slot_index: int) -> SnapshotInfo | None:
        slot = self._slots[slot_index]
        if not slot.open_existing():
            return None
        hdr = slot.header()
        if hdr is None:
            return None
        return SnapshotInfo(
            rank=self.rank,
            slot=slot_index,
            state=SlotState(hdr[2]),
            step=hdr[3],
            data_len=hdr[4],
            meta_len=hdr[5],
            written_at=hdr[8],
        )

    def complete_steps(self) -> list[int]:
        """Steps with a COMPLETE snapshot in this rank's slots, ascending."""
        out = []
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and inf.state is SlotState.COMPLETE:
                out.append(inf.step)
        return sorted(out)

    def writing_step(self) -> int | None:
        """The step being written right now (a slot in WRITING state), if any.

        A writer that died mid-write leaves this too: callers must know whether
        the writer is alive.
        """
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and inf.state is SlotState.WRITING:
                return inf.step
        return None

    def read(self, step: int, *, copy: bool = True) -> Any:
        index = step % self.num_slots
        inf = self.info(index)
        if inf is None or inf.state is not SlotState.COMPLETE or inf.step != step:
            have = self.complete_steps()
            raise SnapshotMissingError(
                f"rank {self.rank}: no complete snapshot of step {step} (have steps {have})"
            )
        slot = self._slots[index]
        meta = json.loads(bytes(slot.meta_view()[: inf.meta_len]))
        data = slot.data_view()
        tensors = []
        for raw in meta["tensors"]:
            e = TensorEntry.from_json(raw)
            dt = _dtype_from_name(e.dtype)
            view = data[e.offset : e.offset + e.nbytes].view(dt).view(e.shape)
            tensors.append(view.clone() if copy else view)
        return unflatten_state(meta["tree"], tensors)

    def close(self) -> None:
        for s in self._slots:
            s.close()
