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
This module decides which slot to write (and, with a node copy, which tensors go to the node's
shared write: :mod:`nonstop.snapshot.nodecopy`); the store's reader, a
:class:`~nonstop.snapshot.reads.SlotReads` it holds and whose reading API it offers, decides when a
read is valid.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotError
from nonstop.snapshot import device
from nonstop.snapshot.api import SlotState, SnapshotInfo, TensorEntry
from nonstop.snapshot.flatten import flatten_state
from nonstop.snapshot.layout import LayoutCache, data_len
from nonstop.snapshot.nodecopy import Claim, NodeCopy, SharedRef
from nonstop.snapshot.pending import Copier, PendingWrite
from nonstop.snapshot.raw import RawSnapshot, decode_raw
from nonstop.snapshot.reads import SlotReads
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
from nonstop.snapshot.split import encode_meta, virtual_entries

log = logging.getLogger(__name__)

Share = Callable[[torch.Tensor], bool]
Part = tuple["Claim | None", int, list[TensorEntry], list[torch.Tensor]]


@dataclass(frozen=True)
class _Encoded:
    """A state as one write lays it out: ``parts`` (claim or None for the rank's own slot, plan
    id, entries, tensors), the rank slot's data length and meta, and whether tensors are on a
    device."""

    parts: list[Part]
    data_len: int
    meta: bytes
    on_device: bool


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
    """The snapshot slots of one rank: their writer, and (through the :class:`~.reads.SlotReads`
    it holds) their reader.

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
        device_depth: int = device.COPIES_IN_FLIGHT,
    ) -> None:
        """``device_chunk``: bytes of deferred device-to-host copies issued at a time (0: all at
        once by ``begin``; :mod:`nonstop.snapshot.device`, "Paced copies"); ``device_depth``:
        batches of them a device has queued at most."""
        if device_depth < 1:
            raise SnapshotError(f"device_depth={device_depth}: a device needs at least one batch in flight")
        if num_slots < 2:
            raise SnapshotError("a rank needs at least 2 snapshot slots (one to read while one is written)")
        self.rank = rank
        self.num_slots = num_slots
        self._reads = SlotReads(shm_dir=shm_dir, job_id=job_id, rank=rank, num_slots=num_slots)
        self._slots = self._reads.slots  # the reader's mappings, which the writer writes into
        self._node: NodeCopy | None = None  # the node's shared write (share_with)
        self._room = StoreRoom(shm_dir=shm_dir, store_id=job_id, rank=rank, num_slots=num_slots)
        self._whole = LayoutCache()  # a whole state's layout (no node copy, or refused)
        self._own = LayoutCache()  # with a node copy: the rank's own tensors'
        self._shared = LayoutCache()  # and the shared ones'
        self._pending: PendingWrite | None = None
        self._copier = Copier(rank, device_chunk=device_chunk, device_depth=device_depth)
        self._node_gen = 0  # the generation of the node copy's shared writes (share_with)

    # -- reading: the store's SlotReads (snapshot/reads.py) ------------------------------------
    @property
    def shm_dir(self) -> Path:
        return self._reads.shm_dir

    @property
    def store_id(self) -> str:
        """The id the slot files are named under (``<job>.<node>``, ``.rep`` for a holder's)."""
        return self._reads.store_id

    def info(self, slot_index: int) -> SnapshotInfo | None:
        return self._reads.info(slot_index)

    def complete_steps(self) -> list[int]:
        """Steps with a complete snapshot in this rank's slots, ascending."""
        return self._reads.complete_steps()

    def writing_step(self, live_pids: Collection[int]) -> int | None:
        """:meth:`SlotReads.writing_step <.reads.SlotReads.writing_step>`."""
        return self._reads.writing_step(live_pids)

    def behind_shared(self, live_pids: Collection[int]) -> bool:
        """:meth:`SlotReads.behind_shared <.reads.SlotReads.behind_shared>`."""
        return self._reads.behind_shared(live_pids)

    def read(self, step: int, *, copy: bool = True) -> Any:
        """The state of ``step`` (see the class docstring; :meth:`.reads.SlotReads.read`)."""
        return self._reads.read(step, copy=copy)

    def copy_out(
        self,
        step: int,
        *,
        out: np.ndarray | None = None,
        keep: bool = False,
        split: bool = False,
        settle_s: float = 0.0,
    ) -> RawSnapshot:
        """A private copy of the snapshot of ``step`` (:meth:`.reads.SlotReads.copy_out`)."""
        return self._reads.copy_out(step, out=out, keep=keep, split=split, settle_s=settle_s)

    def keep_only(self, steps: Collection[int]) -> list[int]:
        """Hold the complete snapshots of ``steps`` only (:meth:`.reads.SlotReads.keep_only`)."""
        return self._reads.keep_only(steps)

    def node_copy(self, group: int = 0) -> NodeCopy:
        """The node's shared slots of copy ``group`` (:meth:`.reads.SlotReads.node_copy`)."""
        return self._reads.node_copy(group)

    # -- writing ---------------------------------------------------------------
    def share_with(self, node: NodeCopy | None, gen: int) -> None:
        """Write the tensors a ``begin``'s ``share`` predicate names into ``node``'s shared slots
        (one copy per node, :mod:`nonstop.snapshot.nodecopy`), as part of generation ``gen``."""
        self._reads.writer_node(node)  # (its shared writes are read through it too)
        self._node, self._node_gen = node, gen

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

    def _encode(self, state: Any, share: Share | None, step: int) -> _Encoded:
        """The tensors of ``state``, where each goes (the rank's slot, the node copy's claimed
        slot, or nowhere: another rank copies it), and the rank slot's data length and meta."""
        tree, tensors = flatten_state(state)
        tree_json = json.dumps(tree, separators=(",", ":"), check_circular=False)  # a tree: no cycle
        on_device = any(t.is_cuda for t in tensors)
        mask = [bool(share(t)) for t in tensors] if share is not None and self._node is not None else []
        if any(mask):
            assert self._node is not None
            own = [t for t, m in zip(tensors, mask, strict=True) if not m]
            shared = [t for t, m in zip(tensors, mask, strict=True) if m]
            own_e, shared_e = self._own.of(own), self._shared.of(shared)
            shared_len = data_len(shared_e)
            claim = self._node.claim(
                gen=self._node_gen, step=step, key=self._shared.key, data_len=shared_len, pin=on_device
            )
            if claim is not None:
                length = data_len(own_e)
                ref = SharedRef(self._node_gen, step, align(length), self._node.group)
                entries = virtual_entries(own_e, shared_e, mask, ref.base)
                tensors_json = json.dumps([e.to_json() for e in entries], separators=(",", ":"))
                meta = encode_meta(ref, tree_json, tensors_json)
                parts: list[Part] = [(None, self._own.plan_id, own_e, own)]
                if claim.writer:
                    parts.append((claim, self._shared.plan_id, shared_e, shared))
                return _Encoded(parts, length, meta, on_device)
        entries = self._whole.of(tensors)
        meta = encode_meta(None, tree_json, self._whole.json)
        return _Encoded([(None, self._whole.plan_id, entries, tensors)], data_len(entries), meta, on_device)

    def prefault(self, state: Any, share: Share | None = None) -> int:
        """Size every slot that holds no complete snapshot for ``state`` and touch its pages, so
        that the first snapshots of a process new to this rank (a migration's joiner) do not pay
        for growing files and page faults, nor (a state with device tensors) for page-locking
        them. Complete snapshots are left alone. Returns the number of slots prepared. With a
        node copy (``share``), the rank's own part only: the node's shared slots are the node's."""
        tree, tensors = flatten_state(state)
        if share is not None and self._node is not None:
            tensors = [t for t in tensors if not share(t)]
        cache = LayoutCache()
        entries = cache.of(tensors)
        length = data_len(entries)
        meta_len = len(json.dumps(tree, separators=(",", ":"), check_circular=False)) + len(cache.json) + 64
        pin = any(t.is_cuda for t in tensors)
        done = 0
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and (inf.state is SlotState.COMPLETE or inf.pinned):
                continue
            if i in self._room.dropped:
                continue
            slot = self._slots[i]
            self._room.check(length, meta_len)
            try:
                slot.ensure_capacity(length, meta_len, pin=pin)
            except ShmFullError as e:
                self._room.drop(i, e)
                continue
            slot.write_header(SlotState.EMPTY, -1, 0, 0, 0.0)
            slot.data_view()[:length].zero_()
            done += 1
        return done

    def write(self, step: int, state: Any, *, share: Share | None = None) -> int:
        """Write the snapshot of ``step`` synchronously; return the number of tensor bytes."""
        return self.begin(step, state, deferred=None, share=share).nbytes  # deferred=None: complete on return

    def begin(
        self,
        step: int,
        state: Any,
        *,
        deferred: Callable[[torch.Tensor], bool] | None,
        share: Share | None = None,
    ) -> PendingWrite:
        """Start writing the snapshot of ``step``; return its :class:`PendingWrite`.

        Tensors for which ``deferred(t)`` is true are copied in the background;
        the caller promises not to change them before ``fence()``. Everything
        else (and everything, when ``deferred`` is None) is copied before this
        returns. A previous pending write is completed first. No buffer is
        allocated while the state's layout stays the same.

        ``share`` (with :meth:`share_with`'s node copy): the tensors every rank of the node holds
        alike. They go to the node's shared write of this step, copied by the rank that claims it
        and by no other (:mod:`nonstop.snapshot.nodecopy`).

        Device tensors are copied on their own device's side stream (see the module docstring);
        in a write that has any, a CPU-resident deferred tensor of at most
        :data:`.device.SMALL_HOST_COPY` bytes is copied at once (the optimizer changes it from the
        host, which no stream dependency holds back) and a larger one is fenced on the host.
        """
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        enc = self._encode(state, share, step)
        slot = self._sized_slot(enc.data_len, len(enc.meta), pin=enc.on_device)
        slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)
        slot.trim(enc.data_len)  # it held a whole snapshot (an install) and now a rank's own part
        claim = next((c for c, *_ in enc.parts if c is not None), None)
        shared_len = data_len(enc.parts[-1][2]) if claim is not None else 0
        pending = PendingWrite(step, enc.data_len + shared_len)
        cpu_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev_now: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev_later: list[tuple[torch.Tensor, torch.Tensor]] = []
        small = device.SMALL_HOST_COPY if enc.on_device else -1
        for part_claim, plan_id, entries, tensors in enc.parts:
            dst_slot = slot if part_claim is None else part_claim.slot
            for dst, t in zip(dst_slot.views(plan_id, entries), tensors, strict=True):
                if dst is None:
                    continue
                later = deferred is not None and deferred(t)
                if t.is_cuda:
                    (dev_later if later else dev_now).extend(dst_slot.copies(dst, t))
                elif later and (small < 0 or t.numel() * t.element_size() > small):
                    cpu_later.append((dst, t))
                else:
                    dst.copy_(t)
        meta = enc.meta
        slot.meta_view()[: len(meta)] = meta

        def complete() -> None:
            slot.write_header(SlotState.COMPLETE, step, enc.data_len, len(meta), time.time())
            if claim is not None:
                assert self._node is not None
                self._node.complete(claim, step, shared_len)

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

    def write_raw(self, step: int, meta: bytes, data: bytes | bytearray | memoryview) -> None:
        """Install a snapshot given as its serialized form (e.g. loaded from the durable tier)."""
        slot = self._sized_slot(len(data), len(meta))
        slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)
        slot.data_memoryview()[: len(data)] = data
        slot.forget_views()  # the next begin re-zeroes the padding these bytes may have filled
        slot.meta_view()[: len(meta)] = meta
        slot.write_header(SlotState.COMPLETE, step, len(data), len(meta), time.time())

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
        self._reads.close()
        if self._node is not None:
            self._node.close()


def _age_key(inf: SnapshotInfo | None) -> tuple[int, float]:
    """Sorts slots oldest first: missing or incomplete ones, then complete ones by step."""
    if inf is None or inf.state is not SlotState.COMPLETE:
        return (0, 0.0)
    return (1, float(inf.step))
