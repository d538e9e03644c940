"""A node agent's side of its memory tier's room (:mod:`nonstop.snapshot.space`).

When the node joins a job, :meth:`NodeMemory.open` writes the node's plan (its ranks' slots and
the replicas it holds) beside its slot files; the stores of its workers check it against the free
space before they first size a slot, when the size of a rank's state is known. A store that finds
too little room leaves the one-line error in ``<job_dir>/shm-short-<node>.txt``;
:meth:`NodeMemory.poll`, called from the agent's loop, finds it and hands it to the agent once,
which tells the coordinator (``fatal``: the job fails with that line) and keeps it for the
launcher (exit code 2).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from nonstop.replica.peer import REPLICA_SLOTS, local_store_id, replica_store_id
from nonstop.snapshot.space import NodePlan, short_record_path, write_plan

__all__ = ["NodeMemory"]

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the agent looks for a store's shortfall record


class NodeMemory:
    """The plan of one node's memory tier and the watch for a shortfall (module docstring).
    Used from the agent's loop thread only."""

    def __init__(self, plan: NodePlan, record: Path) -> None:
        self.plan = plan
        self._record = record
        self.error: str | None = None  # the shortfall's line, once found
        self._next = 0.0

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
    ) -> NodeMemory:
        """Write the node's plan (a stale shortfall record of an earlier job is removed first). A
        node holds, on average, the replicas of ``replicas`` x ``nproc`` ranks of other nodes."""
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
        )
        try:
            write_plan(plan, local_id)
        except OSError as e:  # a full memory filesystem: the stores' own allocation fails cleanly
            log.warning("node %s: could not write its memory plan (%s); no start check", node, e)
        return cls(plan, record)

    def poll(self, now: float | None = None) -> str | None:
        """The shortfall's one-line error the first time a store has recorded one; else None."""
        now = time.monotonic() if now is None else now
        if self.error is not None or now < self._next:
            return None
        self._next = now + POLL_S
        try:
            text = self._record.read_text().strip()
        except OSError:
            return None
        self.error = text or "snapshot memory is too small for the job"
        return self.error
