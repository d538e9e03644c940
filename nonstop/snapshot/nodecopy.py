"""One copy per node of the state its ranks hold alike: the node's shared slots.

The ranks of a data-parallel (DDP) job hold bitwise-equal parameters and optimizer state after
every step (nonstop's canonical-order gradient allreduce makes them so). Kept per rank, a node of
8 ranks would hold 8 identical copies in its memory tier. With a :class:`NodeCopy` the node holds
one: the *shared* tensors of a step (those the caller's ``share`` predicate names: the
optimizer's parameters and state) go to the node's shared slots, and each rank's own slots keep
the rest (buffers, RNG, data position, extras) plus a reference to the shared write.

Who writes it: the first rank of the node to snapshot step S in generation G **claims** it (under
an ``flock`` on the node's lock file) and copies the shared tensors, overlapped like any snapshot
(its optimizer is fenced on that copy); every other rank finds the claim and copies only its own
part, so it pays no bulk copy and no fence at all. Nobody waits for anybody: a rank's snapshot of
S is complete only when both its own slot and the shared write of (G, S) are COMPLETE
(:class:`~nonstop.snapshot.store.RankSnapshotStore` checks both on every read), so a claimer
killed mid-copy leaves step S incomplete on every rank of the node -- never committed, as if each
rank's own write had been torn.

The generation is part of the claim: a step redone after a rollback is a new write, never the old
timeline's bytes. A claim whose layout (the shared tensors' dtypes, shapes and offsets) differs
from the claimer's is refused (None: the caller writes its whole state to its own slots), as is
a claim when no shared slot is free.

Slot choice (under the lock): never the newest complete write (by step, then time), a pinned slot
(a reader's: the agent's persister or replicator) or a slot a *live* process is writing; among
the rest a torn one, then the oldest complete one, and a slot never used last. The node has one
slot more than a rank, because two claims may be in flight at once (the claimer of S still
copying when another rank, one step ahead, claims S + 1); that slot's pages are allocated only
when it is first needed.

**Copy groups.** The ranks whose state is alike form a *copy group*, and a node keeps one copy
per group it has ranks of: a DDP job's ranks are all one group (0); an HSDP job's are grouped by
their coordinates other than ``replicate`` (:meth:`~nonstop.mesh.MeshSpec.copy_group`: the
ranks of one shard coordinate in different replica groups hold the same shards, bitwise, after
every step), so a node holding ranks of several replica groups keeps each shard once. A
:class:`SharedRef` names its group; the groups' slots and locks are apart.

Segments: ``<prefix>n<group>-s<i>`` (a rank's are ``<prefix>r<rank>-s<i>``) and the lock file
``<prefix>n<group>-lock``; they go with the job's other segments.

Threading contract: as :class:`~nonstop.snapshot.store.RankSnapshotStore` (one writing thread;
the copier thread writes a claimed slot's COMPLETE header); readers in another process pin slots.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.snapshot.api import SlotState, SnapshotInfo
from nonstop.snapshot.slot import KEEP_PIN, READ_PIN, ShmFullError, Slot, segment_prefix
from nonstop.snapshot.space import StoreRoom

log = logging.getLogger(__name__)

__all__ = [
    "MAX_COPY_GROUPS",
    "MAX_NODE_SLOTS",
    "Claim",
    "NodeCopy",
    "SharedRef",
    "node_slots",
    "shared_slot_path",
]

MAX_NODE_SLOTS = 8
"""Shared slots a reader looks at (a writer's node has :func:`node_slots` of them)."""

MAX_COPY_GROUPS = 64
"""Copy groups a holder keeps shared writes of for its peers (a node's ranks make at most one
group each; a peer naming more is refused, as each group maps slots of its own)."""


def node_slots(rank_slots: int) -> int:
    """Shared slots of a node whose ranks have ``rank_slots`` slots each: one more, because two
    claims may be in flight at once (module docstring)."""
    return min(rank_slots + 1, MAX_NODE_SLOTS)


def shared_slot_path(shm_dir: Path, job_id: str, slot: int, group: int = 0) -> Path:
    return shm_dir / f"{segment_prefix(job_id)}n{group}-s{slot}"


def _lock_path(shm_dir: Path, job_id: str, group: int) -> Path:
    return shm_dir / f"{segment_prefix(job_id)}n{group}-lock"


@dataclass(frozen=True)
class SharedRef:
    """What a rank's slot says about the shared part of its snapshot: the claim (generation,
    step) and ``base``, where the shared data starts in the rank's *virtual* data (its own data,
    then the shared data: the entries of its meta address both); ``group``, the copy group
    whose shared slots hold it (module docstring)."""

    gen: int
    step: int
    base: int
    group: int = 0


@dataclass(frozen=True)
class Claim:
    """The shared write of (gen, step) this rank takes part in: ``writer`` when this rank copies
    the shared tensors into ``slot`` (and marks it COMPLETE), else another rank does."""

    index: int
    slot: Slot
    writer: bool
    meta_len: int = 0  # of the claim's record (the claimer's COMPLETE header carries it)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeCopy:
    """The node's shared slots of one copy group of a job (see the module docstring)."""

    def __init__(self, *, shm_dir: Path, job_id: str, num_slots: int, group: int = 0) -> None:
        if group < 0:
            raise ValueError(f"a copy group is a mesh coordinate index, >= 0 (got {group})")
        self.num_slots, self.group = num_slots, group
        self._slots = [Slot(shared_slot_path(shm_dir, job_id, i, group)) for i in range(num_slots)]
        self._lock = _lock_path(shm_dir, job_id, group)
        self._records: dict[int, tuple[tuple[int, int, int, float], tuple[int, int, str] | None]] = {}
        self._refused: str | None = None  # the last reason a claim was refused (logged once)
        self._room = StoreRoom(
            shm_dir=shm_dir, store_id=job_id, rank=-1, num_slots=num_slots, shared=True, group=group
        )

    def slot(self, index: int) -> Slot:
        return self._slots[index]

    def info(self, index: int) -> SnapshotInfo | None:
        return self._slots[index].read_info(-1, index)

    def _record(self, index: int, inf: SnapshotInfo) -> tuple[int, int, str] | None:
        """(gen, step, layout key) of the claim slot ``index`` holds; None when unreadable."""
        # (only a COMPLETE write's time tells it apart: a claim's WRITING header has none)
        ident = (int(inf.state), inf.step, inf.meta_len, inf.written_at)
        cached = self._records.get(index)
        if cached is not None and cached[0] == ident and inf.state is SlotState.COMPLETE:
            return cached[1]
        rec: tuple[int, int, str] | None = None
        try:
            raw = json.loads(bytes(self._slots[index].meta_view()[: inf.meta_len]))
            gen, step, key = raw["gen"], raw["step"], raw["key"]
            if isinstance(gen, int) and isinstance(step, int) and isinstance(key, str) and step == inf.step:
                rec = (gen, step, key)
        except (ValueError, KeyError, TypeError, AssertionError):
            rec = None
        self._records[index] = (ident, rec)
        return rec

    def _claims(self) -> list[tuple[SnapshotInfo, tuple[int, int, str] | None]]:
        out = []
        for i in range(self.num_slots):
            inf = self.info(i)
            if inf is not None:
                out.append((inf, self._record(i, inf) if inf.state is not SlotState.EMPTY else None))
        return out

    # -- writing -----------------------------------------------------------------------------
    def claim(self, *, gen: int, step: int, key: str, data_len: int, pin: bool) -> Claim | None:
        """Take part in the shared write of (``gen``, ``step``): find another rank's claim of it,
        or claim it in a free slot sized for ``data_len`` bytes. None when the claim found has
        another layout (``key``) or no slot is free: the caller writes its whole state itself."""
        with self._locked():
            return self._claim_locked(gen, step, key, data_len, pin)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The node's lock (``flock`` on its lock file): one claim or install at a time."""
        self._lock.touch(exist_ok=True)
        fd = os.open(self._lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def _claim_locked(self, gen: int, step: int, key: str, data_len: int, pin: bool) -> Claim | None:
        claims = self._claims()
        for inf, rec in claims:
            if rec is None or rec[:2] != (gen, step):
                continue
            if inf.state is SlotState.WRITING and not _alive(inf.writer_pid):
                continue  # its claimer died mid-copy: claim it afresh (below)
            if rec[2] != key:
                return self._refuse(f"step {step}'s shared write has another layout than this rank's state")
            return Claim(inf.slot, self._slots[inf.slot], writer=False)
        record = json.dumps({"gen": gen, "step": step, "key": key}).encode()
        self._room.check_shared(data_len, len(record), self.num_slots)  # at start: ShmSpaceError
        while True:
            index = self._choose(claims)
            if index is None:
                return self._refuse(f"no shared slot was free for step {step}")
            slot = self._slots[index]
            try:
                slot.ensure_capacity(data_len, len(record), pin=pin)
                break
            except ShmFullError as e:
                try:
                    self._room.drop(index, e)  # never again (logged, memory_degraded)
                except ShmFullError:
                    return self._refuse(f"no room for the shared write of step {step} ({e})")
        slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)  # no reader takes it from here on
        slot.meta_view()[: len(record)] = record
        slot.write_header(SlotState.WRITING, step, 0, len(record), 0.0)
        return Claim(index, slot, writer=True, meta_len=len(record))

    def _choose(self, claims: list[tuple[SnapshotInfo, tuple[int, int, str] | None]]) -> int | None:
        by_index = {inf.slot: inf for inf, _ in claims}
        complete = [inf for inf in by_index.values() if inf.state is SlotState.COMPLETE]
        newest = max(complete, key=lambda inf: (inf.step, inf.written_at)).slot if complete else None
        usable = [i for i in range(self.num_slots) if i not in self._room.dropped]
        if len(usable) == 1:
            newest = None  # the memory tier is full: every write overwrites the one slot left
        best: tuple[float, int] | None = None
        for i in usable:
            inf = by_index.get(i)
            if inf is not None:
                if inf.pinned or i == newest:
                    continue
                if inf.state is SlotState.WRITING and _alive(inf.writer_pid):
                    continue  # (this process's own claims are complete before its next one)
            # a torn or empty slot first, then the oldest complete one; a slot never sized last
            # (its pages are allocated only when first claimed: the spare slot costs nothing
            # until two claims are in flight at once)
            if inf is None:
                age = float("inf")
            else:
                age = -1.0 if inf.state is not SlotState.COMPLETE else inf.written_at
            if best is None or age < best[0]:
                best = (age, i)
        return None if best is None else best[1]

    def _refuse(self, why: str) -> Claim | None:
        if why != self._refused:
            self._refused = why
            log.warning("node copy: %s; this rank writes its whole state to its own slots", why)
        return None

    def complete(self, claim: Claim, step: int, data_len: int) -> None:
        """Mark ``claim``'s slot COMPLETE: the claimer's copies of ``data_len`` bytes are done."""
        claim.slot.write_header(SlotState.COMPLETE, step, data_len, claim.meta_len, time.time())

    # -- reading -----------------------------------------------------------------------------
    def find(self, ref: SharedRef) -> SnapshotInfo | None:
        """The COMPLETE shared write ``ref`` names, if the node holds it (in this group's slots:
        a ref of another copy group is never here)."""
        if ref.group != self.group:
            return None
        for inf, rec in self._claims():
            if inf.state is SlotState.COMPLETE and rec is not None and rec[:2] == (ref.gen, ref.step):
                return inf
        return None

    def still(self, ref: SharedRef, seen: SnapshotInfo) -> bool:
        """Whether the write ``seen`` (from :meth:`find`) is still the one ``ref`` names, whole
        (pins aside): a reader checks this after its copy (seqlock-style)."""
        now = self.find(ref)
        return now is not None and (now.slot, now.step, now.written_at, now.data_len) == (
            seen.slot,
            seen.step,
            seen.written_at,
            seen.data_len,
        )

    def writing(self, ref: SharedRef, live_pids: Collection[int]) -> bool:
        """Whether a process in ``live_pids`` is writing the shared write ``ref`` names."""
        if ref.group != self.group:
            return False
        for inf, rec in self._claims():
            if (
                inf.state is SlotState.WRITING
                and rec is not None
                and rec[:2] == (ref.gen, ref.step)
                and inf.writer_pid in live_pids
            ):
                return True
        return False

    def keep_only(self, steps: Collection[int]) -> None:
        """Hold (KEEP_PIN) the complete shared writes of ``steps`` and release every other one.
        The node agent keeps the same steps of all its ranks (and replicas) at once, so every
        rank store of the node asks for the same steps."""
        for inf, rec in self._claims():
            keep = inf.state is SlotState.COMPLETE and rec is not None and inf.step in steps
            self._slots[inf.slot].set_pinned(keep, KEEP_PIN)

    def key_of(self, ref: SharedRef) -> str | None:
        """The layout key of the complete shared write ``ref`` names (None: not held)."""
        if ref.group != self.group:
            return None
        for inf, rec in self._claims():
            if inf.state is SlotState.COMPLETE and rec is not None and rec[:2] == (ref.gen, ref.step):
                return rec[2]
        return None

    def copy_data(self, ref: SharedRef, out: np.ndarray | None = None) -> np.ndarray | None:
        """A private copy of the data of the shared write ``ref`` names (None: not held, or
        overwritten while copying), pinned while it is copied and checked after (seqlock-style)."""
        inf = self.find(ref)
        if inf is None:
            return None
        slot = self._slots[inf.slot]
        slot.set_pinned(True, READ_PIN)
        try:
            src = np.frombuffer(slot.data_memoryview(), dtype=np.uint8, count=inf.data_len)
            if out is not None and out.size >= inf.data_len:
                data = out[: inf.data_len]
                np.copyto(data, src)
            else:
                data = src.copy()
            return data if self.still(ref, inf) else None
        finally:
            slot.set_pinned(False, READ_PIN)

    def install(self, *, gen: int, step: int, key: str, data: Any) -> bool:
        """Hold ``data`` as the shared write of (``gen``, ``step``) -- a replica of another node's,
        received whole: a holder's. Nothing when it is held already. False when no slot is free."""
        with self._locked():
            if self.find(SharedRef(gen, step, 0, self.group)) is not None:
                return True
            index = self._choose(self._claims())
            if index is None:
                return False
            record = json.dumps({"gen": gen, "step": step, "key": key}).encode()
            slot = self._slots[index]
            slot.ensure_capacity(len(data), len(record))  # (a holder's replicas degrade like its others)
            slot.write_header(SlotState.WRITING, step, 0, 0, 0.0)
            n = len(data)
            dst = np.frombuffer(slot.data_memoryview(), dtype=np.uint8, count=n)
            np.copyto(dst, np.frombuffer(data, dtype=np.uint8, count=n))
            slot.forget_views()
            slot.meta_view()[: len(record)] = record
            slot.write_header(SlotState.COMPLETE, step, len(data), len(record), time.time())
            return True

    def close(self) -> None:
        for s in self._slots:
            s.close()
