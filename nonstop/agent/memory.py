"""A node agent's side of its memory tier's room (:mod:`nonstop.snapshot.space`).

When the node joins a job, :meth:`NodeMemory.open` writes the node's plan (its ranks' slots and
the replicas it holds) beside its slot files; the stores of its workers check it against the free
space before they first size a slot, when the size of a rank's state is known. A store that finds
too little room leaves the one-line error in ``<job_dir>/shm-short-<node>.txt``;
:meth:`NodeMemory.poll`, called from the agent's loop, finds it and hands it to the agent once,
which tells the coordinator (``fatal``: the job fails with that line) and keeps it for the
launcher (exit code 2).

**Locked memory** (issue 20's memory preflight). On a device node each rank page-locks its slots
(``cudaHostRegister`` of the slot's data, :meth:`~nonstop.snapshot.slot.Slot.pin_for_cuda`) so
device-to-host copies into them are asynchronous; locked memory is bounded by ``RLIMIT_MEMLOCK``
(``ulimit -l``; a container's ``memlock`` ulimit, often 64 KiB or 8 MiB). Whether the CUDA driver
charges a registration to that limit depends on the driver; memory an RDMA NIC registers (NCCL's
InfiniBand/RoCE transport) always is, so the check is made wherever slots are pinned. The size a
rank locks is known when its slots are first sized (the same moment as the free-space check): the
agent's :meth:`NodeMemory.poll` reads its ranks' slot files and, when ``num_slots`` x the largest
slot exceeds the soft limit the workers inherit, fails the job with one line saying how to raise
it (exit code 2), through the same record as the free-space shortfall. An agent that holds
``CAP_IPC_LOCK`` (root, or a container given it for RDMA) is not checked: the kernel lifts the
limit for it and for the workers it starts. CPU nodes (and fake
devices) pin nothing and are not checked; ``NONSTOP_MEMLOCK_CHECK=0`` skips the check (the
slots then stay pageable where registration fails: slower captures, nothing else), ``=1`` makes
it on any node (tests: a CPU job under a lowered ``ulimit -l``).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from nonstop.devices.inventory import Devices
from nonstop.replica.peer import REPLICA_SLOTS, local_store_id, replica_store_id
from nonstop.snapshot.nodecopy import node_slots
from nonstop.snapshot.slot import segment_prefix
from nonstop.snapshot.space import NodePlan, file_sizes, human, paths_of_node, short_record_path, write_plan

__all__ = [
    "CAP_IPC_LOCK",
    "MEMLOCK_CHECK",
    "NodeMemory",
    "has_ipc_lock",
    "memlock_shortfall",
    "pins_slots",
    "soft_memlock_limit",
]

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the agent looks for a store's shortfall record
MEMLOCK_CHECK = "NONSTOP_MEMLOCK_CHECK"  # "0": no locked-memory check; "1": on any node


def pins_slots(devices: Devices, env: Mapping[str, str] | None = None) -> bool:
    """Whether the locked-memory check is made on a node with ``devices``: where its ranks
    page-lock their slots (real CUDA devices: ``pin_for_cuda``), unless ``$NONSTOP_MEMLOCK_CHECK``
    is ``0``; anywhere when it is ``1``."""
    env = os.environ if env is None else env
    forced = env.get(MEMLOCK_CHECK)
    if forced in ("0", "1"):
        return forced == "1"
    return devices.type == "cuda" and devices.limited and not devices.fake


CAP_IPC_LOCK = 14  # linux/capability.h: lock memory beyond RLIMIT_MEMLOCK


def has_ipc_lock(status: str | None = None) -> bool:
    """Whether this process holds ``CAP_IPC_LOCK`` in its effective set (``CapEff`` of
    ``/proc/self/status``, or of ``status``): the kernel then does not hold its page-locking --
    ``mlock``, the pinning under ``cudaHostRegister``, an RDMA registration -- to ``RLIMIT_MEMLOCK``
    (root, and containers given the capability for RDMA). False where it cannot be read."""
    if status is None:
        try:
            with open("/proc/self/status") as f:
                status = f.read()
        except OSError:
            return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split(":", 1)[1].strip(), 16) >> CAP_IPC_LOCK & 1)
            except ValueError:
                return False
    return False


def soft_memlock_limit() -> int | None:
    """This process's soft ``RLIMIT_MEMLOCK`` in bytes (its children inherit it and its
    capabilities); None: unlimited, or not enforced (:func:`has_ipc_lock`)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or has_ipc_lock():
        return None
    return int(soft)


def memlock_shortfall(
    *, node: str, num_slots: int, slot_bytes: int, limit: int | None, shared: tuple[int, int] = (0, 0)
) -> str | None:
    """The one-line error when a rank's ``num_slots`` slots of ``slot_bytes`` -- and, with a node
    copy, the node's ``shared`` = (slots, bytes each) shared slots, which any rank of the node
    claims in its turn and page-locks -- do not fit in the locked-memory ``limit`` (bytes; None:
    unlimited); None when they do."""
    need = num_slots * slot_bytes + shared[0] * shared[1]
    if limit is None or need <= limit:
        return None
    what = f"{num_slots} x {human(slot_bytes)}"
    if shared[0]:
        what += f" of its own, {shared[0]} x {human(shared[1])} shared by the node's ranks"
    return (
        f"locked memory: each rank of node {node} page-locks {human(need)} of snapshot slots "
        f"({what}) for its device copies but RLIMIT_MEMLOCK is {human(limit)}; "
        f"raise it before nonstop run: ulimit -l unlimited (docker run --ulimit memlock=-1; Kubernetes: "
        f"the container runtime's memlock limit, e.g. LimitMEMLOCK=infinity), or set "
        f"{MEMLOCK_CHECK}=0 to run with pageable slots"
    )


class NodeMemory:
    """The plan of one node's memory tier and the watch for a shortfall (module docstring).
    Used from the agent's loop thread only."""

    def __init__(
        self,
        plan: NodePlan,
        record: Path,
        *,
        pinned: bool = False,
        memlock: Callable[[], int | None] = soft_memlock_limit,
    ) -> None:
        self.plan = plan
        self._record = record
        self.error: str | None = None  # the shortfall's line, once found
        self._next = 0.0
        self._pinned = pinned  # its ranks page-lock their slots: check the locked-memory limit
        self._memlock = memlock
        self._locked_checked = (0, 0)  # the largest (rank, shared) slot sizes checked so far

    @classmethod
    def open(
        cls,
        *,
        node: str,
        job_id: str,
        job_dir: Path,
        shm_dir: Path,
        nproc: int,
        num_slots: int,
        replicas: int,
        pinned: bool = False,
        memlock: Callable[[], int | None] = soft_memlock_limit,
        copy_groups: int = 1,
    ) -> NodeMemory:
        """Write the node's plan (a stale shortfall record of an earlier job is removed first). A
        node holds, on average, the replicas of ``replicas`` x ``nproc`` ranks of other nodes.
        ``pinned``: its ranks page-lock their slots (:func:`pins_slots`); ``memlock``: reads the
        locked-memory limit (tests pass a fake); ``copy_groups``: the node copies' groups
        (``JobConfig.node_copy_groups``)."""
        record = short_record_path(job_dir, node)
        record.unlink(missing_ok=True)
        local_id = local_store_id(job_id, node)
        plan = NodePlan(
            node=node,
            job_dir=str(job_dir),
            shm_dir=str(shm_dir),
            num_slots=num_slots,
            local_ranks=nproc,
            replica_ranks=replicas * nproc,
            replica_slots=REPLICA_SLOTS if replicas else 0,
            store_ids=(local_id, replica_store_id(job_id, node)),
            copy_groups=copy_groups,
        )
        try:
            write_plan(plan, local_id)
        except OSError as e:  # a full memory filesystem: the stores' own allocation fails cleanly
            log.warning("node %s: could not write its memory plan (%s); no start check", node, e)
        return cls(plan, record, pinned=pinned, memlock=memlock)

    def poll(self, now: float | None = None) -> str | None:
        """The shortfall's one-line error the first time a store has recorded one; else None."""
        now = time.monotonic() if now is None else now
        if self.error is not None or now < self._next:
            return None
        self._next = now + POLL_S
        try:
            text = self._record.read_text().strip()
        except OSError:
            return self._check_locked()
        self.error = text or "snapshot memory is too small for the job"
        return self.error

    def _check_locked(self) -> str | None:
        """The locked-memory check (module docstring), each time the node's largest slot grows."""
        if not self._pinned:
            return None
        shm, local = Path(self.plan.shm_dir), self.plan.store_ids[0] if self.plan.store_ids else ""
        size = max(file_sizes(list(shm.glob(f"{segment_prefix(local)}r*-s*"))), default=0) if local else 0
        shared = max(file_sizes(paths_of_node(shm, local)), default=0) if local else 0
        if size <= self._locked_checked[0] and shared <= self._locked_checked[1]:
            return None
        self._locked_checked = (max(size, self._locked_checked[0]), max(shared, self._locked_checked[1]))
        problem = memlock_shortfall(
            node=self.plan.node,
            num_slots=self.plan.num_slots,
            slot_bytes=size,
            limit=self._memlock(),
            shared=(node_slots(self.plan.num_slots), shared) if shared else (0, 0),
        )
        if problem is not None:
            self.error = problem
            try:  # where a restarted agent or a reader of the job dir finds it, as a store's
                self._record.write_text(problem + "\n")
            except OSError as e:
                log.warning("could not record the locked-memory shortfall: %s", e)
        return problem
