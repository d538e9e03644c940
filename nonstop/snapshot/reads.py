"""Reading a rank's snapshot slots: which steps they hold, a step's state, a stable copy of it.

:class:`SlotReads` is the reader of one rank's slots; a
:class:`~nonstop.snapshot.store.RankSnapshotStore` holds one (its reading API is this object's)
and writes into the same slots; every reader of a rank's slots -- the worker restoring, the
agent's persister, replicator and data plane -- goes through it. A slot holds either a whole
snapshot or, with a node copy (:mod:`nonstop.snapshot.nodecopy`), the rank's own part and a
reference to the node's shared write; such a snapshot counts only while both are complete, and
reads compose the two (:mod:`nonstop.snapshot.split`).

Reads are seqlock-style: a reader in another process pins what it copies and checks afterwards
that the headers still name the same writes; a write that raced it is never returned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.errors import SnapshotCorruptError, SnapshotMissingError
from nonstop.snapshot.api import SlotState, SnapshotInfo
from nonstop.snapshot.nodecopy import MAX_NODE_SLOTS, NodeCopy, SharedRef
from nonstop.snapshot.raw import RawSnapshot, decode_state
from nonstop.snapshot.slot import KEEP_PIN, READ_PIN, Slot, slot_path
from nonstop.snapshot.split import REF_HEAD, compose, decode_split, ref_of

__all__ = ["SETTLE_POLL_S", "SlotReads"]

SETTLE_POLL_S = 0.02  # copy_out(settle_s=...): how often a missing step is looked for again


class SlotReads:
    """The reader of a rank's snapshot slots (see the module docstring). It owns the slots'
    mappings (:attr:`slots`, which the store's writer writes into), the node copies it opened
    as a reader, and the cache of which shared write each slot refers to.

    Threading contract: reads may come from several threads at once through one store (the
    node agent's persister, replicator and data plane do): a thread that maps a grown or
    replaced slot afresh leaves the others' mapping alone (:meth:`~.slot.Slot._swap`), read pins
    are counted per process (:meth:`~.slot.Slot.set_pinned`), and a copy torn by a write is
    SnapshotMissingError (retry), never corrupt. The store's writes come from one thread."""

    def __init__(self, *, shm_dir: Path, job_id: str, rank: int, num_slots: int) -> None:
        self.rank = rank
        self.num_slots = num_slots
        self._slots = [Slot(slot_path(shm_dir, job_id, rank, i)) for i in range(num_slots)]
        # Split snapshots: a writer is given the node copy (share_with); a reader opens the
        # node's when it first meets a slot that refers to it.
        self._shm_dir, self._job_id = shm_dir, job_id
        self._node: NodeCopy | None = None  # the writer's (writer_node)
        self._groups: dict[int, NodeCopy] = {}  # a reader's, by copy group
        self._opening = threading.Lock()
        self._refs: dict[int, tuple[float, SharedRef | None]] = {}

    @property
    def slots(self) -> list[Slot]:
        """The rank's slots (mapped by this reader; the store's writer writes into them)."""
        return self._slots

    @property
    def shm_dir(self) -> Path:
        return self._shm_dir

    @property
    def store_id(self) -> str:
        """The id the slot files are named under (``<job>.<node>``, ``.rep`` for a holder's)."""
        return self._job_id

    # -- reading ---------------------------------------------------------------
    def info(self, slot_index: int) -> SnapshotInfo | None:
        return self._slots[slot_index].read_info(self.rank, slot_index)

    def _holding(self, step: int) -> list[SnapshotInfo]:
        """The complete snapshots of ``step``, the newest write first (a step redone after a
        rollback may be in two slots: the one written last is the current timeline's)."""
        infos = [self.info(i) for i in range(self.num_slots)]
        found = [inf for inf in infos if inf is not None and inf.step == step and self._complete(inf)]
        return sorted(found, key=lambda inf: -inf.written_at)

    # -- split snapshots (nonstop.snapshot.split) ----------------------------------------------
    def node_copy(self, group: int = 0) -> NodeCopy:
        """The node's shared slots of copy ``group``: the writer's own (share_with), or a
        reader's, opened when it first meets a split slot that refers to that group."""
        with self._opening:  # (the agent's threads read through one store)
            if self._node is not None and self._node.group == group:
                return self._node
            node = self._groups.get(group)
            if node is None:
                node = NodeCopy(
                    shm_dir=self._shm_dir, job_id=self._job_id, num_slots=MAX_NODE_SLOTS, group=group
                )
                self._groups[group] = node
            return node

    def writer_node(self, node: NodeCopy | None) -> None:
        """Read the shared writes of ``node``'s group through the writer's own node copy (the
        store's, :meth:`~nonstop.snapshot.store.RankSnapshotStore.share_with`), closing a
        reader's copy of that group opened before."""
        if node is not None and self._node is not node:
            self._close_readers(node.group)
        self._node = node

    def _close_readers(self, group: int | None = None) -> None:
        """Close the reader's node copies (of ``group`` only, when given)."""
        with self._opening:
            for g in [g for g in self._groups if group is None or g == group]:
                self._groups.pop(g).close()

    def close(self) -> None:
        """Unmap the slots and close the node copies opened as a reader (the writer's own node
        copy is the writer's to close)."""
        for s in self.slots:
            s.close()
        self._close_readers()

    def _ref(self, inf: SnapshotInfo) -> SharedRef | None:
        """The shared write slot ``inf`` refers to (None: it holds its whole snapshot)."""
        cached = self._refs.get(inf.slot)
        if cached is not None and cached[0] == inf.written_at:
            return cached[1]
        ref = ref_of(self._slots[inf.slot].meta_view()[: min(inf.meta_len, REF_HEAD)])
        self._refs[inf.slot] = (inf.written_at, ref)
        return ref

    def _complete(self, inf: SnapshotInfo) -> bool:
        """Whether slot ``inf`` holds a complete snapshot: COMPLETE, and so is the shared write
        it refers to, if any."""
        if inf.state is not SlotState.COMPLETE:
            return False
        ref = self._ref(inf)
        return ref is None or self.node_copy(ref.group).find(ref) is not None

    def _find(self, step: int) -> SnapshotInfo | None:
        found = self._holding(step)
        return found[0] if found else None

    def complete_steps(self) -> list[int]:
        """Steps with a COMPLETE snapshot in this rank's slots, ascending."""
        out = []
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None and self._complete(inf):
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
            if inf is not None and inf.state is SlotState.COMPLETE and not self._complete(inf):
                ref = self._ref(inf)  # its own part is written; the shared part may be on its way
                if ref is not None and self.node_copy(ref.group).writing(ref, live_pids):
                    return inf.step
        return None

    def behind_shared(self, live_pids: Collection[int]) -> bool:
        """Whether this rank's newest part is complete but its node's shared write is gone, written
        by a live process, with no complete step left: with one shared slot (a degraded memory
        tier), the node's first rank to snapshot a step overwrites the shared write the others'
        parts of the step before still name, so a rank a step behind holds nothing whole until
        its own part of the new step lands (an inventory waits for that, as for a writer)."""
        newest: SnapshotInfo | None = None
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is None or inf.state is not SlotState.COMPLETE:
                continue
            if self._complete(inf):
                return False
            if newest is None or inf.step > newest.step:
                newest = inf
        return newest is not None and newest.writer_pid in live_pids and self._ref(newest) is not None

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
            meta = bytes(slot.meta_view()[: inf.meta_len])
            ref = self._ref(inf)
            try:
                if ref is None:
                    return decode_state(meta, slot.data_view(), inf.data_len, what, copy)
                node = self.node_copy(ref.group)
                shared = node.find(ref)
                if shared is None:
                    continue  # overwritten since _holding looked
                held = node.slot(shared.slot)
                held.set_pinned(True, READ_PIN)  # no writer picks it while it is copied
                try:
                    if not node.still(ref, shared):
                        continue
                    common = held.data_view()
                    try:
                        state = decode_split(
                            meta, slot.data_view(), inf.data_len, common, shared.data_len, what, copy
                        )
                    except SnapshotCorruptError:
                        if node.still(ref, shared):
                            raise
                        continue  # torn by a write that chose the slot before the pin
                    if node.still(ref, shared):  # (copies: a write that raced them is not returned)
                        return state
                finally:
                    held.set_pinned(False, READ_PIN)
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
        held: list[int] = []
        groups = set() if self._node is None else {self._node.group}
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is None:
                continue
            keep = self._complete(inf) and inf.step in steps and inf.step not in held
            self._slots[i].set_pinned(keep, KEEP_PIN)
            ref = self._ref(inf) if inf.state is SlotState.COMPLETE else None
            if ref is not None:
                groups.add(ref.group)
            if keep:
                held.append(inf.step)
        for group in sorted(groups):
            self.node_copy(group).keep_only(steps)  # the node's shared writes of the same steps
        return held

    def _copy(
        self,
        step: int,
        inf: SnapshotInfo,
        pinned: list[Slot],
        shared: SnapshotInfo | None,
        *,
        split: bool,
        out: np.ndarray | None,
    ) -> tuple[bytes, np.ndarray]:
        """:meth:`copy_out`'s copy of ``inf``'s meta and data (composed with the shared write's
        data, in ``pinned[1]``, unless ``split``), unchecked."""
        slot = pinned[0]
        src = np.frombuffer(slot.data_memoryview(), dtype=np.uint8, count=inf.data_len)
        meta = bytes(slot.meta_view()[: inf.meta_len])
        if shared is not None and not split:
            what = f"rank {self.rank}'s snapshot of step {step}"
            common = np.frombuffer(pinned[1].data_memoryview(), dtype=np.uint8, count=shared.data_len)
            return compose(meta, src, common, what, out)
        if out is not None and out.size >= inf.data_len:
            data = out[: inf.data_len]
            np.copyto(data, src)  # numpy copies without holding the GIL
            return meta, data
        return meta, src.copy()

    def copy_out(
        self,
        step: int,
        *,
        out: np.ndarray | None = None,
        keep: bool = False,
        split: bool = False,
        settle_s: float = 0.0,
    ) -> RawSnapshot:
        """A private copy of the snapshot of ``step`` that no later write can tear
        (:meth:`_copy_out_once`). ``settle_s``: a step that is missing, or torn by a write that
        slipped in, is tried again for up to that long (a fetch's source: its rank may be
        rewriting that very step, e.g. starting its slots over after an elastic renumbering, which
        clears them and writes the restored step again); 0, the default: one try."""
        deadline = time.monotonic() + settle_s
        while True:
            try:
                return self._copy_out_once(step, out=out, keep=keep, split=split)
            except SnapshotMissingError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(SETTLE_POLL_S)

    def _copy_out_once(self, step: int, *, out: np.ndarray | None, keep: bool, split: bool) -> RawSnapshot:
        """A private copy of the snapshot of ``step`` that no later write can tear.

        For readers in another process than the writer (the agent's persister).
        The slot is pinned while it is copied, so the writer leaves it alone, and
        the header is checked again afterwards: a write that started before the
        pin was seen raises :class:`SnapshotMissingError` (retry with a newer step).
        ``out`` (a uint8 array) is reused for the data when it is large enough:
        fresh memory costs a page fault per 4 KiB, slower than the copy itself.
        ``keep``: also set KEEP_PIN on the slot (before the read pin is released, so no
        write can slip in between): it stays until :meth:`keep_only` releases it.
        A snapshot split with the node's shared write comes whole (composed, byte for byte what a
        whole write holds), or with ``split`` as its own part alone (``RawSnapshot.shared`` names
        the shared write: a replicator sends that once per node).
        """
        inf = self._find(step)
        if inf is None:
            raise self._missing(step)
        slot = self._slots[inf.slot]
        ref = self._ref(inf)
        node = self.node_copy(ref.group) if ref is not None else None
        shared = node.find(ref) if node is not None and ref is not None else None
        if node is not None and shared is None:
            raise self._missing(step)
        pinned = [slot] if shared is None or node is None else [slot, node.slot(shared.slot)]

        def same_write() -> bool:
            now = self.info(inf.slot)
            if now is None or (now.state, now.step, now.written_at) != (inf.state, step, inf.written_at):
                return False
            return node is None or ref is None or shared is None or node.still(ref, shared)

        for s in pinned:
            s.set_pinned(True, READ_PIN)
        try:
            if not same_write():
                raise self._missing(step)
            try:
                meta, data = self._copy(step, inf, pinned, shared, split=split, out=out)
            except (SnapshotCorruptError, ValueError):
                # a write that slipped in (it chose the slot before the pin) tears what was
                # copied, and composing torn halves fails: only a write still the same is corrupt
                if same_write():
                    raise
                raise self._missing(step) from None
            if not same_write():
                raise self._missing(step)
            if keep:
                for s in pinned:
                    s.set_pinned(True, KEEP_PIN)
        finally:
            for s in pinned:
                s.set_pinned(False, READ_PIN)
        own = split and shared is not None
        return RawSnapshot(
            rank=self.rank,
            step=step,
            meta=meta,
            data=data,
            written_at=inf.written_at,
            shared=ref if own else None,
            shared_len=shared.data_len if own and shared is not None else 0,
        )
