"""A job's keys in the control store (``--store etcd://...``): what lets the coordinator restart.

Layout, under ``/nonstop/jobs/<job_id>/``::

    leader          the coordinator (JSON: address, pid, host), bound to its lease: one at a time
    state           the coordinator's record (JSON, :meth:`Coordinator.record`): generation,
                    members, which node plays which rank, workers, steps, nodes, failures
    nodes/<name>    one key per node agent, bound to the agent's own lease (TTL = --lease-ttl)

**Leadership.** A coordinator writes ``leader`` only if it is absent (compare-and-put) and keeps
its lease alive; a restarted coordinator waits until the dead one's lease has expired -- unless
the holder was a process of this host that no longer exists (node 0's launcher restarts its
coordinator there): then it revokes that lease at once. A coordinator that loses its lease stops
at once: another may be running. The leader lease is longer than the nodes' (``leader_ttl``):
the coordinator rides through a store stall that long.

**Node liveness.** Agents keep their own ``nodes/<name>`` lease alive directly with the store,
so node liveness does not depend on the coordinator process: it may die and restart while
every node keeps training. The coordinator watches ``nodes/``: a delete (lease expired) is a
lost node -- unless the coordinator still hears the node over its channel: then the node is
kept while it is heard, and its agent registers a new lease. An agent fences itself (kills its
processes) when neither the store nor the coordinator has heard it for 3/4 of the TTL, before
either may act on its loss.

**Writes** of the record go through a :class:`RecordWriter` thread, so a store that stalls never
stalls the coordinator's loop (which acknowledges the nodes' leases).

Values are JSON; nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

from nonstop.control.store import ControlStore, LeaseKeeper, Watch
from nonstop.errors import ControlError

__all__ = ["JobStore", "RecordWriter", "leader_value"]

log = logging.getLogger(__name__)


def leader_value(address: str) -> bytes:
    """What a coordinator writes under ``leader``: where it listens, and which process it is."""
    return json.dumps({"address": address, "pid": os.getpid(), "host": socket.gethostname()}).encode()


def _holder_is_dead_here(value: bytes) -> bool:
    """True when ``value`` (a ``leader`` value) names a process of this host that is gone."""
    try:
        doc = json.loads(value)
        pid, host = int(doc["pid"]), str(doc["host"])
    except (ValueError, TypeError, KeyError):
        return False  # an older or foreign holder: wait its lease out
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class JobStore:
    """One job's keys in a :class:`~nonstop.control.store.ControlStore` (see module docstring)."""

    def __init__(self, store: ControlStore, job_id: str) -> None:
        self.store = store
        self.prefix = f"/nonstop/jobs/{job_id}/"
        self._saved: str | None = None
        self.took_over_dead = False  # the last lead() revoked a dead local predecessor's lease

    # -- the coordinator ------------------------------------------------------------------------
    def lead(self, address: str, ttl: float, *, timeout: float, on_lost: Any) -> LeaseKeeper:
        """Become the job's coordinator: wait (at most ``timeout``) until no other holds
        ``leader``, then hold it with a lease of ``ttl`` kept alive by the returned keeper;
        ``on_lost(reason)`` runs if the lease is lost. A holder that was a process of this host
        and is gone is not waited for: its lease is revoked (``self.took_over_dead`` then True).
        Raises ControlError on timeout."""
        key = self.prefix + "leader"
        deadline = time.monotonic() + timeout
        self.took_over_dead = False
        while True:
            lease = self.store.grant_lease(ttl)
            if self.store.put_if(key, leader_value(address), expect_revision=0, lease=lease.id) is not None:
                # refreshed every tenth of its TTL: the lease is safe until a TTL after the last
                # refresh that got through, so a stall of up to 0.9 TTL is ridden through
                return LeaseKeeper(self.store, lease, interval=lease.ttl / 10, on_lost=on_lost).start()
            self.store.revoke(lease.id)
            held = self.store.get(key)
            if held is not None and held.lease and _holder_is_dead_here(held.value):
                log.info("the previous coordinator (%s) is gone; revoking its lease", held.value.decode())
                self.store.revoke(held.lease)
                self.took_over_dead = True
                continue
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


class RecordWriter:
    """Writes a coordinator's record (and revokes leases) on a thread of its own, newest record
    wins: a store that stalls or is unreachable delays the writes, never the caller. Failed
    writes are retried every ``retry_s`` until they get through or :meth:`close`."""

    def __init__(self, jobs: JobStore, *, retry_s: float = 0.2) -> None:
        self.jobs = jobs
        self.retry_s = retry_s
        self._cond = threading.Condition()
        self._record: dict[str, Any] | None = None
        self._revokes: list[int] = []
        self._busy = False
        self._closed = False
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="nonstop-record-writer", daemon=True)
        self._thread.start()

    def save(self, record: dict[str, Any]) -> None:
        """Write ``record`` soon (replacing one not written yet)."""
        with self._cond:
            self._record = record
            self._cond.notify()

    def revoke(self, lease: int) -> None:
        """End ``lease`` soon (its keys go; a node agent holding it fences unless heard)."""
        with self._cond:
            self._revokes.append(lease)
            self._cond.notify()

    def close(self, timeout: float) -> bool:
        """Write what is pending (waiting at most ``timeout``), then stop; True when all got through."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._record is not None or self._revokes or self._busy) and time.monotonic() < deadline:
                self._cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            done = self._record is None and not self._revokes and not self._busy
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + 0.1)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._record is None and not self._revokes and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                record, self._record = self._record, None
                revokes, self._revokes = self._revokes, []
                self._busy = True
            failed = self._write(record, revokes)
            with self._cond:
                self._busy = False
                if failed is not None:  # keep it unless a newer one came meanwhile
                    frecord, frevokes = failed
                    if self._record is None:
                        self._record = frecord
                    self._revokes[:0] = frevokes
                self._cond.notify_all()
                if failed is not None and not self._closed:
                    self._cond.wait(self.retry_s)

    def _write(
        self, record: dict[str, Any] | None, revokes: list[int]
    ) -> tuple[dict[str, Any] | None, list[int]] | None:
        """One attempt; what is left to do when the store did not answer (None: all done)."""
        try:
            while revokes:
                self.jobs.store.revoke(revokes[0])
                revokes.pop(0)
            if record is not None:
                self.jobs.save(record)
        except ControlError as e:
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                log.warning("the control store does not take the job record (%s); retrying", e)
            return record, revokes
        if self._failing_since is not None:
            log.warning(
                "the control store took the job record again after %.1fs",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
        return None
