"""A job's keys in the control store (``--store etcd://...``): what lets the coordinator restart.

Layout, under ``/nonstop/jobs/<job_id>/``::

    leader          the coordinator's address, bound to its lease: one coordinator at a time
    state           the coordinator's record (JSON, :meth:`Coordinator.record`): generation,
                    members, which node plays which rank, workers, steps, nodes, failures
    nodes/<name>    one key per node agent, bound to the agent's own lease (TTL = --lease-ttl)

**Leadership.** A coordinator writes ``leader`` only if it is absent (compare-and-put) and keeps
its lease alive; a restarted coordinator waits until the dead one's lease has expired. A
coordinator that loses its lease stops at once: another may be running.

**Node liveness.** Agents keep their own ``nodes/<name>`` lease alive directly with the store,
so node liveness does not depend on the coordinator process: it may die and restart while
every node keeps training. The coordinator watches ``nodes/``: a delete (lease expired) is a
lost node. An agent that cannot refresh its lease fences itself (kills its processes) at 3/4 of
the TTL, before the store deletes its key.

Values are JSON; nothing is unpickled.
"""

from __future__ import annotations

import json
import time
from typing import Any

from nonstop.control.store import ControlStore, LeaseKeeper, Watch
from nonstop.errors import ControlError

__all__ = ["JobStore"]


class JobStore:
    """One job's keys in a :class:`~nonstop.control.store.ControlStore` (see module docstring)."""

    def __init__(self, store: ControlStore, job_id: str) -> None:
        self.store = store
        self.prefix = f"/nonstop/jobs/{job_id}/"
        self._saved: str | None = None

    # -- the coordinator ------------------------------------------------------------------------
    def lead(self, address: str, ttl: float, *, timeout: float, on_lost: Any) -> LeaseKeeper:
        """Become the job's coordinator: wait (at most ``timeout``) until no other holds
        ``leader``, then hold it with a lease of ``ttl`` kept alive by the returned keeper;
        ``on_lost(reason)`` runs if the lease is lost. Raises ControlError on timeout."""
        key = self.prefix + "leader"
        deadline = time.monotonic() + timeout
        while True:
            lease = self.store.grant_lease(ttl)
            if self.store.put_if(key, address.encode(), expect_revision=0, lease=lease.id) is not None:
                return LeaseKeeper(self.store, lease, on_lost=on_lost).start()
            self.store.revoke(lease.id)
            held = self.store.get(key)
            left = deadline - time.monotonic()
            if left <= 0:
                who = held.value.decode(errors="replace") if held is not None else "?"
                raise ControlError(
                    f"another coordinator ({who}) holds job {self.prefix} for over {timeout:g}s"
                )
            if held is not None:
                with self.store.watch(key, start_revision=held.mod_revision + 1) as w:
                    w.get(timeout=min(left, ttl + 1.0))  # until it is deleted (or try again)

    def load(self) -> dict[str, Any] | None:
        """The last record saved (None: a new job)."""
        kv = self.store.get(self.prefix + "state")
        if kv is None:
            return None
        doc = json.loads(kv.value)
        self._saved = kv.value.decode()
        return doc if isinstance(doc, dict) else None

    def save(self, record: dict[str, Any]) -> bool:
        """Write ``record`` unless it is what was saved last; True when it was written."""
        text = json.dumps(record, sort_keys=True, separators=(",", ":"))
        if text == self._saved:
            return False
        self.store.put(self.prefix + "state", text.encode())
        self._saved = text
        return True

    def live_nodes(self) -> tuple[set[str], int]:
        """Nodes whose lease is alive now, and the store revision to watch from."""
        rev = self.store.revision()
        names = {kv.key[len(self.nodes_prefix) :] for kv in self.store.get_prefix(self.nodes_prefix)}
        return names, rev

    def watch_nodes(self, start_revision: int) -> Watch:
        return self.store.watch_prefix(self.nodes_prefix, start_revision=start_revision)

    @property
    def nodes_prefix(self) -> str:
        return self.prefix + "nodes/"

    def node_name(self, key: str) -> str:
        return key[len(self.nodes_prefix) :]

    # -- a node agent -------------------------------------------------------------------------------
    def register_node(self, name: str, data_addr: str, ttl: float) -> LeaseKeeper:
        """Hold ``nodes/<name>`` with a new lease of ``ttl``, refreshed every ``ttl / 5`` by the
        returned keeper (its ``last_ok_sent`` tells the agent when to fence)."""
        lease = self.store.grant_lease(ttl)
        self.store.put(self.nodes_prefix + name, json.dumps({"data": data_addr}).encode(), lease=lease.id)
        return LeaseKeeper(self.store, lease, interval=lease.ttl / 5).start()
