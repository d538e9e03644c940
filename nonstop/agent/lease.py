"""Store mode (``--store etcd://``): a node agent's liveness key in the control store, held with a
lease of its own (:meth:`~nonstop.control.jobstore.JobStore.register_node`).

The node may go on playing its ranks while the store **or** the coordinator hears it;
:meth:`NodeLease.judge` says when it must fence: neither has heard it for ``FENCE_AT`` of the
TTL. Either one then still waits a quarter TTL before it acts on the loss: the store deletes the
key a whole TTL after the last refresh it got, and the coordinator loses a node whose key is gone
only once it has not heard the node for a whole TTL either (coordinator/store_sync.py). A lease that
lapsed while the coordinator hears the node (a store stall, or the node cut off from the store)
is replaced by a new one, registered on a thread of its own.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nonstop.control.channel import Message
from nonstop.control.jobstore import JobStore
from nonstop.control.store import LeaseKeeper, open_store
from nonstop.errors import ControlError
from nonstop.protocol.agent import RegisteredMsg

if TYPE_CHECKING:
    from nonstop.agent.processes import Agent

__all__ = ["FENCE_AT", "NodeLease", "fence_node"]

log = logging.getLogger(__name__)

FENCE_AT = 0.75  # of the lease TTL: the rest is the margin to kill and reap the node's processes
# a lapsed lease is replaced only while the coordinator acknowledged this node within this part
# of the TTL (it loses a lapsed node it has not heard for a whole TTL)
RENEW_WHILE_HEARD = 0.5
RENEW_RETRY_S = 0.2


class NodeLease:
    """One node's key and lease in the store (module docstring). ``send`` tells the coordinator
    of each lease registered (``registered {lease_id}``)."""

    def __init__(
        self, jobs: JobStore, *, node: str, data_addr: str, ttl: float, send: Callable[[Message], None]
    ):
        self.jobs = jobs
        self.node = node
        self.data_addr = data_addr
        self.ttl = ttl
        self._send = send
        self.keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()  # swapping the keeper (a new lease) vs closing
        self._closing = threading.Event()
        self._renewing: threading.Thread | None = None

    @classmethod
    def open(
        cls, url: str, *, secret: bytes, job_id: str, node: str, data_addr: str, ttl: float,
        send: Callable[[Message], None],
    ) -> NodeLease:  # fmt: skip
        """Connect to the store at ``url`` and register the node's key."""
        lease = cls(JobStore(open_store(url, secret=secret.decode()), job_id), node=node,
                    data_addr=data_addr, ttl=ttl, send=send)  # fmt: skip
        lease.keeper = lease.jobs.register_node(node, data_addr, ttl)
        send(RegisteredMsg(lease_id=lease.keeper.lease.id).encode())
        return lease

    @property
    def lease_id(self) -> int:
        return self.keeper.lease.id if self.keeper is not None else 0

    def judge(self, now: float, unacked: float, ttl: float) -> str | None:
        """Why the node must fence now (None: it may go on); ``unacked``: seconds since the newest
        lease renewal the coordinator acknowledged was sent, ``ttl`` the channel lease's TTL.
        Starts replacing a lapsed lease while the coordinator hears the node."""
        keeper = self.keeper
        assert keeper is not None
        store_silent = now - keeper.last_ok_sent
        if not keeper.lost.is_set() and store_silent <= FENCE_AT * keeper.lease.ttl:
            return None
        if unacked > FENCE_AT * ttl:
            why = (
                keeper.reason or f"no lease refresh got through to the control store for {store_silent:.2f}s"
            )
            return f"{why}, and the coordinator acknowledged nothing for {unacked:.2f}s"
        renewing = self._renewing is not None and self._renewing.is_alive()
        if keeper.lost.is_set() and unacked <= RENEW_WHILE_HEARD * ttl and not renewing:
            self._renewing = threading.Thread(target=self._renew, name="nonstop-lease-renew", daemon=True)
            self._renewing.start()
        return None

    def _renew(self) -> None:
        """Register a new lease, retrying until the store answers or :meth:`close`."""
        while not self._closing.is_set():
            try:
                keeper = self.jobs.register_node(self.node, self.data_addr, self.ttl)
            except ControlError as e:
                log.warning("node %s: registering a new lease: %s; retrying", self.node, e)
                self._closing.wait(RENEW_RETRY_S)
                continue
            with self._lock:
                if self._closing.is_set():
                    keeper.stop(revoke=True)
                    return
                self.keeper = keeper
            log.warning("node %s: its lease had lapsed; registered a new one", self.node)
            self._send(RegisteredMsg(lease_id=keeper.lease.id).encode())
            return

    def close(self, *, revoke: bool) -> None:
        """Stop refreshing (``revoke``: end the lease at once) and close the store connection."""
        with self._lock:
            self._closing.set()
            keeper = self.keeper
        if keeper is not None:
            try:
                keeper.stop(revoke=revoke)
            except ControlError:
                pass
        self.jobs.store.close()


def fence_node(agent: Agent | None, *, node: str, job_dir: Path, why: str) -> None:
    """Stop playing any rank: SIGKILL every process of the node, wait until they are gone, then
    record it in ``<job_dir>/fenced-node-<node>.json`` (when it decided, when every process was
    sent SIGKILL, when they were all gone, why, which pids)."""
    at = time.time()
    log.error("node %s fenced: %s; killing its processes", node, why)
    pids: list[int] = []
    if agent is not None:
        for sid in list(agent.procs):
            pid = agent.pid(sid)
            if pid is not None:
                pids.append(pid)
            agent.kill(sid, signal.SIGKILL)
    # once SIGKILL is sent a process runs none of its code again; reaping it (the kernel freeing a
    # large process's memory) may take longer than the lease's margin on a loaded machine (0.82 s
    # seen): ``killed_at`` is when the node stopped playing its ranks
    killed_at = time.time()
    if agent is not None:
        agent.wait_all(5.0)
    record = {"node": node, "at": at, "killed_at": killed_at, "dead_at": time.time(), "why": why,
              "killed_pids": pids}  # fmt: skip
    try:
        (job_dir / f"fenced-node-{node}.json").write_text(json.dumps(record) + "\n")
    except OSError as e:
        log.warning("could not record the fencing: %s", e)
