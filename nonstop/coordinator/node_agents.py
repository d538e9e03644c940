"""Node agents as the coordinator sees them: joining, leases, loss, quarantine, and the spare
processes each node keeps.

* **join**: an agent says hello with its node name, ``--nproc-per-node`` (must match the job's),
  spares, failure domain and data-plane address; the job starts once ``nnodes`` joined (within
  ``join_timeout_s``); a node joining a running job brings spares (and, in an elastic job, room
  to grow back);
* **leases**: an agent renews its lease every TTL/5; a node silent for a TTL -- or whose channel
  closes -- is **lost**: every process on it ends at once (its agent fenced itself first); in
  store mode leases live in the control store instead (:mod:`nonstop.coordinator.store_sync`);
* **quarantine** (:class:`~nonstop.policy.decisions.QuarantinePolicy`): a node whose processes
  fail too often is lost for good and refused if it rejoins;
* **spares**: each live node keeps its ``spares`` hot spares (never more than ``nproc + spares``
  processes in an elastic job).

Threading: the coordinator's thread only.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.control.channel import Channel, Message
from nonstop.coordinator.failures import Exit
from nonstop.coordinator.view import NodeRecord, Role
from nonstop.errors import ControlError
from nonstop.policy.phase import JobPhase
from nonstop.protocol import wire
from nonstop.protocol.wire import decode_agent

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["NodeAgents"]

log = logging.getLogger(__name__)


class NodeAgents:
    """The job's nodes through their agents (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self.started_at = time.monotonic()  # node 0 waits join_timeout_s for the others from here
        self.starting = False  # the nodes joined: a resumed checkpoint is being installed

    def check_join(self) -> None:
        if self.c.view.phase is not JobPhase.STARTING or self.c.view.members or self.starting:
            return
        alive = self.c.view.alive_nodes()
        if len(alive) >= self.c.config.nnodes:
            self.start_job(alive[: self.c.config.nnodes])
        elif time.monotonic() - self.started_at > self.c.config.join_timeout_s:
            self.c.fail(
                f"only {len(alive)} of {self.c.config.nnodes} nodes joined within "
                f"{self.c.config.join_timeout_s:g}s; start `nonstop run --node-rank I` on every node"
            )

    def start_job(self, nodes: list[str]) -> None:
        self.c.events.emit(ev.NodesJoined(nodes=nodes))
        if self.c.gens.initial_step is not None:
            placement = {
                n: list(range(i * self.c.config.nproc_per_node, (i + 1) * self.c.config.nproc_per_node))
                for i, n in enumerate(nodes)
            }
            url = self.c.config.persist.resume or self.c.durable_url
            step = self.c.gens.initial_step
            if url is None:
                self.c.fail(f"could not install the resumed checkpoint step {step}: no durable tier")
                return
            if self.c.config.mesh is not None:
                from nonstop.snapshot.durable import DurableStore

                written = DurableStore(url).world_size_at(step)
                if written != self.c.config.world_size:
                    # every new rank cuts its shards out of all the old ranks' (its worker reads
                    # them from the durable tier once its model is built on the new mesh)
                    self.c.gens.reshard = {"url": url, "step": step, "world": written}
                    self._spawn_all(nodes)
                    return
            self.starting = True

            def installed(got: int | None) -> None:
                if got is None:
                    self.c.fail(f"could not install the resumed checkpoint step {step} on every node")
                else:
                    self._spawn_all(nodes)

            self.c.sources.install_durable([step], placement, url, installed)
            return
        self._spawn_all(nodes)

    def _spawn_all(self, nodes: list[str]) -> None:
        """The first processes: every node's ranks and its spares."""
        for i, name in enumerate(nodes):
            for k in range(self.c.config.nproc_per_node):
                self.c.io.spawn(name, Role.WORKER, i * self.c.config.nproc_per_node + k)
            for _ in range(self.c.view.nodes[name].spares):
                self.c.io.spawn(name, Role.SPARE, None)

    def on_open(self, chan: Channel) -> None:
        h = chan.hello
        name = str(h.get("node", ""))
        old = self.c.view.nodes.get(name)

        def refuse(why: str) -> None:
            self.c.events.emit(ev.Refused(peer=chan.peer, node=name, reason=why))
            try:
                chan.send({"t": "refused", "error": why})
            except ControlError:
                pass
            chan.close()

        if not name:
            return refuse("hello without a node name")
        reattach = (
            self.c.store.jobs is not None
            and h.get("resume") is not None
            and old is not None
            and old.alive
            and (old.chan is None or old.chan.closed)
        )
        if reattach:
            assert old is not None
            return self.c.store.reattach(old, chan)
        if old is not None and old.alive:
            return refuse(f"node {name} is already part of the job")
        if old is not None and old.quarantined:
            return refuse(f"node {name} is quarantined after {len(old.failure_times)} failures")
        if int(h.get("nproc", -1)) != self.c.config.nproc_per_node:
            return refuse(
                f"node {name} runs --nproc-per-node {h.get('nproc')} but the job has "
                f"{self.c.config.nproc_per_node} per node; use the same value on every node"
            )
        if self.c.view.phase.is_ending:
            return refuse("the job is ending")
        node = NodeRecord(
            name=name,
            chan=chan,
            nproc=int(h["nproc"]),
            spares=int(h.get("spares", 0)),
            domain=str(h.get("domain") or name),
            data_addr=str(h.get("data_addr", "")),
            last_lease=time.monotonic(),
            failure_times=old.failure_times if old is not None else [],
            in_process=bool(h.get("in_process", False)),
            lease_id=int(h.get("lease_id", 0)),
            devices=None if h.get("devices") is None else int(h["devices"]),  # devices/inventory.py
        )
        chan.tag = ("node", name)
        self.c.view.nodes[name] = node
        chan.send(
            {
                "t": "welcome",
                "job_id": self.c.job_id,
                "lease_ttl_s": self.c.config.detection.lease_ttl_s,
                "num_slots": self.c.num_slots,
                "replicas": self.c.config.replication.replicas if self.c.replication_on else 0,
                "env": self.c.worker_env,
                "store": self.c.config.control.store if self.c.store.jobs is not None else None,
                "reconnect_s": self.c.config.control.reconnect_s,
            }
        )
        self.c.events.emit(
            ev.NodeJoin(node=name, domain=node.domain, data=node.data_addr, rejoin=old is not None)
        )
        if self.c.view.phase is not JobPhase.STARTING:  # a node joining a running job brings capacity: spares
            # ... and, in an elastic job, room for ranks: its rank slots wait as spares too (to grow
            # back with, or to take the ranks of a recovery waiting for a spare)
            extra = node.nproc if self.c.elastic.enabled else 0
            room = self.c.view.room_on(name)  # one device per process on a device node
            for _ in range(node.spares + extra if room is None else min(room, node.spares + extra)):
                self.c.io.spawn(name, Role.SPARE, None)

    def on_message(self, node: NodeRecord, msg: Message) -> None:
        """One message from ``node``'s agent, decoded (:func:`~nonstop.protocol.wire.decode_agent`)
        and routed to the operation that owns it."""
        m = decode_agent(msg)
        if isinstance(m, wire.Lease):
            node.last_lease = time.monotonic()
            self.c.io.send_node(node, {"t": "lease_ok", "seq": m.seq})
        elif isinstance(m, wire.Exit):
            w = self.c.view.workers.get(m.spawn_id)
            if w is not None and w.live:
                w.live = False
                self.c.failures.on_exit(Exit(sid=m.spawn_id, rc=m.rc, pid=m.pid, fault_at=m.fault_at))
        elif isinstance(m, wire.Judged):
            self.c.failures.on_judged(m.spawn_id, hung=m.hung, detail=m.detail)
        elif isinstance(m, wire.Spawned):
            w = self.c.view.workers.get(m.spawn_id)
            if w is not None and m.pid is not None:
                w.pid = m.pid
            if w is not None and m.device is not None:
                w.local_rank = m.device  # its LOCAL_RANK is its device, for life (devices/inventory.py)
            if m.error is not None:
                log.warning("node %s could not start process %d: %s", node.name, m.spawn_id, m.error)
            self.c.events.emit(ev.Spawned(spawn_id=m.spawn_id, pid=m.pid, node=node.name))
        elif isinstance(m, wire.Inventory | wire.Installed):
            self.c.io.replies[m.id] = m
        elif isinstance(m, wire.Fetched):
            if self.c.swaps.owns(m.id):  # a swap's prepare or catch-up fetch
                self.c.swaps.on_fetched(m)
            else:
                self.c.sources.on_fetched(node, m)
        elif isinstance(m, wire.Replicated):
            self.c.replication.on_replicated(node.name, m)
        elif isinstance(m, wire.Preempt):
            self.c.swaps.on_preempt(node, m.grace_s)
        elif isinstance(m, wire.Registered):
            node.lease_id = m.lease_id
        elif isinstance(m, wire.Fatal):
            self.c.fail(f"node {node.name}: {m.error}")
        elif isinstance(m, wire.HealthReport):  # issue 21: its probes' verdict (agent/probes.py)
            self.c.health.on_probe(node.name, m.verdict, probe=m.probe, detail=m.detail)
        elif isinstance(m, wire.Raw) and self.c.rounds is not None:  # a persist round's answer
            self.c.rounds.on_reply(node.name, dict(m.msg))

    def check_leases(self) -> None:
        if self.c.store.jobs is not None:
            return  # store mode: leases live in the store (_store_tick)
        now = time.monotonic()
        for node in list(self.c.view.nodes.values()):
            if (
                node.alive
                and not node.in_process
                and now - node.last_lease > self.c.config.detection.lease_ttl_s
            ):
                self.lose_node(node, f"lease expired ({now - node.last_lease:.2f}s without renewal)")

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None:
        """Every process on ``node`` is gone (its agent fenced them): fail its ranks at once.
        ``failure`` False: a planned departure (a drained node), not counted towards quarantine."""
        node.alive = False
        if failure:
            node.failure_times.append(time.monotonic())
        if quarantine:
            node.quarantined = True
            if node.chan is not None:
                try:
                    node.chan.send({"t": "fenced", "error": why})
                except ControlError:
                    pass
            if self.c.store.jobs is not None and node.lease_id:
                self.c.store.revoke(node)  # in store mode its agent fences when its lease is gone
        if node.chan is not None:
            node.chan.close()
        self.c.events.emit(ev.NodeLost(node=node.name, reason=why, quarantined=quarantine))
        for sid in sorted(s for s, w in self.c.view.workers.items() if w.live and w.node == node.name):
            w = self.c.view.workers[sid]
            w.live = False
            if w.chan is not None:
                w.chan.close()
            self.c.failures.on_exit(Exit(sid=sid, rc=-signal.SIGKILL, pid=None, fault_at=None, node_lost=why))
        self.c.io.node_lost(
            node.name, keep=set(self.c.sources.waiting_fetch)
        )  # fetches end with the generation
        self.c.replication.reset()  # its holders or senders may be gone: start over

    def node_failed(self, name: str) -> None:
        """A process failure on ``name``: quarantine the node if it fails too often."""
        node = self.c.view.nodes.get(name)
        if node is None or not node.alive:
            return
        now = time.monotonic()
        node.failure_times.append(now)
        others = len([n for n in self.c.view.alive_nodes() if n != name])
        if self.c.quarantine.should_quarantine(node.failure_times, now=now, others_usable=others):
            self.lose_node(
                node,
                f"{len(node.failure_times)} failures within {self.c.quarantine.window_s:g}s: quarantined",
                quarantine=True,
            )

    def replenish_spares(self) -> None:
        for name in self.c.view.alive_nodes():
            node = self.c.view.nodes[name]
            if node.draining:
                continue
            have = self.c.view.spares_on(name)
            want = node.spares - have
            if self.c.elastic.enabled:  # a node has room for nproc + spares processes, no more
                ranks_here = sum(1 for r in self.c.view.members if self.c.view.rank_node.get(r) == name)
                want = min(want, node.nproc + node.spares - ranks_here - have)
            room = self.c.view.room_on(name)
            if room is not None:  # a device node: one free device per new process
                want = min(want, room)
            for _ in range(want):
                self.c.io.spawn(name, Role.SPARE, None)
