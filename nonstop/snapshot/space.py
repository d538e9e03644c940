"""Room for snapshots in the memory tier: the node's plan, the free-space check, reserving pages.

Slot files live in a memory filesystem (``/dev/shm``, or ``--shm-dir``). Such a filesystem can
be small (a container's default ``/dev/shm`` is 64 MiB) and it can fill while the job runs
(another process writes there). Writing to a page of a file that tmpfs cannot back is a SIGBUS,
which kills the writer mid-step. Three things keep that from happening:

* **The plan.** When a node agent joins a job it writes its :class:`NodePlan` (how many slots its
  ranks and the replicas it holds take) beside its slot files (:func:`plan_path`: it carries the
  job's segment prefix, so it goes with the segments).
* **The check** (:func:`shortfall`). The size of a rank's state becomes known only at its first
  snapshot; before a store first sizes a slot, it checks the node's whole need (the plan's slots
  x that size) against the directory's free space plus what the node's segments already hold.
  A shortfall is one line (:class:`ShmSpaceError`, a :class:`~nonstop.errors.UsageError`) saying
  how much is needed, how much is free and how to give it; it is also written to
  ``<job_dir>/shm-short-<node>.txt`` (:func:`short_record_path`), where the node agent finds it
  and fails the job (exit code 2).
* **Reserving** (:func:`reserve`). A slot's pages are allocated when the slot is sized
  (``posix_fallocate``): on tmpfs that either backs every page or fails at once with ENOSPC
  (:class:`ShmFullError`), never a SIGBUS later. The store then degrades: fewer slots for that
  rank (down to one), and with none a write that fails like any failed snapshot (the replica or
  durable tier covers it). Each degradation is logged and, when the plan names the job dir, an
  event (:class:`~nonstop.events.memory.MemoryDegraded`) in ``events.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from nonstop.errors import UsageError
from nonstop.snapshot.api import HEADER_SIZE
from nonstop.snapshot.slot import ShmFullError, align, rank_slot_paths, reserve, segment_prefix

log = logging.getLogger(__name__)

__all__ = [
    "NodePlan",
    "ShmFullError",
    "ShmSpaceError",
    "StoreRoom",
    "free_bytes",
    "held_bytes",
    "human",
    "plan_path",
    "read_plan",
    "report_degraded",
    "reserve",
    "short_record_path",
    "shortfall",
    "slot_bytes",
    "write_plan",
]


class ShmSpaceError(UsageError):
    """The memory tier cannot hold what the job's slots need (one line: needed, free, what to do)."""


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """What one node's memory tier must hold.

    ``num_slots`` slots for each of its ``local_ranks`` ranks and ``replica_slots`` for each of
    the ``replica_ranks`` ranks of other nodes it holds replicas of, every slot the size of one
    rank's snapshot. ``store_ids``: the store ids of its segments (its own ranks', its replicas'),
    whose files count as already held. Hot spares are not counted: a spare that takes a rank of
    this node maps that rank's files; one that takes a rank of another node allocates new slots,
    and degrades (fewer slots) when they do not fit."""

    node: str
    job_dir: str
    shm_dir: str
    num_slots: int
    local_ranks: int
    replica_ranks: int = 0
    replica_slots: int = 0
    store_ids: tuple[str, ...] = ()
    copy_groups: int = 1  # node copies: the copy groups whose ranks it holds (nodecopy.py)

    @property
    def slots(self) -> int:
        return self.num_slots * self.local_ranks + self.replica_slots * self.replica_ranks

    def need_bytes(self, slot_bytes: int) -> int:
        return self.slots * slot_bytes

    def shared_need(self, node_slots: int, slot_bytes: int) -> int:
        """What the node needs for its shared writes of ``slot_bytes`` each, when its ranks'
        alike state is kept once per copy group (``node_slots`` shared slots each,
        :mod:`nonstop.snapshot.nodecopy`) and so is the one of the ranks it holds replicas of (one
        slot more than a replica's: ``nodecopy.node_slots``; a holder's peers are assumed to have
        as many groups). The ranks' own parts are their stores' checks."""
        held = self.replica_slots + 1 if self.replica_ranks else 0
        return self.copy_groups * (node_slots + held) * slot_bytes


def plan_path(shm_dir: Path, store_id: str) -> Path:
    """Where the plan of the node whose own ranks' store id is ``store_id`` lives."""
    return shm_dir / f"{segment_prefix(store_id)}space.json"


def write_plan(plan: NodePlan, store_id: str) -> Path:
    path = plan_path(Path(plan.shm_dir), store_id)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(plan)))
    tmp.replace(path)
    return path


def read_plan(shm_dir: Path, store_id: str) -> NodePlan | None:
    """The plan beside ``store_id``'s slots; None when there is none (a store outside a job, a
    replica store) or it does not parse."""
    try:
        raw = json.loads(plan_path(shm_dir, store_id).read_text())
        raw["store_ids"] = tuple(raw.get("store_ids", ()))
        return NodePlan(**raw)
    except (OSError, ValueError, TypeError):
        return None


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def held_bytes(shm_dir: Path, store_ids: tuple[str, ...]) -> int:
    """Bytes the segments of ``store_ids`` hold now (allocated pages, not their sizes)."""
    total = 0
    for sid in store_ids:
        for path in shm_dir.glob(f"{segment_prefix(sid)}*"):
            try:
                total += os.stat(path).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def shortfall(plan: NodePlan, slot_bytes: int, *, node_slots: int = 0) -> str | None:
    """The one-line error when the node's memory tier cannot hold ``plan``'s slots of
    ``slot_bytes`` each (header, data and meta); None when it can. ``node_slots``: the check of
    a node copy's shared slots instead of its ranks' (:meth:`NodePlan.shared_need`)."""
    shm = Path(plan.shm_dir)
    need = plan.shared_need(node_slots, slot_bytes) if node_slots else plan.need_bytes(slot_bytes)
    free = free_bytes(shm)
    room = free + held_bytes(shm, plan.store_ids)
    if need <= room:
        return None
    if node_slots:
        parts = f"{node_slots} shared slots" + (
            f" + {plan.replica_slots + 1} for replicas" if plan.replica_ranks else ""
        )
    else:
        parts = f"{plan.local_ranks} rank(s) x {plan.num_slots} slots"
        if plan.replica_ranks:
            parts += f" + {plan.replica_ranks} replica(s) x {plan.replica_slots} slots"
    size_g = max(1, -(-int(need * 1.25 + (room - free)) // (1 << 30)))
    return (
        f"snapshot memory: node {plan.node} needs {human(need)} in {shm} ({parts} of {human(slot_bytes)}) "
        f"but {human(room)} is free; give it room: --shm-dir DIR on a larger memory filesystem, or a "
        f"larger /dev/shm (docker run --shm-size={size_g}g; Kubernetes: an emptyDir with medium: Memory)"
    )


def short_record_path(job_dir: Path, node: str) -> Path:
    """Where a store that found the node's memory tier too small leaves the one-line error."""
    return job_dir / f"shm-short-{node}.txt"


def slot_bytes(data_len: int, meta_len: int) -> int:
    """The size of a slot holding ``data_len`` bytes of data and ``meta_len`` of meta (as
    :meth:`~nonstop.snapshot.slot.Slot.ensure_capacity` sizes it)."""
    return HEADER_SIZE + align(data_len) + align(int(meta_len * 1.5) + 4096)


def report_degraded(plan: NodePlan | None, *, rank: int, store: str, slots_left: int, error: str) -> None:
    """Log that ``rank``'s ``store`` ("local" or "replica") has ``slots_left`` usable slots now,
    and, when the node has a plan, append a ``memory_degraded`` event to the job's log."""
    log.warning(
        "rank %d: snapshot memory is full (%s); %s slots of this rank now: %d",
        rank, error, store, slots_left,
    )  # fmt: skip
    if plan is None:
        return
    from nonstop.events.log import EventLog
    from nonstop.events.memory import MemoryDegraded

    try:
        events = EventLog(Path(plan.job_dir) / "events.jsonl")
    except OSError as e:
        log.warning("could not log the degradation: %s", e)
        return
    try:
        events.emit(
            MemoryDegraded(
                node=plan.node,
                rank=rank,
                store=store,
                slots_left=slots_left,
                free=free_bytes(Path(plan.shm_dir)),
                error=error,
            )
        )
    finally:
        events.close()


def paths_of_node(shm_dir: Path, store_id: str, group: int | None = None) -> list[Path]:
    """The shared slot files of a node copy (``store_id`` is the node's store): of one copy
    ``group``, or of every group when None."""
    which = "*" if group is None else str(group)
    return list(shm_dir.glob(f"{segment_prefix(store_id)}n{which}-s*"))


def groups_of_node(paths: list[Path]) -> int:
    """How many copy groups these shared slot files (:func:`paths_of_node`) belong to."""
    return len({p.name.rpartition("-s")[0] for p in paths})


def file_sizes(paths: list[Path]) -> list[int]:
    """The sizes of these files (those not there left out)."""
    sizes = []
    for path in paths:
        try:
            sizes.append(os.stat(path).st_size)
        except FileNotFoundError:
            pass
    return sizes


def _sized(path: Path) -> bool:
    try:
        return os.stat(path).st_size > 0
    except FileNotFoundError:
        return False


class StoreRoom:
    """One rank store's side of the memory tier: the node's check (once, before the store first
    sizes a slot) and the slots it dropped because they could not be allocated.

    Not thread-safe: its store calls it from the one thread that writes the store."""

    def __init__(
        self, *, shm_dir: Path, store_id: str, rank: int, num_slots: int, shared: bool = False, group: int = 0
    ) -> None:
        """``shared``: a node copy's shared slots of copy ``group`` (reported as store "shared",
        rank -1), not a rank's."""
        self.shm_dir, self.store_id, self.rank, self.num_slots = shm_dir, store_id, rank, num_slots
        self.shared, self.group = shared, group
        self.dropped: set[int] = set()  # slots that could not be allocated: never written again
        self._writes = 0  # writes so far (the start check ends after num_slots)
        self._checked_size = 0
        self._took_over: bool | None = None  # this rank's slots existed before this store's first write

    def check_shared(self, data_len: int, meta_len: int, node_slots: int) -> None:
        """:meth:`check` for a node copy's shared slots (``rank`` unused): the node's need with
        its ranks' alike state kept once, in ``node_slots`` slots of this size.

        The node's ranks take turns claiming its shared writes (under the node's lock), so a
        rank's own count of writes says nothing of the node's start. The node is at its start
        while fewer than ``node_slots`` shared slots are sized, and a size is checked only when
        larger than every sized shared slot (a size one of them has was checked by the rank that
        first sized it); a larger state later, once every slot is sized, degrades instead."""
        sizes = file_sizes(paths_of_node(self.shm_dir, self.store_id, self.group))
        if len([n for n in sizes if n > 0]) >= node_slots:
            return
        self._check_size(slot_bytes(data_len, meta_len), max(sizes, default=0), node_slots)

    def plan(self) -> tuple[NodePlan | None, str]:
        """The node's plan and what the store is to it: "local" (a node's own ranks), "shared"
        (their node copy) or "replica" (the ranks of other nodes it holds)."""
        if self.store_id.endswith(".rep"):
            return read_plan(self.shm_dir, self.store_id.removesuffix(".rep")), "replica"
        return read_plan(self.shm_dir, self.store_id), "shared" if self.shared else "local"

    def check(self, data_len: int, meta_len: int) -> None:
        """At start, for a node's own ranks: can the node's memory tier hold every slot of its
        plan, each of this size? ShmSpaceError when not (its line also left in the job dir, where
        the node agent finds it and fails the job). "At start" is the store's first ``num_slots``
        writes (one per slot): a state's size may change over its first snapshots (one taken before
        the first optimizer step has no optimizer state yet), and each larger size is checked
        again; later growth degrades instead (:meth:`drop`).

        A store whose rank's slots were already sized before its first write (a replacement
        worker, a migration's joiner: the job is running, its start passed the check) is never
        checked: the memory tier may have filled since and this rank's slots, or others', may
        have been dropped (never grown to the size the plan counts), which the check would take
        for a node too small and fail the running job; its writes degrade instead."""
        self._writes += 1
        if self._took_over is None:
            self._took_over = any(_sized(p) for p in rank_slot_paths(self.shm_dir, self.store_id, self.rank))
        if self._took_over or self._writes > self.num_slots:
            return
        self._check_size(slot_bytes(data_len, meta_len), self._checked_size, 0)

    def _check_size(self, size: int, checked: int, node_slots: int) -> None:
        """ShmSpaceError when the node's plan cannot hold its slots at ``size`` each (not
        checked again when no larger than ``checked``)."""
        if size <= max(checked, self._checked_size):
            return
        self._checked_size = size
        plan, kind = self.plan()
        if plan is None or kind == "replica":
            return
        problem = shortfall(plan, size, node_slots=node_slots)
        if problem is None:
            return
        try:
            short_record_path(Path(plan.job_dir), plan.node).write_text(problem + "\n")
        except OSError as e:
            log.warning("could not record the shortfall: %s", e)
        raise ShmSpaceError(problem)

    def drop(self, index: int, error: ShmFullError) -> None:
        """Slot ``index`` could not be allocated: never write it again, say so (log, event);
        ShmFullError when no slot is left."""
        self.dropped.add(index)
        left = self.num_slots - len(self.dropped)
        plan, kind = self.plan()
        report_degraded(plan, rank=self.rank, store=kind, slots_left=left, error=str(error))
        if left == 0:
            raise ShmFullError(f"rank {self.rank}: no snapshot slot fits in {self.shm_dir} ({error})")
