"""Node agents as the coordinator sees them: admitting them, their leases, their reports of the
processes they run, the loss and quarantine of a node, and the spare processes each node keeps.

* **hello**: an agent says hello with its node name, ``--nproc-per-node`` (must match the job's),
  spares, failure domain and data-plane address, and is welcomed or refused (one line why); a
  node joining a running job brings spares (and, in an elastic job, room to grow back); when the
  job starts is :mod:`nonstop.coordinator.job_start`'s;
* **leases**: an agent renews its lease every TTL/5; a node silent for a TTL -- or whose channel
  closes -- is **lost**: every process on it ends at once (its agent fenced itself first); in
  store mode leases live in the control store instead (:mod:`nonstop.coordinator.store_sync`),
  and a closed channel only marks the node disconnected until its lease there ends;
* **processes**: what an agent reports of them -- started (pid, device), exited -- is kept in the
  view; an exit goes to the failures;
* **quarantine** (:class:`~nonstop.policy.decisions.QuarantinePolicy`): a node whose processes
  fail too often is lost for good and refused if it rejoins;
* **spares**: each live node keeps its ``spares`` hot spares (never more than ``nproc + spares``
  processes in an elastic job).

Which decoded agent message goes to which operation is :mod:`nonstop.coordinator.routing`'s.
Threading: the coordinator's thread only. I/O through the executor.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.control.channel import Channel
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.failures import ProcessEnd
from nonstop.coordinator.view import NodeRecord, Role
from nonstop.policy.phase import JobPhase
from nonstop.protocol.agent import FencedMsg, LeaseOkMsg, NodeRefusedMsg, NodeWelcomeMsg

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import ExitSink, FetchesInFlight, NodeStore, RoundReset
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.policy.decisions import QuarantinePolicy
    from nonstop.protocol.agent import ExitMsg, FatalMsg, LeaseMsg, RegisteredMsg, SpawnedMsg

__all__ = ["AgentTerms", "NodeAgents"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AgentTerms:
    """The job's terms for every node's agent: what it must match and what its ``welcome`` says.

    ``replicas``: replicas per rank (0 when the job does not replicate); ``store_mode``: leases
    live in the control store; ``store``: its address, told to agents in store mode (else None);
    ``elastic``: a node joining a running job also brings room for ranks."""

    nproc_per_node: int
    lease_ttl_s: float
    num_slots: int
    replicas: int
    worker_env: dict[str, str]
    store_mode: bool
    store: str | None
    reconnect_s: float
    elastic: bool


class NodeAgents:
    """The job's nodes through their agents (see the module docstring).

    Peers: ``store`` (store mode's reattach and lease revocation), ``fetches`` (the restore
    fetches a node's loss leaves to their generation), ``rounds`` (replication, reset by a
    loss), and the failures, bound late (:meth:`bind`): they see this operation as their
    :class:`~nonstop.coordinator.peers.NodeHistory`, so they are built after it."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        terms: AgentTerms,
        quarantine: QuarantinePolicy,
        store: NodeStore,
        fetches: FetchesInFlight,
        rounds: RoundReset,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.terms = terms
        self.quarantine = quarantine
        self.store = store
        self.fetches = fetches
        self.rounds = rounds
        self.clock = clock
        self._exits: ExitSink | None = None

    def bind(self, *, exits: ExitSink) -> None:
        """Where the processes' ends go (the failures); before the first event is handled."""
        self._exits = exits

    @property
    def exits(self) -> ExitSink:
        assert self._exits is not None, "NodeAgents.bind(exits=...) was not called"
        return self._exits

    # -- hello ---------------------------------------------------------------------------------
    def on_open(self, chan: Channel) -> None:
        """An agent's hello on ``chan``: welcomed as a node of the job, reattached (store mode: a
        restarted coordinator), or refused with the reason and closed."""
        h = chan.hello
        name = str(h.get("node", ""))
        old = self.view.nodes.get(name)
        nproc = self.terms.nproc_per_node

        def refuse(why: str) -> None:
            self.events.emit(ev.Refused(peer=chan.peer, node=name, reason=why))
            self.io.tell(chan, NodeRefusedMsg(error=why).encode())
            self.io.close(chan)

        if not name:
            return refuse("hello without a node name")
        reattach = (
            self.terms.store_mode
            and h.get("resume") is not None
            and old is not None
            and old.alive
            and (old.chan is None or old.chan.closed)
        )
        if reattach:
            assert old is not None
            return self.store.reattach(old, chan)
        if old is not None and old.alive:
            return refuse(f"node {name} is already part of the job")
        if old is not None and old.quarantined:
            return refuse(f"node {name} is quarantined after {len(old.failure_times)} failures")
        if int(h.get("nproc", -1)) != nproc:
            return refuse(
                f"node {name} runs --nproc-per-node {h.get('nproc')} but the job has "
                f"{nproc} per node; use the same value on every node"
            )
        if self.view.phase.is_ending:
            return refuse("the job is ending")
        node = NodeRecord(
            name=name,
            chan=chan,
            nproc=int(h["nproc"]),
            spares=int(h.get("spares", 0)),
            domain=str(h.get("domain") or name),
            data_addr=str(h.get("data_addr", "")),
            last_lease=self.clock.monotonic(),
            failure_times=old.failure_times if old is not None else [],
            in_process=bool(h.get("in_process", False)),
            lease_id=int(h.get("lease_id", 0)),
            devices=None if h.get("devices") is None else int(h["devices"]),  # devices/inventory.py
        )
        chan.tag = ("node", name)
        self.view.nodes[name] = node
        self.io.answer(
            chan,
            NodeWelcomeMsg(
                job_id=self.view.job_id,
                lease_ttl_s=self.terms.lease_ttl_s,
                num_slots=self.terms.num_slots,
                replicas=self.terms.replicas,
                env=self.terms.worker_env,
                store=self.terms.store,
                reconnect_s=self.terms.reconnect_s,
            ).encode(),
        )
        self.events.emit(
            ev.NodeJoin(node=name, domain=node.domain, data=node.data_addr, rejoin=old is not None)
        )
        if self.view.phase is not JobPhase.STARTING:  # a node joining a running job brings capacity: spares
            # ... and, in an elastic job, room for ranks: its rank slots wait as spares too (to grow
            # back with, or to take the ranks of a recovery waiting for a spare)
            extra = node.nproc if self.terms.elastic else 0
            room = self.view.room_on(name)  # one device per process on a device node
            for _ in range(node.spares + extra if room is None else min(room, node.spares + extra)):
                self.io.spawn(name, Role.SPARE, None)

    def on_close(self, node: NodeRecord) -> None:
        """``node``'s agent's channel closed: the node is lost -- in store mode only when its lease
        in the store ends; until then it is disconnected and may reconnect."""
        if not node.alive:
            return
        if not self.terms.store_mode:
            self.lose_node(node, "its agent's connection closed")
        else:
            node.disconnected_at = self.clock.monotonic()
            self.events.emit(ev.NodeDisconnected(node=node.name))

    # -- what an agent reports ----------------------------------------------------------------------
    def on_lease(self, node: NodeRecord, m: LeaseMsg) -> None:
        """``node``'s agent renewed its lease: noted, and acknowledged."""
        node.last_lease = self.clock.monotonic()
        self.io.send_node(node, LeaseOkMsg(seq=m.seq).encode())

    def on_registered(self, node: NodeRecord, m: RegisteredMsg) -> None:
        """Store mode: ``node``'s lease in the store has this id (a quarantine revokes it)."""
        node.lease_id = m.lease_id

    def on_spawned(self, node: NodeRecord, m: SpawnedMsg) -> None:
        """A process ``node``'s agent started (or could not start): its pid and device."""
        w = self.view.workers.get(m.spawn_id)
        if w is not None and m.pid is not None:
            w.pid = m.pid
        if w is not None and m.device is not None:
            w.local_rank = m.device  # its LOCAL_RANK is its device, for life (devices/inventory.py)
        if m.error is not None:
            log.warning("node %s could not start process %d: %s", node.name, m.spawn_id, m.error)
        self.events.emit(ev.Spawned(spawn_id=m.spawn_id, pid=m.pid, node=node.name))

    def on_exited(self, m: ExitMsg) -> None:
        """A process its agent saw exit: no longer live; its end goes to the failures (once:
        an exit reported for a process already ended is ignored)."""
        w = self.view.workers.get(m.spawn_id)
        if w is not None and w.live:
            w.live = False
            self.exits.on_exit(ProcessEnd(sid=m.spawn_id, rc=m.rc, pid=m.pid, fault_at=m.fault_at))

    def on_fatal(self, node: NodeRecord, m: FatalMsg) -> None:
        """``node`` cannot play its part (its agent says why): the job fails."""
        self.life.fail(f"node {node.name}: {m.error}")

    # -- leases, loss, quarantine -------------------------------------------------------------------
    def check_leases(self, now: float) -> None:
        """A tick: lose every node (but an in-process one) whose lease was not renewed within
        its TTL. Store mode: leases live in the store (:meth:`StoreSync.tick
        <nonstop.coordinator.store_sync.StoreSync.tick>`)."""
        if self.terms.store_mode:
            return
        for node in list(self.view.nodes.values()):
            if node.alive and not node.in_process and now - node.last_lease > self.terms.lease_ttl_s:
                self.lose_node(node, f"lease expired ({now - node.last_lease:.2f}s without renewal)")

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None:
        """Every process on ``node`` is gone (its agent fenced them): fail its ranks at once.
        ``failure`` False: a planned departure (a drained node), not counted towards quarantine.
        ``quarantine``: its agent is told it is fenced (and, in store mode, its lease revoked)."""
        node.alive = False
        if failure:
            node.failure_times.append(self.clock.monotonic())
        if quarantine:
            node.quarantined = True
            if node.chan is not None:
                self.io.tell(node.chan, FencedMsg(error=why).encode())
            if self.terms.store_mode and node.lease_id:
                self.store.revoke(node)  # in store mode its agent fences when its lease is gone
        if node.chan is not None:
            self.io.close(node.chan)
        self.events.emit(ev.NodeLost(node=node.name, reason=why, quarantined=quarantine))
        for sid in sorted(s for s, w in self.view.workers.items() if w.live and w.node == node.name):
            w = self.view.workers[sid]
            w.live = False
            if w.chan is not None:
                self.io.close(w.chan)
            self.exits.on_exit(
                ProcessEnd(sid=sid, rc=-signal.SIGKILL, pid=None, fault_at=None, node_lost=why)
            )
        self.io.node_lost(node.name, keep=set(self.fetches.waiting_fetch))  # fetches end with the generation
        self.rounds.reset()  # its holders or senders may be gone: start over

    def node_failed(self, name: str) -> None:
        """A process failure on ``name``: quarantine the node if it fails too often."""
        node = self.view.nodes.get(name)
        if node is None or not node.alive:
            return
        now = self.clock.monotonic()
        node.failure_times.append(now)
        others = len([n for n in self.view.alive_nodes() if n != name])
        if self.quarantine.should_quarantine(node.failure_times, now=now, others_usable=others):
            self.lose_node(
                node,
                f"{len(node.failure_times)} failures within {self.quarantine.window_s:g}s: quarantined",
                quarantine=True,
            )

    # -- spares ------------------------------------------------------------------------------------
    def replenish_spares(self) -> None:
        """Every live node not draining gets back its spares (within its room: ``nproc + spares``
        processes in an elastic job, one per free device on a device node)."""
        for name in self.view.alive_nodes():
            node = self.view.nodes[name]
            if node.draining:
                continue
            have = self.view.spares_on(name)
            want = node.spares - have
            if self.terms.elastic:  # a node has room for nproc + spares processes, no more
                ranks_here = sum(1 for r in self.view.members if self.view.rank_node.get(r) == name)
                want = min(want, node.nproc + node.spares - ranks_here - have)
            room = self.view.room_on(name)
            if room is not None:  # a device node: one free device per new process
                want = min(want, room)
            for _ in range(want):
                self.io.spawn(name, Role.SPARE, None)
