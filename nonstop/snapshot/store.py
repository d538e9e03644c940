"""Per-rank snapshot slots in shared memory.

Ownership: the **agent** owns the memory (it deletes every slot of the job at
exit; ``nonstop gc`` deletes orphans), the **worker** playing the rank writes
it. Because slots are plain files in ``/dev/shm``, they survive the death of
the worker that wrote them, and a replacement worker maps the same files.

Protocol:

* One writer per rank at a time (the worker playing it). A write flips the
  slot header to WRITING first and to COMPLETE last, so a torn write is never
  read as valid. Readers look for the step in every slot (``num_slots`` is
  small).
* The writer picks, for each step, a slot that is neither the newest complete
  one nor **pinned**; among those the emptiest / oldest. So the newest complete
  snapshot always survives the next write, and a pinned slot (held by the
  agent's persister while it copies the slot out) is never overwritten.
* A reader in another process that needs a stable copy (``copy_out``) pins the
  slot, copies it, and checks afterwards that the header still names the same
  write (seqlock-style): a write that raced the pin is detected, never returned.

Overlapped capture (:meth:`RankSnapshotStore.begin`): the small, volatile part
of the state (RNG, buffers, extras, the JSON tree) is copied at once; the bulk
(tensors the caller marks *deferred*: parameters and optimizer state, which only
``optimizer.step`` changes) is copied by a background thread while the next
step's forward and backward run. The caller fences the pending write before the
optimizer changes those tensors (:meth:`PendingWrite.fence`). On CUDA the
copies are asynchronous, on a side stream of each tensor's device, into page-locked
slot memory, and the fence is a stream dependency per device, not a host wait; CPU-resident
deferred tensors of such a write are copied at once when small, else fenced on the host
(:mod:`nonstop.snapshot.device`).

One slot file (its naming, mapping, header encoding and pin word) is
:class:`nonstop.snapshot.slot.Slot`; the write in flight and the background copier are
:mod:`nonstop.snapshot.pending`; a slot copied out, and decoding, :mod:`nonstop.snapshot.raw`.
This module decides which slot to write and when a read is valid.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot import device
from nonstop.snapshot.api import SlotState, SnapshotInfo, TensorEntry
from nonstop.snapshot.flatten import flatten_state
from nonstop.snapshot.pending import Copier, PendingWrite
from nonstop.snapshot.raw import RawSnapshot, decode_raw, decode_state
from nonstop.snapshot.slot import (
    KEEP_PIN,
    READ_PIN,
    ShmFullError,
    Slot,
    align,
    dtype_from_name,
    segment_prefix,
    slot_path,
)
from nonstop.snapshot.space import StoreRoom

log = logging.getLogger(__name__)

# The slot format (naming, pins, dtype names) lives in nonstop.snapshot.slot, the write in flight
# in nonstop.snapshot.pending, raw snapshots in nonstop.snapshot.raw; the names this module always
# exported are re-exported here.
__all__ = [
    "KEEP_PIN",
    "READ_PIN",
    "PendingWrite",
    "RankSnapshotStore",
    "RawSnapshot",
    "decode_raw",
    "dtype_from_name",
    "segment_prefix",
    "slot_path",
]


class RankSnapshotStore:
    """The snapshot slots of one rank.

    ``write(step, state)`` copies ``state`` (any nested structure accepted by
    :func:`~nonstop.snapshot.flatten.flatten_state`) into a free slot. When it
    returns, the snapshot is complete and visible to any process that maps the
    same files, and ``state`` may be mutated freely. ``begin`` is the overlapped
    form.

    ``read(step)`` returns the state of ``step``. Tensors are fresh copies unless
    ``copy=False``, in which case they are views into shared memory that stay
    valid only until the slot is written again (use that only to feed a
    ``load_state_dict`` that copies, such as ``nn.Module``'s).
    """

    def __init__(
        self,
        *,
        shm_dir: Path,
        job_id: str,
        rank: int,
        num_slots: int = 2,
        device_chunk: int = device.DEVICE_COPY_CHUNK,
    ) -> None:
        """``device_chunk``: bytes of deferred device-to-host copies issued at a time (0: all at
        once by ``begin``; :mod:`nonstop.snapshot.device`, "Paced copies")."""
        if num_slots < 2:
            raise SnapshotError("a rank needs at least 2 snapshot slots (one to read while one is written)")
        self.rank = rank
        self.num_slots = num_slots
        self._slots = [Slot(slot_path(shm_dir, job_id, rank, i)) for i in range(num_slots)]
        self._room = StoreRoom(shm_dir=shm_dir, store_id=job_id, rank=rank, num_slots=num_slots)
        self._plan_key: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
        self._plan: list[TensorEntry] = []
        self._plan_json = "[]"
        self._plan_id = 0
        self._pending: PendingWrite | None = None
        self._copier = Copier(rank, device_chunk=device_chunk)

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
                off = align(off + nbytes)
            self._plan_key, self._plan = key, entries
            self._plan_json = json.dumps([e.to_json() for e in entries], separators=(",", ":"))
            self._plan_id += 1
        return self._plan

    def _choose_slot(self) -> Slot:
        """A slot that is neither pinned nor the newest complete one; the emptiest/oldest."""
        newest: tuple[int, int] | None = None  # (step, index) of the newest complete slot
        infos = [self.info(i) for i in range(self.num_slots)]
        for inf in infos:
            if (
                inf is not None
                and inf.state is SlotState.COMPLETE
                and (newest is None or inf.step > newest[0])
            ):
                newest = (inf.step, inf.slot)
        best: tuple[float, int] | None = None
        usable = [i for i in range(self.num_slots) if i not in self._room.dropped]
        for i in usable:
            inf = infos[i]
            if inf is not None and (inf.pinned or (newest is not None and i == newest[1])):
                continue
            # Missing/EMPTY/WRITING (a dead writer's leftovers) first, then the oldest write.
            key = -1.0 if inf is None or inf.state is not SlotState.COMPLETE else inf.written_at
            if best is None or key < best[0]:
                best = (key, i)
        if best is None:
            # Every other slot is pinned: overwrite the newest unpinned one rather than
            # stall; the pinned snapshot stays the committed one meanwhile. When every slot is
            # pinned (pins a dead reader left, or a scribbled pin word), overwrite the oldest
            # rather than wedge the rank: a reader still copying it notices (copy_out).
            free = [i for i in usable if infos[i] is None or not infos[i].pinned]  # type: ignore[union-attr]
            if free:
                best = (0.0, free[0])
            else:
                oldest = min(usable, key=lambda i: _age_key(infos[i]))
                if len(usable) > 1:  # with one slot left (memory full) this is every write
                    log.warning(
                        "rank %d: every snapshot slot is pinned; overwriting slot %d", self.rank, oldest
                    )
                best = (0.0, oldest)
        return self._slots[best[1]]

    # -- room in the memory tier (snapshot/space.py) ------------------------------------------
    def _sized_slot(self, data_len: int, meta_len: int, *, pin: bool = False) -> Slot:
        """The slot to write next (:meth:`_choose_slot`), with room for ``data_len`` + ``meta_len``.

        A slot that cannot be allocated (the memory filesystem is full: ShmFullError) is dropped
        for good and the next candidate tried: the rank goes on with fewer slots, down to one
        (then every write overwrites the newest snapshot: until it completes, this rank's step
        is only in a replica or the durable tier). With none left, ShmFullError. ``pin``: the
        state has device tensors (the slot's data is page-locked when first sized)."""
        self._room.check(data_len, meta_len)
        while True:
            slot = self._choose_slot()
            try:
                slot.ensure_capacity(data_len, meta_len, pin=pin)
                return slot
            except ShmFullError as e:
                self._room.drop(self._slots.index(slot), e)

    @property
    def usable_slots(self) -> int:
        """Slots this store may still write (fewer than ``num_slots`` once memory ran out)."""
        return self.num_slots - len(self._room.dropped)

    def _encode(self, state: Any) -> tuple[list[torch.Tensor], list[TensorEntry], int, bytes]:
        """The tensors of ``state``, their layout in a slot, the data length and the metadata."""
        tree, tensors = flatten_state(state)
        entries = self._layout(tensors)
        data_len = (entries[-1].offset + entries[-1].nbytes) if entries else 0
        tree_json = json.dumps(tree, separators=(",", ":"), check_circular=False)  # a tree: no cycle
        meta = ('{"tree":' + tree_json + ',"tensors":' + self._plan_json + "}").encode()
        return tensors, entries, data_len, meta

    def prefault(self, state: Any) -> int:
        """Size every slot that holds no complete snapshot for ``state`` and touch its pages, so
        that the first snapshots of a process new to this rank (a migration's joiner) do not pay
        for growing files and page faults, nor (a state with device tensors) for page-locking
        them. Complete snapshots are left alone. Returns the number of slots prepared."""
        tensors, entries, data_len, meta = self._encode(state)
        pin = any(t.is_cuda for t in tensors)
        done = 0
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and (inf.state is SlotState.COMPLETE or inf.pinned):
                continue
            if i in self._room.dropped:
                continue
            slot = self._slots[i]
            self._room.check(data_len, len(meta))
            try:
                slot.ensure_capacity(data_len, len(meta), pin=pin)
            except ShmFullError as e:
                self._room.drop(i, e)
                continue
            slot.write_header(SlotState.EMPTY, -1, 0, 0, 0.0)
            slot.data_view()[:data_len].zero_()
            slot.views(self._plan_id, entries)
            done += 1
        return done

    def write(self, step: int, state: Any) -> int:
        """Write the snapshot of ``step`` synchronously; return the number of tensor bytes."""
        return self.begin(step, state, deferred=None).nbytes  # deferred=None: complete on return

    def begin(
        self, step: int, state: Any, *, deferred: Callable[[torch.Tensor], bool] | None
    ) -> PendingWrite:
        """Start writing the snapshot of ``step``; return its :class:`PendingWrite`.

        Tensors for which ``deferred(t)`` is true are copied in the background;
        the caller promises not to change them before ``fence()``. Everything
        else (and everything, when ``deferred`` is None) is copied before this
        returns. A previous pending write is completed first. No buffer is
        allocated while the state's layout stays the same.

        Device tensors are copied on their own device's side stream (see the module docstring);
        in a write that has any, a CPU-resident deferred tensor of at most
        :data:`.device.SMALL_HOST_COPY` bytes is copied at once (the optimizer changes it from the
        host, which no stream dependency holds back) and a larger one is fenced on the host.
        """
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        tensors, entries, data_len, meta = self._encode(state)
        on_device = any(t.is_cuda for t in tensors)
        slot = self._sized_slot(data_len, len(meta), pin=on_device)
        slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)
        pending = PendingWrite(step, data_len)
        cpu_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev_now: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        small = device.SMALL_HOST_COPY if on_device else -1
        for dst, t in zip(slot.views(self._plan_id, entries), tensors, strict=True):
            if dst is None:
                continue
            later = deferred is not None and deferred(t)
            if t.is_cuda:
                (dev_later if later else dev_now).extend(slot.copies(dst, t))
            elif later and (small < 0 or t.numel() * t.element_size() > small):
                cpu_later.append((dst, t))
            else:
                dst.copy_(t)
        slot.meta_view()[: len(meta)] = meta

        def complete() -> None:
            slot.write_header(SlotState.COMPLETE, step, data_len, len(meta), time.time())

        if dev_now or dev_later:
            copies = pending._device_copies = self._copier.start_device_copies(dev_now, dev_later)
            if not cpu_later:
                pending._host_copied.set()  # the fence need not wait for the copier thread
            if copies.issued:
                pending._issued.set()
        elif not cpu_later:
            complete()
            pending._finish()
            return pending
        self._copier.submit((cpu_later, complete, pending))
        if deferred is None:
            pending.wait()
        else:
            self._pending = pending
        return pending

    @property
    def pending(self) -> PendingWrite | None:
        """The write still in flight, if any."""
        if self._pending is not None and self._pending.done():
            self._pending.wait()  # surfaces a failed copy once
            self._pending = None
        return self._pending

    def write_raw(self, step: int, meta: bytes, data: bytes | bytearray | memoryview) -> None:
        """Install a snapshot given as its serialized form (e.g. loaded from the durable tier)."""
        slot = self._sized_slot(len(data), len(meta))
        slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)
        slot.data_memoryview()[: len(data)] = data
        slot.forget_views()  # the next begin re-zeroes the padding these bytes may have filled
        slot.meta_view()[: len(meta)] = meta
        slot.write_header(SlotState.COMPLETE, step, len(data), len(meta), time.time())

    # -- reading ---------------------------------------------------------------
    def info(self, slot_index: int) -> SnapshotInfo | None:
        return self._slots[slot_index].read_info(self.rank, slot_index)

    def _holding(self, step: int) -> list[SnapshotInfo]:
        """The complete snapshots of ``step``, the newest write first (a step redone after a
        rollback may be in two slots: the one written last is the current timeline's)."""
        infos = [self.info(i) for i in range(self.num_slots)]
        found = [
            inf for inf in infos if inf is not None and inf.state is SlotState.COMPLETE and inf.step == step
        ]
        return sorted(found, key=lambda inf: -inf.written_at)

    def _find(self, step: int) -> SnapshotInfo | None:
        found = self._holding(step)
        return found[0] if found else None

    def complete_steps(self) -> list[int]:
        """Steps with a COMPLETE snapshot in this rank's slots, ascending."""
        out = []
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and inf.state is SlotState.COMPLETE:
                out.append(inf.step)
        return sorted(out)

    def writing_step(self, live_pids: Collection[int]) -> int | None:
        """The step a live process is writing right now (a slot in WRITING state), if any.

        A writer that died mid-write leaves a WRITING slot too; it counts only if its
        ``writer_pid`` is in ``live_pids`` (a replacement playing the rank is not that
        writer and will never finish it).
        """
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and inf.state is SlotState.WRITING and inf.writer_pid in live_pids:
                return inf.step
        return None

    def _missing(self, step: int) -> SnapshotMissingError:
        return SnapshotMissingError(
            f"rank {self.rank}: no complete snapshot of step {step} (have steps {self.complete_steps()})"
        )

    def read(self, step: int, *, copy: bool = True) -> Any:
        """The state of ``step`` (see the class docstring), from the slot that holds its newest
        complete write. SnapshotMissingError when no slot holds a complete snapshot of it;
        SnapshotCorruptError when the slots that do hold one whose meta does not decode (each
        such slot is tried, newest first)."""
        problem: SnapshotCorruptError | None = None
        for inf in self._holding(step):
            slot = self._slots[inf.slot]
            what = f"rank {self.rank}'s snapshot of step {step} in slot {inf.slot}"
            try:
                return decode_state(
                    bytes(slot.meta_view()[: inf.meta_len]), slot.data_view(), inf.data_len, what, copy
                )
            except SnapshotCorruptError as e:
                # A fresh error: the one caught holds (through its traceback) views of the slot,
                # which would keep the mapping from being closed.
                problem = SnapshotCorruptError(str(e))
        if problem is not None:
            raise problem
        raise self._missing(step)

    def keep_only(self, steps: Collection[int]) -> list[int]:
        """Hold the complete snapshots of ``steps`` (KEEP_PIN: the writer leaves them alone) and
        release every other slot's hold. Returns the steps found and held."""
        held = []
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is None:
                continue
            keep = inf.state is SlotState.COMPLETE and inf.step in steps and inf.step not in held
            self._slots[i].set_pinned(keep, KEEP_PIN)
            if keep:
                held.append(inf.step)
        return held

    def clear(self) -> None:
        """Forget every snapshot of this rank (headers to EMPTY, holds released). For a worker that
        starts playing this rank after a world-size change: what the slots hold was written by
        another process for another numbering and must never be restored as this rank's."""
        for i in range(self.num_slots):
            slot = self._slots[i]
            if not slot.open_existing():
                continue
            slot.set_pinned(False, KEEP_PIN)
            slot.write_header(SlotState.EMPTY, -1, 0, 0, 0.0)

    def copy_out(self, step: int, *, out: np.ndarray | None = None, keep: bool = False) -> RawSnapshot:
        """A private copy of the snapshot of ``step`` that no later write can tear.

        For readers in another process than the writer (the agent's persister).
        The slot is pinned while it is copied, so the writer leaves it alone, and
        the header is checked again afterwards: a write that started before the
        pin was seen raises :class:`SnapshotMissingError` (retry with a newer step).
        ``out`` (a uint8 array) is reused for the data when it is large enough:
        fresh memory costs a page fault per 4 KiB, slower than the copy itself.
        ``keep``: also set KEEP_PIN on the slot (before the read pin is released, so no
        write can slip in between): it stays until :meth:`keep_only` releases it.
        """
        inf = self._find(step)
        if inf is None:
            raise self._missing(step)
        slot = self._slots[inf.slot]

        def same_write() -> bool:
            now = self.info(inf.slot)
            return now is not None and (now.state, now.step, now.written_at) == (
                inf.state,
                step,
                inf.written_at,
            )

        slot.set_pinned(True, READ_PIN)
        try:
            if not same_write():
                raise self._missing(step)
            src = np.frombuffer(slot.data_memoryview(), dtype=np.uint8, count=inf.data_len)
            if out is not None and out.size >= inf.data_len:
                data = out[: inf.data_len]
                np.copyto(data, src)  # numpy copies without holding the GIL
            else:
                data = src.copy()
            meta = bytes(slot.meta_view()[: inf.meta_len])
            if not same_write():
                raise self._missing(step)
            if keep:
                slot.set_pinned(True, KEEP_PIN)
        finally:
            slot.set_pinned(False, READ_PIN)
        return RawSnapshot(rank=self.rank, step=step, meta=meta, data=data, written_at=inf.written_at)

    def drain(self) -> None:
        """Finish the write in flight, if any; a failed one is simply not complete (not committed:
        logged, not raised)."""
        try:
            pending = self.pending  # (a write that already failed raises here)
            if pending is not None:
                pending.wait()
        except SnapshotError as e:
            log.warning("%s", e)

    def close(self) -> None:
        if self._pending is not None:
            try:
                self._pending.wait()
            except SnapshotError:
                pass
            self._pending = None
        self._copier.close()
        for s in self._slots:
            s.close()


def _age_key(inf: SnapshotInfo | None) -> tuple[int, float]:
    """Sorts slots oldest first: missing or incomplete ones, then complete ones by step."""
    if inf is None or inf.state is not SlotState.COMPLETE:
        return (0, 0.0)
    return (1, float(inf.step))
