"""The coordinator: nodes, membership, generations, leases, detection, recovery, replication.

Threading: one thread (the caller of :meth:`Coordinator.run`) owns all state.
The control server's threads only put events on a queue.

Peers (all on authenticated channels):

* **node agents** (``role: agent``; :mod:`nonstop.runtime.node`): one per node.
  They hold a lease, renewed every TTL/5; a node whose lease expires, or whose
  agent channel closes, is **lost**: every rank on it fails at once, and the
  agent has already killed its processes (it fences itself first, see there).
* **workers and spares**: heartbeats, step reports, rendezvous (``kv``).
* **clients** (``nonstop persist``).

Fencing: every message from a worker carries the generation it was sent in;
``restored``/``ready``/``step``/``done``/``fault``/``kv`` from an older
generation, from a process that is no longer a member, or from a lost node are
ignored or refused, so two processes never play one rank in one generation.

Recovery planning (see :func:`~nonstop.runtime.policy.choose_replacements`):
the coordinator asks every live node what its memory holds (its own ranks'
slots and the replicas it keeps), picks the newest step every rank has
somewhere, places failed ranks (spare on the node holding the data first),
has nodes fetch what they lack from a peer, and falls back to the durable
tier when memory has no common step.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nonstop.config import JobConfig
from nonstop.control.channel import Channel, ControlServer, Message
from nonstop.control.rdzv import KeyValueTable
from nonstop.errors import ControlError, NonstopError
from nonstop.faults import fired_at
from nonstop.runtime.detector import FailureDetector
from nonstop.runtime.elastic import (
    ElasticPolicy,
    Resize,
    assign_shards,
    resume_sources,
)
from nonstop.runtime.eventlog import EventLog
from nonstop.runtime.executor import Executor
from nonstop.runtime.jobstore import JobStore
from nonstop.runtime.migration import (
    Migration,
    MigrationPhase,
    Transfer,
    boundary_step,
    catch_up_to,
    choose_joiner,
    choose_target,
    swap_as_delta,
)
from nonstop.runtime.persistence import ClusterPersister
from nonstop.runtime.phase import Busy, JobPhase, Op, legal, may_start
from nonstop.runtime.planning import Inventory, PlanAction, Shrink, plan_generation
from nonstop.runtime.policy import (
    FailureKind,
    QuarantinePolicy,
    classify_exit,
    describe_exit,
)
from nonstop.runtime.recovery import Failure, Reconfiguration, Stage
from nonstop.runtime.replication import ReplicationRounds
from nonstop.runtime.storesync import StoreSync
from nonstop.runtime.view import JobView, NodeRecord, Role, WorkerRecord
from nonstop.snapshot.persist import Persister

__all__ = ["Coordinator", "JobResult", "JobState", "NodeRecord"]

log = logging.getLogger(__name__)

TICK_S = 0.005
PLAN_WAIT_S = 3.0  # longest planning waits for the nodes' inventories
GROW_RETRY_S = 2.0  # an aborted grow (e.g. its prepare step was overwritten) is tried again after this


JobState = JobPhase  # the name the launcher, the CLI and the tests know


@dataclass
class JobResult:
    state: JobState
    generation: int
    final_step: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    median_step_s: float | None = None
    replication: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Exit:
    sid: int
    rc: int
    pid: int | None
    fault_at: float | None
    node_lost: str | None = None  # why, if the whole node was lost


class Coordinator:
    def __init__(
        self,
        *,
        config: JobConfig,
        server: ControlServer,
        events: EventLog,
        job_id: str,
        worker_env: dict[str, str],
        persister: Persister | ClusterPersister | None = None,
        durable_url: str | None = None,
        initial_step: int | None = None,
        jobs: JobStore | None = None,
    ) -> None:
        self.config = config
        self.job_id = job_id
        self.worker_env = worker_env
        # one node: a Persister over the node's memory; several: rounds across the nodes
        self.persister = persister
        self.rounds = persister if isinstance(persister, ClusterPersister) else None
        self.durable_url = durable_url
        self.initial_step = initial_step  # resumed from the durable tier: install this first
        self.server = server
        self.events = events
        self.view = JobView(job_id=job_id, world_size=config.world_size)
        self.io = Executor(self.view, events)
        if self.rounds is not None:
            self.rounds.attach(self.io.send_to)
        # elastic (runtime/elastic.py): the data-parallel shards stay those of the full-size job
        self.num_shards = config.world_size * config.shards_per_rank  # micro-batches of a step
        self.elastic = ElasticPolicy(
            full_world_size=config.world_size, min_world_size=config.min_world, wait_s=config.elastic_wait_s
        )
        self._replan_at: float | None = None  # elastic wait: re-plan then (or when a spare appears)
        self.resize: Resize | None = None  # a grow in progress
        self._grow_retry_at = 0.0  # after an aborted grow, wait before trying again
        # replicating: the held replicated step, the one a round is sending, the newest, one to write
        self.num_slots = 4 if config.replicas > 0 and config.nnodes > 1 else 2
        self.reconf: Reconfiguration | None = None
        self.detector = FailureDetector(config.detector)
        self.quarantine = QuarantinePolicy(
            max_failures=config.quarantine_failures, window_s=config.quarantine_window_s
        )
        self.error: str | None = None
        self.clients: dict[int, Channel] = {}
        self.client_tickets: list[tuple[Channel, int]] = []
        self.kv = KeyValueTable()
        self._exits: list[_Exit] = []
        self._waiting_fetch: dict[int, tuple[int, int]] = {}  # request id -> (rank, generation)
        # fetches asked for before their generation (a swap's boundary): request id -> (rank, ok),
        # ok None while in flight; the generation adopts them (``_fetch_for(early=...)``)
        self._early: dict[int, tuple[int, bool | None]] = {}
        # a planning interrupted by more failures: (failures, replans, replacements) to merge
        self._deferred: tuple[list[Failure], int, dict[int, str]] | None = None
        self.replication = ReplicationRounds(
            view=self.view, io=self.io, events=events, replicas=config.replicas
        )
        self._started_at = time.monotonic()
        # store mode (--store etcd://): state saved in and restored from the control store
        self.store = StoreSync(self, jobs)
        # live migration (runtime/migration.py): the one in progress, the queue, who asked
        self.migration: Migration | None = None
        # (rank, target or None, reason, when asked): waits while no spare is ready (they may be starting)
        self._migrate_queue: list[tuple[int, str | None, str, float]] = []
        self._migrate_clients: dict[int, list[Channel]] = {}  # rank -> clients waiting for it
        self._step_at: dict[int, tuple[int, float]] = {}  # rank -> (step, when its report arrived)
        self.migrations_done: list[dict[str, Any]] = []

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def state(self) -> JobPhase:
        return self.view.phase

    @property
    def generation(self) -> int:
        return self.view.generation

    @property
    def replication_on(self) -> bool:
        return self.config.replicas > 0 and self.config.nnodes > 1

    def run(self, stop: threading.Event) -> JobResult:
        if self.store.jobs is not None:
            self.store.open()
        while self.view.phase not in (JobState.DONE, JobState.FAILED):
            if stop.is_set():
                self._fail("stopped by signal")
                break
            self.tick(TICK_S)
        return self._close()

    def tick(self, wait_s: float = 0.0) -> None:
        """One turn of the loop: handle the events that arrived (waiting up to ``wait_s`` for
        the first), then every periodic check. Tests drive a coordinator through this."""
        self._pump_events(wait_s)
        self._check_leases()
        self.store.tick()
        self._check_join()
        self._handle_exits()
        self._pump_events(0)
        self._detect()
        self._check_timeouts()
        if self.replication_on and self._may_start(Op.REPLICATE):
            self.replication.maybe_start(now=time.monotonic())
        self._persist()
        self._migrate_tick()
        self._elastic_tick()
        self._answer_clients()

    def _close(self) -> JobResult:
        """The job ended: persist the last step, release the nodes, the result."""
        self._final_persist()
        for node in self.view.nodes.values():
            self.io.send_node(node, {"t": "finish", "failed": self.view.phase is JobState.FAILED})
        self.store.close()
        final = min(self.view.latest_step.values()) if self.view.latest_step else 0
        return JobResult(
            state=self.view.phase,
            generation=self.view.generation,
            final_step=final,
            failures=self.view.reports,
            error=self.error,
            median_step_s=self.detector.median_step_s,
            replication=self.replication_stats(),
        )

    def replication_stats(self) -> dict[str, Any]:
        return self.replication.stats()

    def _check_join(self) -> None:
        if self.view.phase is not JobState.STARTING or self.view.members:
            return
        alive = self._alive_nodes()
        if len(alive) >= self.config.nnodes:
            self._start_job(alive[: self.config.nnodes])
        elif time.monotonic() - self._started_at > self.config.join_timeout_s:
            self._fail(
                f"only {len(alive)} of {self.config.nnodes} nodes joined within "
                f"{self.config.join_timeout_s:g}s; start `nonstop run --node-rank I` on every node"
            )

    def _start_job(self, nodes: list[str]) -> None:
        self.events.emit("nodes_joined", nodes=nodes)
        if self.initial_step is not None:
            placement = {
                n: list(range(i * self.config.nproc_per_node, (i + 1) * self.config.nproc_per_node))
                for i, n in enumerate(nodes)
            }
            url = self.config.resume or self.durable_url
            if url is None or not self._install_durable(self.initial_step, placement, url):
                self._fail(f"could not install the resumed checkpoint step {self.initial_step} on every node")
                return
        for i, name in enumerate(nodes):
            for k in range(self.config.nproc_per_node):
                self.io.spawn(name, Role.WORKER, i * self.config.nproc_per_node + k)
            for _ in range(self.view.nodes[name].spares):
                self.io.spawn(name, Role.SPARE, None)

    def _alive_nodes(self) -> list[str]:
        return self.view.alive_nodes()

    def _set_state(self, new: JobPhase) -> None:
        assert legal(self.view.phase, new), f"the job cannot go from {self.view.phase} to {new}"
        self.view.phase = new

    def _busy(self) -> set[Busy]:
        """What is under way now that may block a background operation (``phase.may_start``)."""
        busy: set[Busy] = set()
        m, z = self.migration, self.resize
        if self.reconf is not None:
            busy.add(Busy.RESUMING)
        if (m is not None and m.phase is not MigrationPhase.PREPARE) or (
            z is not None and z.boundary is not None
        ):
            busy.add(Busy.SWAPPING)
        if m is not None or self._migrate_queue:
            busy.add(Busy.MIGRATING)
        if z is not None:
            busy.add(Busy.GROWING)
        if self.store.awaiting:
            busy.add(Busy.RESYNCING)
        if self.view.done_ranks:
            busy.add(Busy.ENDING)
        return busy

    def _may_start(self, op: Op) -> bool:
        return may_start(op, self.view.phase, self._busy())

    def _fail(self, error: str) -> None:
        if self.view.phase.is_terminal:
            return  # the first cause stands
        self.error = error
        self._set_state(JobState.FAILED)
        self.events.emit("job_failed", error=error)
        for w in self.view.workers.values():
            self.io.send(w, {"t": "abort", "error": error})

    # -- events ------------------------------------------------------------------------------
    def _pump_events(self, timeout: float) -> None:
        try:
            kind, chan, msg = self.server.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._dispatch(kind, chan, msg)
            try:
                kind, chan, msg = self.server.events.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, kind: str, chan: Channel, msg: Message | None) -> None:
        """Handle one event from the control server. A message its (authenticated) sender built
        wrong -- a missing or mistyped field -- fails that sender only: a client gets an error, a
        worker's channel is closed (the detector then recovers its rank), an agent's node is lost.
        The coordinator goes on either way."""
        try:
            self._on_event(kind, chan, msg)
        except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
            self._protocol_error(chan, msg, e)

    def _protocol_error(self, chan: Channel, msg: Message | None, e: Exception) -> None:
        what = f"{type(e).__name__}: {e}"
        t = msg.get("t") if isinstance(msg, dict) else None
        log.warning("malformed %r message from %s: %s", t, chan.peer, what, exc_info=True)
        tag = chan.tag
        who: dict[str, Any] = {"peer": chan.peer, "message": t, "error": what}
        if isinstance(tag, tuple) and tag[0] == "node" and tag[1] in self.view.nodes:
            who["node"] = tag[1]
            self.events.emit("protocol_error", **who)
            node = self.view.nodes[tag[1]]
            if node.alive and node.chan is chan:
                self._lose_node(node, f"its agent broke the protocol ({what})")
            return
        if isinstance(tag, int) and tag in self.view.workers:
            w = self.view.workers[tag]
            who.update(spawn_id=tag, rank=w.rank)
            self.events.emit("protocol_error", **who)
            if w.chan is chan:  # the detector fails it once the channel has been closed a moment
                w.chan_closed_at = time.monotonic()
            chan.close()
            return
        self.events.emit("protocol_error", **who)
        if isinstance(tag, tuple) and tag[0] == "client":
            try:
                chan.send({"t": "error", "error": f"malformed request: {what}"})
            except ControlError:
                pass
        chan.close()

    def _on_event(self, kind: str, chan: Channel, msg: Message | None) -> None:
        role = chan.hello.get("role")
        if kind == "open" and role == "client":
            chan.tag = ("client", len(self.clients))
            self.clients[len(self.clients)] = chan
            self.events.emit("client", peer=chan.peer)
            return
        if kind == "open" and role == "agent":
            self._on_agent_open(chan)
            return
        tag = chan.tag
        if isinstance(tag, tuple) and tag[0] == "client":
            if kind == "msg" and msg is not None:
                self._on_client(chan, msg)
            return
        if isinstance(tag, tuple) and tag[0] == "node":
            node = self.view.nodes.get(tag[1])
            if node is None or node.chan is not chan:
                return
            if kind == "msg" and msg is not None:
                self._on_agent_message(node, msg)
            elif kind == "close" and node.alive:
                if self.store.jobs is None:
                    self._lose_node(node, "its agent's connection closed")
                else:  # lost when its lease in the store ends; until then it may reconnect
                    node.disconnected_at = time.monotonic()
                    self.events.emit("node_disconnected", node=node.name)
            return
        if kind == "open":
            sid = int(chan.hello.get("spawn_id", -1))
            w = self.view.workers.get(sid)
            node = self.view.nodes.get(self.view.node_of(sid))
            resume = chan.hello.get("resume")
            reconnect = resume is not None and w is not None and (w.chan is None or w.chan.closed)
            if w is None or (w.chan is not None and not reconnect) or node is None or not node.alive:
                self.events.emit(
                    "refused", peer=chan.peer, reason=f"unknown, duplicate or fenced spawn id {sid}"
                )
                chan.close()
                return
            chan.tag = sid
            w.chan = chan
            w.last_hb = time.monotonic()
            self.events.emit("connect", spawn_id=sid, role=w.role, rank=w.rank, resumed=resume is not None)
            if isinstance(resume, dict):
                self.store.on_worker_resumed(w, resume)
            else:
                self._on_connect(w)
        elif kind == "msg" and msg is not None:
            w = self.view.workers.get(chan.tag)
            if w is not None and w.chan is chan:
                self._on_message(w, msg)
        elif kind == "close":
            w = self.view.workers.get(chan.tag)
            if w is not None and w.chan is chan:
                w.chan_closed_at = time.monotonic()

    # -- node agents -----------------------------------------------------------------------------
    def _on_agent_open(self, chan: Channel) -> None:
        h = chan.hello
        name = str(h.get("node", ""))
        old = self.view.nodes.get(name)

        def refuse(why: str) -> None:
            self.events.emit("refused", peer=chan.peer, node=name, reason=why)
            try:
                chan.send({"t": "refused", "error": why})
            except ControlError:
                pass
            chan.close()

        if not name:
            return refuse("hello without a node name")
        reattach = (
            self.store.jobs is not None
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
        if int(h.get("nproc", -1)) != self.config.nproc_per_node:
            return refuse(
                f"node {name} runs --nproc-per-node {h.get('nproc')} but the job has "
                f"{self.config.nproc_per_node} per node; use the same value on every node"
            )
        if self.view.phase in (JobState.FINISHING, JobState.DONE, JobState.FAILED):
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
        )
        chan.tag = ("node", name)
        self.view.nodes[name] = node
        chan.send(
            {
                "t": "welcome",
                "job_id": self.job_id,
                "lease_ttl_s": self.config.lease_ttl_s,
                "num_slots": self.num_slots,
                "env": self.worker_env,
                "store": self.config.store if self.store.jobs is not None else None,
                "reconnect_s": self.config.reconnect_s,
            }
        )
        self.events.emit(
            "node_join", node=name, domain=node.domain, data=node.data_addr, rejoin=old is not None
        )
        if self.view.phase is not JobState.STARTING:  # a node joining a running job brings capacity: spares
            # ... and, in an elastic job, room for ranks: its rank slots wait as spares too (to grow
            # back with, or to take the ranks of a recovery waiting for a spare)
            extra = node.nproc if self.elastic.enabled else 0
            for _ in range(node.spares + extra):
                self.io.spawn(name, Role.SPARE, None)

    def _on_agent_message(self, node: NodeRecord, msg: Message) -> None:
        t = msg.get("t")
        if t == "lease":
            node.last_lease = time.monotonic()
            self.io.send_node(node, {"t": "lease_ok", "seq": msg.get("seq")})
        elif t == "exit":
            sid = int(msg["spawn_id"])
            w = self.view.workers.get(sid)
            if w is not None and w.live:
                w.live = False
                self._exits.append(
                    _Exit(sid=sid, rc=int(msg["rc"]), pid=msg.get("pid"), fault_at=msg.get("fault_at"))
                )
        elif t == "spawned":
            if msg.get("pid") is not None:
                w = self.view.workers.get(int(msg["spawn_id"]))
                if w is not None:
                    w.pid = int(msg["pid"])
            self.events.emit("spawned", spawn_id=msg.get("spawn_id"), pid=msg.get("pid"), node=node.name)
        elif t in ("inventory", "installed"):
            self.io.replies[int(msg["id"])] = msg
        elif t == "fetched":
            self._on_fetched(node, msg)
        elif t == "replicated":
            self.replication.on_replicated(node.name, msg)
        elif t == "preempt":
            self._on_preempt(node, float(msg.get("grace_s", 0.0)))
        elif t == "registered":
            node.lease_id = int(msg["lease_id"])
        elif t == "persisted" and self.rounds is not None:
            self.rounds.on_reply(node.name, msg)

    def _check_leases(self) -> None:
        if self.store.jobs is not None:
            return  # store mode: leases live in the store (_store_tick)
        now = time.monotonic()
        for node in list(self.view.nodes.values()):
            if node.alive and not node.in_process and now - node.last_lease > self.config.lease_ttl_s:
                self._lose_node(node, f"lease expired ({now - node.last_lease:.2f}s without renewal)")

    def _lose_node(
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
            if self.store.jobs is not None and node.lease_id:
                self.store.revoke(node)  # in store mode its agent fences when its lease is gone
        if node.chan is not None:
            node.chan.close()
        self.events.emit("node_lost", node=node.name, reason=why, quarantined=quarantine)
        for sid in sorted(s for s, w in self.view.workers.items() if w.live and w.node == node.name):
            w = self.view.workers[sid]
            w.live = False
            if w.chan is not None:
                w.chan.close()
            self._exits.append(_Exit(sid=sid, rc=-signal.SIGKILL, pid=None, fault_at=None, node_lost=why))
        self.io.node_lost(node.name, keep=set(self._waiting_fetch))  # fetches end with the generation
        self.replication.reset()  # its holders or senders may be gone: start over

    # -- workers -----------------------------------------------------------------------------------
    def _on_client(self, chan: Channel, msg: Message) -> None:
        t = msg.get("t")
        if t in ("migrate", "drain"):
            if t == "migrate":
                moves = [(int(msg["rank"]), None if msg.get("to") is None else str(msg["to"]))]
            else:
                node = str(msg["node"])
                if node not in self.view.nodes:
                    chan.send({"t": "migrated", "ok": False, "error": f"no node {node} in the job"})
                    return
                moves = [(r, None) for r, n in sorted(self.view.rank_node.items()) if n == node]
            reason = "migrate" if t == "migrate" else "drain"
            for rank, target in moves:
                error = self.request_migration(rank, target, reason)
                if error is not None:
                    chan.send({"t": "migrated", "rank": rank, "ok": False, "error": error})
                else:
                    self._migrate_clients.setdefault(rank, []).append(chan)
            chan.send({"t": "accepted", "ranks": [r for r, _ in moves]})
            return
        if t == "status":
            chan.send({"t": "status", **self.status()})
            return
        if msg.get("t") == "persist":
            if self.persister is None:
                chan.send({"t": "persisted", "error": "this job has no durable tier on this node"})
                return
            self.client_tickets.append((chan, self.persister.request()))
        else:
            chan.send({"t": "error", "error": f"unknown request {msg.get('t')!r}"})

    def status(self) -> dict[str, Any]:
        """What ``nonstop status`` shows (JSON types)."""
        spares: dict[str, int] = {}
        for node in self._idle_spares().values():
            spares[node] = spares.get(node, 0) + 1
        m = self.migration
        return {
            "job_id": self.job_id,
            "state": str(self.view.phase),
            "generation": self.view.generation,
            "world_size": self.view.world_size,
            "ranks": {
                str(r): {
                    "node": self.view.rank_node.get(r),
                    "spawn_id": sid,
                    "pid": self.view.workers[sid].pid,
                    "step": self.view.latest_step.get(r),
                }
                for r, sid in sorted(self.view.members.items())
            },
            "nodes": {
                n: {
                    "alive": rec.alive,
                    "quarantined": rec.quarantined,
                    "domain": rec.domain,
                    "ranks": sorted(r for r, nn in self.view.rank_node.items() if nn == n),
                    "idle_spares": spares.get(n, 0),
                    "failures": len(rec.failure_times),
                }
                for n, rec in sorted(self.view.nodes.items())
            },
            "committed_step": self.committed(),
            "replicated_step": self.view.replicated_step,
            "durable_step": self.rounds.last_step if self.rounds is not None else None,
            "durable_url": self.durable_url,
            "failures": self.view.failures_total,
            "migration": None
            if m is None
            else {
                "rank": m.rank,
                "source": m.leaver_node,
                "target": m.target,
                "phase": str(m.phase),
                "boundary": m.boundary,
            },
            "queued_migrations": [q[0] for q in self._migrate_queue],
            "num_shards": self.num_shards,
            "full_world_size": self.config.world_size,
            "min_world_size": self.elastic.min_world_size,
            "shards": {
                str(r): list(sh) for r, sh in enumerate(assign_shards(self.num_shards, self.view.world_size))
            },
            "growing": None
            if self.resize is None
            else {"to": self.resize.new_world_size, "boundary": self.resize.boundary},
            "store": self.config.store,
        }

    def _answer_clients(self) -> None:
        if not self.client_tickets or self.persister is None:
            return
        pending = []
        for chan, ticket in self.client_tickets:
            if not self.persister.wait(ticket, 0):
                pending.append((chan, ticket))
                continue
            last = self.persister.last
            reply: Message = {"t": "persisted", "error": self.persister.last_error}
            if last is not None:
                reply.update(step=last.step, url=self.persister.durable.url, stored_bytes=last.stored_bytes)
            try:
                chan.send(reply)
            except ControlError:
                pass
        self.client_tickets = pending

    def _on_connect(self, w: WorkerRecord) -> None:
        if self.view.phase is JobState.STARTING:
            if self.view.members and all(
                self.view.workers[sid].chan is not None for sid in self.view.members.values()
            ):
                self._begin_generation([])
            return
        r = self.reconf
        if r is not None and w.role is Role.SPARE and r.waiting_launch:
            # A spare came up before a cold process launched for a rank on the same node: it
            # takes the rank, and the cold process will wait as a spare when it connects.
            node = w.node
            rank = min((k for k in r.waiting_launch if self.view.rank_node.get(k) == node), default=None)
            if rank is not None:
                cold = self.view.workers[self.view.members[rank]]
                cold.role, cold.rank = Role.SPARE, None
                w.role, w.rank = Role.WORKER, rank
                self.view.members[rank] = w.spawn_id
                r.replacements[rank] = "spare"
                self.events.emit(
                    "spare_takes_over", rank=rank, spawn_id=w.spawn_id, cold_spawn_id=cold.spawn_id
                )
        if r is not None and w.rank is not None and w.rank in r.waiting_launch:
            r.waiting_launch.discard(w.rank)
            self._maybe_reconfigure(w.rank)
            self._advance()

    def _on_message(self, w: WorkerRecord, msg: Message) -> None:
        t = msg.get("t")
        now = time.monotonic()
        if t == "hb":
            w.last_hb = now
            w.coll = bool(msg.get("coll"))
            return
        if t == "injected":
            w.fault_at = float(msg["ts"])
            self.events.emit(
                "fault_injected",
                rank=msg.get("rank"),
                step=msg.get("step"),
                kind=msg.get("kind"),
                spawn_id=w.spawn_id,
                node=w.node,
            )
            return
        m = self.migration
        if (
            m is not None
            and w.spawn_id == m.joiner_sid
            and t == "restored"
            and m.phase is MigrationPhase.PREPARE
        ):
            self._on_joiner_prepared(m)
            return
        z = self.resize
        if z is not None and t == "restored" and w.spawn_id in z.joiners and z.generation is None:
            self._on_grow_prepared(z, w.spawn_id)
            return
        gen = int(msg.get("gen", -1))
        if gen != self.view.generation or w.rank is None or self.view.members.get(w.rank) != w.spawn_id:
            if t == "kv":
                self.io.send(
                    w, {"t": "kv", "id": msg.get("id"), "error": "fenced: not a member of this generation"}
                )
            return  # fenced: an older generation, or not (any more) a member
        rank = w.rank
        if t == "kv":
            chan = w.chan
            assert chan is not None
            for reply, out in self.kv.handle(msg, chan.send):
                try:
                    reply(out)
                except ControlError:
                    pass
        elif t == "step":
            w.last_progress, w.stepped = now, True
            self.detector.record_step(float(msg["step_s"]))
            self.view.latest_step[rank] = int(msg["step"])
            self._note_step(rank, int(msg["step"]))
            if self.reconf is not None:
                self.reconf.stepped.add(rank)
                self._advance()
        elif t == "restored" and self.reconf is not None:
            self.reconf.restored.add(rank)
            self._advance()
        elif t == "ready" and self.reconf is not None:
            self.reconf.ready.add(rank)
            w.last_progress = now
            if self.reconf.restore_step is None:  # a fresh start: step 0 is snapshotted (replicable)
                self.view.latest_step.setdefault(rank, 0)
            self._advance()
        elif t == "done":
            self.view.latest_step[rank] = int(msg["step"])
            self.view.done_ranks.add(rank)
            if self.reconf is not None:
                self.reconf.stepped.add(rank)
                self._advance()
            if self.view.phase is JobState.RUNNING and self.view.done_ranks >= set(
                range(self.view.world_size)
            ):
                self._finish()
        elif t == "migrate":
            error = self.request_migration(rank, msg.get("to"), "migrate")
            if error is not None:
                self.events.emit("migration_refused", rank=rank, target=msg.get("to"), reason=error)
        elif t == "paused" and m is not None and m.phase is MigrationPhase.PAUSE:
            m.paused[rank] = int(msg["step"])
            if rank == m.rank and m.paused[rank] == m.boundary:
                self._fetch_boundary(m)  # the leaver's step S is complete: bring it over now
            if len(m.paused) == self.view.world_size:
                self._swap(m)
        elif t == "paused" and self.resize is not None and self.resize.generation is None:
            self._on_paused_for_resize(self.resize, rank, int(msg["step"]))
        elif t == "fault":
            w.fault_report = (now, str(msg.get("error", "")))
            self.events.emit("fault_report", rank=rank, spawn_id=w.spawn_id, error=msg.get("error"))

    # -- failures ----------------------------------------------------------------------------
    def _handle_exits(self) -> None:
        failures = []
        failed_on: dict[int, str] = {}  # spawn id -> node, of each failure
        exits, self._exits = self._exits, []
        for ex in exits:
            sid, rc = ex.sid, ex.rc
            w = self.view.workers.pop(sid, None)
            if w is None:
                continue
            node = w.node
            self.events.emit(
                "exit",
                spawn_id=sid,
                role=w.role,
                rank=w.rank,
                returncode=rc,
                how=describe_exit(rc),
                node=node,
            )
            is_member = w.rank is not None and self.view.members.get(w.rank) == sid
            if self.migration is not None and sid == self.migration.joiner_sid and not is_member:
                self._abort_migration(f"the joiner (spawn {sid}) exited with {describe_exit(rc)}")
            z = self.resize
            if z is not None and z.generation is None and sid in z.joiners:
                self._abort_resize(f"joining spare {sid} exited with {describe_exit(rc)}")
            if (
                ex.node_lost is None
                and w.chan is None
                and (self.view.phase is JobState.STARTING or w.role is Role.SPARE)
            ):
                # It died before reaching nonstop.init(): the script itself cannot start, and
                # starting it again would fail the same way.
                who = f"rank {w.rank}" if w.rank is not None else "a hot spare"
                hint = (
                    "the script must call nonstop.init()"
                    if rc == 0
                    else f"see its output (logs under the job dir of node {node})"
                )
                self._fail(f"{who} exited with {describe_exit(rc)} before joining the job: {hint}")
                continue
            if self.view.phase in (JobState.FINISHING, JobState.DONE, JobState.FAILED):
                if is_member and rc != 0 and self.view.phase is JobState.FINISHING:
                    log.warning("rank %s exited with %s after finishing", w.rank, describe_exit(rc))
                continue
            if not is_member:
                if (
                    w.role is Role.SPARE
                    and ex.node_lost is None
                    and node in self.view.nodes
                    and self.view.nodes[node].alive
                ):
                    self.io.spawn(node, Role.SPARE, None)  # keep K spares; a lost spare costs nothing else
                continue
            assert w.rank is not None
            if ex.node_lost is not None:
                kind, detail = FailureKind.NODE_LOST, f"node {node} lost: {ex.node_lost}"
            else:
                kind = classify_exit(rc, killed_for_hang=w.killed_for_hang is not None)
                if w.fault_report is not None and kind is FailureKind.EXIT:
                    kind = FailureKind.ERROR
                detail = w.killed_for_hang or describe_exit(rc)
                self._node_failed(node)
            fault_at = w.fault_at if w.fault_at is not None else ex.fault_at
            if fault_at is None and w.pid is not None:  # its 'injected' message may be lost with it
                fault_at = fired_at(self.config.job_dir.resolve() / "faults", w.pid)
            failures.append(
                Failure(
                    kind=kind.value,
                    rank=w.rank,
                    spawn_id=sid,
                    detail=detail,
                    detected_at=time.time(),
                    fault_at=fault_at,
                    step=self.view.latest_step.get(w.rank, 0),
                )
            )
            failed_on[sid] = node
            del self.view.members[w.rank]
        # the ranks of one lost node failed at one instant: the fault time one of them recorded
        by_node: dict[str, float] = {}
        for f in failures:
            if f.kind == FailureKind.NODE_LOST.value and f.fault_at is not None:
                node = failed_on[f.spawn_id]
                by_node[node] = min(by_node.get(node, f.fault_at), f.fault_at)
        for f in failures:
            if f.kind == FailureKind.NODE_LOST.value and f.fault_at is None:
                f.fault_at = by_node.get(failed_on[f.spawn_id])
        if self.view.phase is JobState.FINISHING and not self._members_alive():
            self._set_state(JobState.DONE)
            self.events.emit("job_done", generation=self.view.generation)
        if failures and self.view.phase not in (JobState.DONE, JobState.FAILED):
            self._on_failures(failures)

    def _node_failed(self, name: str) -> None:
        """A process failure on ``name``: quarantine the node if it fails too often."""
        node = self.view.nodes.get(name)
        if node is None or not node.alive:
            return
        now = time.monotonic()
        node.failure_times.append(now)
        others = len([n for n in self._alive_nodes() if n != name])
        if self.quarantine.should_quarantine(node.failure_times, now=now, others_usable=others):
            self._lose_node(
                node,
                f"{len(node.failure_times)} failures within {self.quarantine.window_s:g}s: quarantined",
                quarantine=True,
            )

    def _on_failures(self, failures: list[Failure]) -> None:
        if self.migration is not None:
            self._abort_migration(f"rank {failures[0].rank} failed: {failures[0].detail}")
        if self.resize is not None:
            self._abort_resize(f"rank {failures[0].rank} failed: {failures[0].detail}")
        for f in failures:
            self.events.emit(
                "failure",
                kind=f.kind,
                rank=f.rank,
                spawn_id=f.spawn_id,
                detail=f.detail,
                step=f.step,
                detect_s=(f.detected_at - f.fault_at) if f.fault_at else None,
            )
        self.view.failures_total += len(failures)
        if self.view.phase is JobState.STARTING:  # died before the job formed: just start it again
            if self.view.failures_total <= self.config.max_restarts:
                for f in failures:
                    node = self.view.rank_node.get(f.rank)
                    alive = self._alive_nodes()
                    if not alive:
                        break
                    self.io.spawn(node if node in alive else alive[0], Role.WORKER, f.rank)
                return
        if self.view.failures_total > self.config.max_restarts:
            self._fail(
                f"restart budget exhausted ({self.config.max_restarts} restarts); last failure: "
                f"rank {failures[-1].rank} {failures[-1].detail}"
            )
            return
        if self._deferred is not None:
            before, replans, replacements = self._deferred
            self._deferred, self._replan_at = None, None
            self._begin_generation(before + failures, replans=replans + 1, replacements=replacements)
            return
        previous = self.reconf if self.view.phase is JobState.RECONFIGURING else None
        if previous is None:
            self._begin_generation(failures)
        else:  # a failure during a recovery: re-plan, keeping what the interrupted plan did
            self._begin_generation(
                previous.failures + failures, replans=previous.replans + 1, replacements=previous.replacements
            )

    def _detect(self) -> None:
        if self.view.phase not in (JobState.RUNNING, JobState.RECONFIGURING):
            return
        in_training = self.view.phase is JobState.RUNNING or (
            self.reconf is not None and self.reconf.stage is Stage.RESUME
        )
        verdicts = self.detector.scan(
            now=time.monotonic(),
            members={rank: self.view.workers[sid] for rank, sid in self.view.members.items()},
            everyone=list(self.view.workers.values()),
            alive=self.view.live,
            in_training=in_training,
        )
        for sid, reason in verdicts.kill.items():
            w = self.view.workers[sid]
            if w.killed_for_hang:
                continue
            w.killed_for_hang = reason
            self.events.emit("hang_detected", rank=w.rank, spawn_id=sid, reason=reason)
            self.io.kill(sid, signal.SIGKILL)
        for sid in verdicts.reraise:
            w = self.view.workers[sid]
            assert w.fault_report is not None
            w.fault_report = (float("inf"), w.fault_report[1])  # tell it once
            self.io.send(w, {"t": "raise"})

    def _check_timeouts(self) -> None:
        r = self.reconf
        if (
            self.view.phase is not JobState.RECONFIGURING
            or r is None
            or r.stage in (Stage.LAUNCH, Stage.RESUME)
        ):
            return
        if r.deadline == 0.0:
            r.deadline = time.time() + self.config.rebuild_timeout_s
        if time.time() > r.deadline:
            waiting = r.restored if r.stage is Stage.RESTORE else r.ready
            for rank in set(range(self.view.world_size)) - waiting:
                sid = self.view.members.get(rank)
                if sid is not None and sid in self.view.workers:
                    self.view.workers[sid].killed_for_hang = f"stage {r.stage} timed out"
                    self.io.kill(sid)
            r.deadline = time.time() + self.config.rebuild_timeout_s  # one kill round per period

    # -- planning ---------------------------------------------------------------------------------
    def _await(self, reqs: list[int], timeout: float) -> dict[int, Message]:
        """Wait for the replies to ``reqs`` while serving every other event (leases included)."""
        deadline = time.monotonic() + timeout
        while any(r not in self.io.replies for r in reqs) and time.monotonic() < deadline:
            self._pump_events(0.002)
            self._check_leases()
        out = {r: self.io.replies.pop(r) for r in reqs if r in self.io.replies}
        for r in reqs:
            self.io.done(r)
        return out

    def _inventories(self) -> dict[int, dict[int, list[tuple[str, str]]]]:
        """rank -> step -> [(node, "local"|"replica")] over every live node's memory."""
        reqs = {self.io.request(self.view.nodes[n], {"t": "inventory"}): n for n in self._alive_nodes()}
        replies = self._await(list(reqs), PLAN_WAIT_S)
        avail: dict[int, dict[int, list[tuple[str, str]]]] = {}
        for req, node in reqs.items():
            msg = replies.get(req)
            if msg is None or msg.get("t") != "inventory" or not self.view.nodes[node].alive:
                continue
            for kind in ("local", "replica"):
                for rank_s, steps in dict(msg.get("local" if kind == "local" else "replicas", {})).items():
                    for step in steps:
                        avail.setdefault(int(rank_s), {}).setdefault(int(step), []).append((node, kind))
        return avail

    def _begin_generation(
        self,
        failures: list[Failure],
        *,
        replans: int = 0,
        replacements: dict[int, str] | None = None,
        inventory_needed: bool = False,
    ) -> None:
        """Plan and start generation + 1. Every rank restores the newest step all ranks hold
        (memory first, then durable) when there are ``failures``, a resumed checkpoint to
        install, or ``inventory_needed`` (a restarted coordinator redoing an interrupted recovery).
        The decision is :func:`~nonstop.runtime.planning.plan_generation`'s; this carries it out."""
        now = time.time()
        self._open_generation()
        alive_nodes = self._alive_nodes()
        inventory: Inventory | None = None
        if alive_nodes and (failures or self.initial_step is not None or inventory_needed):
            inventory = self._inventories()
            members = set(self.view.members.values())
            if any(ex.sid in members for ex in self._exits):
                # More ranks were lost while the nodes answered (a second node going down with
                # the first): plan once for all of them when their exits are handled.
                self._deferred = (failures, replans, dict(replacements or {}))
                self.events.emit("replan_deferred", generation=self.view.generation)
                return
            self.initial_step = None
        plan = plan_generation(
            world_size=self.view.world_size,
            present=set(self.view.members),
            last_node=dict(self.view.rank_node),
            inventory=inventory,
            idle_spares=self._idle_spares(),
            live_nodes=alive_nodes,
            load={
                n: sum(1 for r in self.view.members if self.view.rank_node.get(r) == n) for n in alive_nodes
            },
            elastic=self.elastic,
            waited_s=now - min((f.detected_at for f in failures), default=now),
            recovering=bool(failures),
        )
        if plan.action is PlanAction.FAIL:
            self._fail(plan.reason)
            return
        if plan.action is PlanAction.WAIT:
            for sid in self.view.members.values():  # their fault reports are answered after the wait
                self.view.workers[sid].fault_report = None
            self._deferred = (failures, replans, dict(replacements or {}))
            self._replan_at = time.monotonic() + plan.wait_s
            self.events.emit("elastic_wait", ranks=list(plan.unplaced), wait_s=plan.wait_s)
            return
        from_rank: dict[int, int] = {}
        if plan.shrink is not None:
            from_rank = self._shrink(plan.shrink, plan.reason)
        placements, avail, restore_step = plan.placements, plan.inventory, plan.restore_step
        unplaced = plan.unplaced
        for rank, p in placements.items():
            self.view.rank_node[rank] = p.node
        tier = "memory"
        if plan.action is PlanAction.FROM_DURABLE:
            restore_step = self._restore_from_durable()
            tier = "durable"
            if restore_step is None:
                # Survivors hold later state than any fresh process could: never mix them.
                self._fail(
                    "no step is snapshotted for every rank in memory or in the durable tier "
                    f"({self.durable_url or 'none configured'}); "
                    "cannot recover this failure (persist more often with --persist-every)"
                )
                return
            avail = {}
        r = Reconfiguration(
            generation=self.view.generation,
            world_size=self.view.world_size,
            failures=failures,
            restore_step=restore_step,
            replans=replans,
            replacements=dict(replacements or {}),
        )
        r.marks["detect"] = max((f.detected_at for f in failures), default=now)
        r.from_rank = from_rank
        if unplaced:  # renumbered ranks and new processes write their new number's slots afresh
            r.fresh = set(from_rank) | set(placements)
        if failures and restore_step is not None:
            r.lost_steps = max(0, self.committed() - restore_step)
        if restore_step is not None:
            self._rewind(restore_step)
        for rank, p in sorted(placements.items()):
            r.replacements[rank] = p.source.value
            if p.spare is not None:
                w = self.view.workers[p.spare]
                w.rank, w.role = rank, Role.WORKER
                w.last_progress, w.stepped = time.monotonic(), False
                self.view.members[rank] = p.spare
            else:
                self.io.spawn(p.node, Role.WORKER, rank)
                r.waiting_launch.add(rank)
        r.marks["plan"] = time.time()
        fetches = (
            self._plan_fetches(r, restore_step, avail)
            if tier == "memory" and restore_step is not None
            else {}
        )
        for rank in fetches:  # its step arrives in its new rank's memory: restore that
            r.from_rank.pop(rank, None)
        self._launch(r, tier=tier, fetches=fetches)

    def _shrink(self, shrink: Shrink, why: str) -> dict[int, int]:
        """Drop ``shrink.dropped``: the ranks that stay are renumbered ``0..W'-1`` in their old
        order and the shards spread over them. Returns new rank -> old rank for every rank
        renumbered."""
        old_world = self.view.world_size
        new_of = shrink.new_of
        self.view.world_size = shrink.world_size
        self.view.members = {new_of[r]: sid for r, sid in self.view.members.items() if r in new_of}
        for rank, sid in self.view.members.items():
            self.view.workers[sid].rank = rank
        self.view.rank_node = {new_of[r]: n for r, n in self.view.rank_node.items() if r in new_of}
        self.view.latest_step = {new_of[r]: st for r, st in self.view.latest_step.items() if r in new_of}
        self._step_at.clear()
        self.events.emit(
            "shrink",
            world_size=self.view.world_size,
            old_world_size=old_world,
            dropped=list(shrink.dropped),
            renumbered={str(o): n for o, n in new_of.items() if o != n},
            shards={
                str(r): list(sh) for r, sh in enumerate(assign_shards(self.num_shards, self.view.world_size))
            },
            reason=why,
        )
        return {n: o for o, n in new_of.items() if o != n}

    def _open_generation(self) -> None:
        """Generation + 1: fence the old one (its fetches, rendezvous, replication round)."""
        self.view.generation += 1
        self._set_state(JobState.RECONFIGURING)
        self.reconf = None
        for req in [q for q, (_, gen) in self._waiting_fetch.items() if gen < self.view.generation]:
            del self._waiting_fetch[req]  # a late answer is ignored (its generation is over)
            self.io.done(req)
        self.replication.reset()
        for reply, msg in self.kv.new_generation(self.view.generation):
            try:
                reply(msg)
            except ControlError:
                pass
        self.view.done_ranks.clear()

    def _rewind(self, step: int) -> None:
        """Every rank goes back to ``step``: later step reports are void."""
        self.view.latest_step = {rank: step for rank in range(self.view.world_size)}
        if self.view.replicated_step is not None and self.view.replicated_step > step:
            self.view.replicated_step = step

    def _launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Log the planned generation ``r`` and start it: reconfigure every connected member."""
        self.reconf = r
        self.events.emit(
            "generation",
            generation=r.generation,
            restore_step=r.restore_step,
            tier=tier,
            members={str(k): v for k, v in sorted(self.view.members.items())},
            nodes={str(k): self.view.rank_node.get(k) for k in sorted(self.view.members)},
            replacements=r.replacements,
            cause=[f.rank for f in r.failures],
            fetches={str(k): v for k, v in fetches.items()},
            replans=r.replans,
            **extra,
        )
        for rank, sid in self.view.members.items():
            if (
                self.view.workers[sid].chan is None
            ):  # still starting (e.g. launched by a re-planned generation)
                r.waiting_launch.add(rank)
            self._maybe_reconfigure(rank)
        r.stage = Stage.LAUNCH
        self._advance()

    def _fetch_for(
        self,
        r: Reconfiguration,
        rank: int,
        step: int,
        source: str,
        kind: str,
        *,
        src_rank: int | None = None,
        base: int | None = None,
        early: int | None = None,
    ) -> str:
        """A fetch generation ``r`` waits for before ``rank`` restores (to the node playing it);
        ``src_rank``: the rank whose snapshot that is, when not ``rank`` (a world-size change);
        ``base``: a step the node holds from a catch-up (the fetch may come as a delta);
        ``early``: the same fetch already asked for (:meth:`_fetch_early`): adopted unless it
        failed -- waited for while in flight, nothing to wait for once done."""
        if early is not None and early in self._early:
            ok = self._early.pop(early)[1]
            if ok is not False:
                if ok is None:
                    self._waiting_fetch[early] = (rank, r.generation)
                    r.waiting_fetch.add(rank)
                return f"{source}:{kind}"
        src = rank if src_rank is None else src_rank
        req = self.io.fetch(self.view.rank_node[rank], src, step, source, kind, as_rank=rank, base=base)
        self._waiting_fetch[req] = (rank, r.generation)
        r.waiting_fetch.add(rank)
        return f"{source}:{kind}"

    def _fetch_early(
        self, target: str, rank: int, step: int, source: str, *, as_rank: int, base: int | None = None
    ) -> int:
        """A swap's boundary fetch asked for as soon as the source rank completed the step, before
        its generation exists (the other ranks are still finishing theirs); a request id for
        ``_fetch_for(early=...)``."""
        req = self.io.fetch(target, rank, step, source, "local", as_rank=as_rank, base=base)
        self._early[req] = (as_rank, None)
        return req

    def _idle_spares(self) -> dict[int, str]:
        """Connected hot spares waiting for a rank: spawn id -> node."""
        return self.view.idle_spares()

    def _plan_fetches(self, r: Reconfiguration, step: int, avail: Inventory) -> dict[int, str]:
        """Have each node that will play a rank without holding ``step`` of it fetch it from a peer."""
        out: dict[int, str] = {}
        for rank in range(self.view.world_size):
            target = self.view.rank_node[rank]
            sources = avail.get(rank, {}).get(step, [])
            if any(n == target and k == "local" for n, k in sources):
                continue
            # prefer the target's own replica (a copy within the node), then any other holder
            src = sorted(sources, key=lambda s: (s[0] != target, s[1] != "replica", s[0]))[0]
            out[rank] = self._fetch_for(r, rank, step, src[0], src[1], src_rank=r.from_rank.get(rank))
        return out

    def _on_fetched(self, node: NodeRecord, msg: Message) -> None:
        req = int(msg["id"])
        m = self.migration
        if m is not None and req == m.fetch_req and m.phase is MigrationPhase.PREPARE:
            self._on_prepare_fetched(m, msg)
            return
        if m is not None and req == m.catchup_req:
            self._on_catchup_fetched(m, msg)
            return
        if req in self._early:  # arrived before the swap adopted it: nothing waits on it yet
            rank = self._early[req][0]
            self._early[req] = (rank, bool(msg.get("ok")))
            self.io.done(req)
            self.events.emit(
                "fetched",
                node=node.name,
                rank=rank,
                ok=msg.get("ok"),
                seconds=msg.get("seconds"),
                error=msg.get("error"),
                early=True,
            )
            return
        if self.resize is not None and req in self.resize.fetches:
            self.io.done(req)
            self._on_grow_fetched(self.resize, req, msg)
            return
        rank, gen = self._waiting_fetch.pop(req, (-1, -1))
        self.io.done(req)
        r = self.reconf
        self.events.emit(
            "fetched",
            node=node.name,
            rank=rank,
            ok=msg.get("ok"),
            seconds=msg.get("seconds"),
            error=msg.get("error"),
        )
        if r is None or gen != r.generation:
            return
        if not msg.get("ok"):
            self._fail(f"rank {rank} could not be fetched to node {node.name}: {msg.get('error')}")
            return
        r.waiting_fetch.discard(rank)
        self._maybe_reconfigure(rank)
        self._advance()

    def _restore_from_durable(self) -> int | None:
        """Have every node install its ranks from the newest durable checkpoint that loads."""
        if self.durable_url is None:
            return None
        from nonstop.snapshot.durable import DurableStore

        try:
            steps = DurableStore(self.durable_url).steps()
        except NonstopError as e:
            self.events.emit("durable_unavailable", error=str(e))
            return None
        placement = self._placement()
        for step in sorted(steps, reverse=True):
            t0 = time.monotonic()
            if self._install_durable(step, placement, self.durable_url):
                self.events.emit(
                    "restore_from_durable", step=step, url=self.durable_url, seconds=time.monotonic() - t0
                )
                return step
        return None

    def _install_durable(self, step: int, placement: dict[str, list[int]], url: str) -> bool:
        """Have every node install its ranks of durable checkpoint ``step``. A checkpoint of
        another world size (written while the job was shrunk) serves an elastic job only: its
        ranks are data-parallel replicas (``resume_sources``)."""
        from nonstop.snapshot.durable import DurableStore

        try:
            written = DurableStore(url).world_size_at(step)
        except NonstopError as e:
            self.events.emit("durable_install_failed", step=step, errors=[str(e)])
            return False
        sources: dict[int, int] = {}
        if written != self.view.world_size:
            if not self.elastic.enabled:
                self.events.emit(
                    "durable_install_failed",
                    step=step,
                    errors=[f"the checkpoint has {written} ranks, the job {self.view.world_size}"],
                )
                return False
            sources = {r: s for r, s in resume_sources(written, self.view.world_size).items() if r != s}
        reqs = []
        for n, ranks in placement.items():
            msg: Message = {"t": "install_durable", "url": url, "step": step, "ranks": ranks}
            if any(r in sources for r in ranks):
                msg["from"] = {str(r): sources[r] for r in ranks if r in sources}
            reqs.append(self.io.request(self.view.nodes[n], msg))
        replies = self._await(reqs, self.config.persist_timeout_s)
        bad = [m.get("error") for m in replies.values() if not m.get("ok")]
        if bad or len(replies) < len(reqs):
            self.events.emit("durable_install_failed", step=step, errors=bad or ["timed out"])
            return False
        return True

    def committed(self) -> int:
        """The committed step: what is replicated to peers (with replication), else in memory."""
        if self.replication_on and self.view.replicated_step is not None:
            return self.view.replicated_step
        return min((self.view.latest_step.get(rank, 0) for rank in range(self.view.world_size)), default=0)

    def _maybe_reconfigure(self, rank: int) -> None:
        r = self.reconf
        if r is None or rank in r.waiting_launch or rank in r.waiting_fetch:
            return
        sid = self.view.members.get(rank)
        if sid is None:
            return
        w = self.view.workers[sid]
        if w.chan is None:
            return
        w.stepped, w.coll, w.fault_report = False, False, None
        self.io.send(
            w,
            {
                "t": "reconfigure",
                "gen": r.generation,
                "rank": rank,
                "world_size": self.view.world_size,
                "restore_step": r.restore_step,
                "recovery": bool(r.failures),
                **self._shards_of(rank),
                **({"from_rank": r.from_rank[rank]} if rank in r.from_rank else {}),
                **({"fresh": True} if rank in r.fresh else {}),
                **({"live": True} if r.live else {}),
            },
        )

    def _shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]:
        """The data shards ``rank`` plays in ``world_size`` (default: the current one)."""
        world = self.view.world_size if world_size is None else world_size
        return {
            "shards": list(assign_shards(self.num_shards, world)[rank]),
            "num_shards": self.num_shards,
        }

    def _advance(self) -> None:
        r = self.reconf
        if r is None:
            return
        before = r.stage
        after = r.advance()
        if after is not before:
            r.deadline = 0.0  # each stage gets its own rebuild_timeout_s
        order = [Stage.LAUNCH, Stage.RESTORE, Stage.REBUILD, Stage.RESUME, Stage.DONE]
        now = time.time()
        for s in order[order.index(before) : order.index(after)]:
            r.marks[s.value] = now
            self.events.emit(
                "stage", generation=r.generation, stage=s.value, seconds=now - r.marks[_previous(s)]
            )
        if before is not Stage.REBUILD and after in (Stage.REBUILD, Stage.RESUME, Stage.DONE):
            for sid in self.view.members.values():
                self.io.send(self.view.workers[sid], {"t": "rebuild", "gen": r.generation})
        if after in (Stage.RESUME, Stage.DONE) and before not in (Stage.RESUME, Stage.DONE):
            self._set_state(JobState.RUNNING)
            now_m = time.monotonic()
            for sid in self.view.members.values():
                self.view.workers[sid].last_progress = now_m
        if after is Stage.DONE:
            self.reconf = None
            m = self.migration
            if m is not None and m.phase is MigrationPhase.SWAP and m.generation == r.generation:
                self._migration_done(m)
            if self.resize is not None and self.resize.generation == r.generation:
                self._resize_done(self.resize)
            if r.failures:
                records = r.report()
                self.view.reports.extend(records)
                for rec in records:
                    self.events.emit("recovery", **rec)
            self._replenish_spares()
            if (
                self.view.done_ranks >= set(range(self.view.world_size))
                and self.view.phase is JobState.RUNNING
            ):
                self._finish()

    # -- live migration (runtime/migration.py) -----------------------------------------------------
    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        """Queue moving ``rank`` to ``target`` (None: the policy picks a node); an error message
        when the request cannot be honoured at all."""
        if not 0 <= rank < self.view.world_size:
            return f"no rank {rank}: the job has ranks 0..{self.view.world_size - 1}"
        if target is not None:
            node = self.view.nodes.get(target)
            if node is None or not node.alive or node.quarantined:
                return (
                    f"node {target} is not a live node of the job (nodes: {', '.join(self._alive_nodes())})"
                )
            if self.view.rank_node.get(rank) == target:
                return f"rank {rank} already runs on node {target}"
        if self.view.phase in (JobState.FINISHING, JobState.DONE, JobState.FAILED):
            return "the job is ending"
        if any(q[0] == rank for q in self._migrate_queue) or (
            self.migration is not None and self.migration.rank == rank
        ):
            return f"rank {rank} is already being moved"
        self._migrate_queue.append((rank, target, reason, time.monotonic()))
        self.events.emit("migration_requested", rank=rank, target=target, reason=reason)
        return None

    def _answer_migration(self, rank: int, *, ok: bool, error: str | None = None, **info: Any) -> None:
        for chan in self._migrate_clients.pop(rank, []):
            try:
                chan.send({"t": "migrated", "rank": rank, "ok": ok, "error": error, **info})
            except ControlError:
                pass

    def _note_step(self, rank: int, step: int) -> None:
        """Step report timing; during a migration, the gap each rank saw across the swap."""
        now = time.monotonic()
        m = self.migration
        prev = self._step_at.get(rank)
        self._step_at[rank] = (step, now)
        if m is not None and m.boundary is not None and prev is not None and step == m.boundary + 1:
            if prev[0] == m.boundary:
                m.gaps[rank] = now - prev[1]

    def _on_preempt(self, node: NodeRecord, grace_s: float) -> None:
        """A node got a preemption notice: move its ranks live to other nodes within the grace
        (queued migrations); persist now in case there is not enough time."""
        if node.draining or not node.alive:
            return
        node.draining = True
        ranks = sorted(r for r, n in self.view.rank_node.items() if n == node.name)
        self.events.emit("preempt_notice", node=node.name, grace_s=grace_s, ranks=ranks)
        if self.rounds is not None:
            self.rounds.request()
        for rank in ranks:
            error = self.request_migration(rank, None, "preempt")
            if error is not None:
                self.events.emit("migration_refused", rank=rank, target=None, reason=error)
        self._release_drained()

    def _release_drained(self) -> None:
        """A draining node that plays no rank any more is released (not a failure)."""
        busy = {self.migration.leaver_node} if self.migration is not None else set()
        for node in list(self.view.nodes.values()):
            if not node.alive or not node.draining or node.name in busy:
                continue
            if any(n == node.name for n in self.view.rank_node.values()):
                continue
            self.io.send_node(node, {"t": "release"})
            self.events.emit("node_released", node=node.name)
            self._lose_node(node, "released after draining", failure=False)

    def _migrate_tick(self) -> None:
        self._release_drained()
        m = self.migration
        if m is None:
            if self._migrate_queue and self._may_start(Op.MIGRATE):
                self._start_migration(*self._migrate_queue.pop(0))
            return
        if m.phase in (MigrationPhase.PAUSE, MigrationPhase.SWAP):
            now = time.monotonic()
            for sid in self.view.members.values():  # a rank waiting at the boundary is not hung
                self.view.workers[sid].last_progress = now
        if m.phase in (MigrationPhase.PREPARE, MigrationPhase.PAUSE):
            if time.time() - m.marks["start"] > self.config.rebuild_timeout_s:
                self._abort_migration(f"not ready to swap within {self.config.rebuild_timeout_s:g}s")

    def _start_migration(self, rank: int, wanted: str | None, reason: str, asked: float) -> None:
        leaver_node = self.view.rank_node[rank]
        target = wanted
        idle = self._idle_spares()
        alive = self._alive_nodes()
        if target is None:
            target = choose_target(
                leaver_node,
                idle,
                alive,
                {n: self.view.nodes[n].domain for n in alive},
                {n: sum(1 for r in self.view.members if self.view.rank_node.get(r) == n) for n in alive},
            )
        joiner = choose_joiner(target, idle) if target is not None and target in alive else None
        if target is None or joiner is None:
            if time.monotonic() - asked < self.config.rebuild_timeout_s:
                # Spares may still be starting (importing torch) or being replaced: ask again later.
                self._migrate_queue.append((rank, wanted, reason, asked))
                return
            why = f"no idle hot spare on node {target}" if target is not None else "no node has an idle spare"
            self.events.emit("migration_refused", rank=rank, target=target, reason=why)
            self._answer_migration(rank, ok=False, error=why)
            return
        step = self.committed()  # held in the leaver node's memory until a newer one commits
        m = Migration(
            rank=rank,
            target=target,
            leaver_sid=self.view.members[rank],
            leaver_node=leaver_node,
            joiner_sid=joiner,
            reason=reason,
            prepare_step=step,
        )
        self.migration = m
        w = self.view.workers[joiner]
        w.role, w.rank = Role.JOINER, rank  # not a member until the swap
        self.events.emit(
            "migration_start",
            rank=rank,
            source=leaver_node,
            target=target,
            joiner=joiner,
            step=step,
            reason=reason,
        )
        m.fetch_req = self.io.fetch(target, rank, step, leaver_node, "local", track=True)

    def _on_prepare_fetched(self, m: Migration, msg: Message) -> None:
        if not msg.get("ok"):
            self._abort_migration(f"fetching step {m.prepare_step} to node {m.target}: {msg.get('error')}")
            return
        m.mark("fetched")
        m.held = m.prepare_step
        self._send_prepare(m.joiner_sid, m.rank, self.view.world_size, m.prepare_step)

    def _catch_up(self, m: Migration) -> bool:
        """Start the next catch-up fetch if one is due (``catch_up_to``); whether one is in flight."""
        if m.phase is not MigrationPhase.PREPARE:
            return False
        due = catch_up_to(m, self.committed())
        if due is not None:
            m.catchup_step, as_delta = due
            base = m.held if as_delta else None
            m.catchup_req = self.io.fetch(
                m.target, m.rank, m.catchup_step, m.leaver_node, "local", base=base, track=True
            )
        return m.catchup_req is not None

    def _on_catchup_fetched(self, m: Migration, msg: Message) -> None:
        m.catchup_req = None
        m.rounds += 1
        self.io.done(int(msg["id"]))
        if msg.get("ok"):
            m.held = m.catchup_step
            m.mark("caught_up")
            t = _transfer(msg)
            if msg.get("capped"):
                pass  # it measures the bandwidth cap, not what an uncapped swap would take
            elif msg.get("delta"):
                m.catchups.append(t)
            elif msg.get("wire_bytes"):
                m.full = t
        else:
            m.held = None  # the target lost its base: the swap fetches the whole step
        self.events.emit(
            "catchup",
            rank=m.rank,
            step=m.catchup_step,
            ok=bool(msg.get("ok")),
            delta=bool(msg.get("delta")),
            raw_bytes=msg.get("raw_bytes"),
            wire_bytes=msg.get("wire_bytes"),
            seconds=msg.get("seconds"),
            capped=bool(msg.get("capped")),
            error=msg.get("error"),
        )
        self._maybe_pause(m)

    def _send_prepare(self, sid: int, rank: int, world_size: int, step: int | None) -> None:
        """Tell a joiner (a migration's or a grow's) its rank: it restores ``step``, which its node
        holds, and warms up while the job trains; it is no member until the swap."""
        self.io.send(
            self.view.workers[sid],
            {
                "t": "reconfigure",
                "gen": self.view.generation,
                "rank": rank,
                "world_size": world_size,
                "restore_step": step,
                "recovery": False,
                "prepare": True,
                **self._shards_of(rank, world_size),
            },
        )

    def _on_joiner_prepared(self, m: Migration) -> None:
        """The joiner restored the prepare step (model built, buffers allocated): catch up, then
        pause."""
        m.mark("prepared")
        m.ready = True
        self._maybe_pause(m)

    def _maybe_pause(self, m: Migration) -> None:
        """Pick the boundary once the joiner is ready and the target has caught up."""
        if not m.ready or m.phase is not MigrationPhase.PREPARE or self._catch_up(m):
            return
        m.phase = MigrationPhase.PAUSE
        m.boundary = boundary_step(self.view.latest_step)
        self.events.emit("migration_pause", rank=m.rank, boundary=m.boundary)
        for sid in self.view.members.values():
            self.io.send(self.view.workers[sid], {"t": "pause", "at": m.boundary})

    def _swap(self, m: Migration) -> None:
        """Every rank stopped after the boundary step: a new generation with the joiner in the rank."""
        assert m.boundary is not None
        if set(m.paused.values()) != {m.boundary}:
            self._abort_migration(
                f"ranks stopped at steps {sorted(set(m.paused.values()))}, not {m.boundary}"
            )
            return
        m.mark("paused")
        m.phase = MigrationPhase.SWAP
        step = m.boundary
        leaver = self.view.workers[m.leaver_sid]
        leaver.role, leaver.rank = Role.RETIRED, None  # its exit is no failure
        self.io.kill(m.leaver_sid, signal.SIGKILL)  # its snapshot of the boundary stays in its node's memory
        joiner = self.view.workers[m.joiner_sid]
        joiner.role = Role.WORKER
        self.view.members[m.rank] = m.joiner_sid
        self.view.rank_node[m.rank] = m.target
        self._open_generation()
        m.generation = self.view.generation
        r = self._boundary_generation(step, {m.rank: "migration"})
        fetched = self._fetch_for(
            r, m.rank, step, m.leaver_node, "local", base=self._swap_base(m), early=m.boundary_req
        )
        self._launch(r, tier="memory", fetches={m.rank: fetched}, migration=m.rank)

    def _swap_base(self, m: Migration) -> int | None:
        """The step the swap's fetch of the boundary is a delta against (``swap_as_delta``), or None."""
        m.swap_delta = m.held is not None and swap_as_delta(m.full, m.catchups, self.config.swap_transfer)
        return m.held if m.swap_delta else None

    def _fetch_boundary(self, m: Migration) -> None:
        """The leaver completed the boundary step: the target fetches it while the other ranks
        are still finishing theirs (the swap's generation waits for it only if still in flight)."""
        assert m.boundary is not None
        m.boundary_req = self._fetch_early(
            m.target, m.rank, m.boundary, m.leaver_node, as_rank=m.rank, base=self._swap_base(m)
        )

    def _boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration:
        """The generation just opened, starting at boundary ``step`` that every rank paused after
        (a migration's swap, a grow): nothing rolls back, paused ranks keep their live state."""
        r = Reconfiguration(
            generation=self.view.generation,
            world_size=self.view.world_size,
            failures=[],
            restore_step=step,
            replans=0,
            replacements=replacements,
            fresh=fresh or set(),
            live=True,
        )
        r.marks["detect"] = r.marks["plan"] = time.time()
        self._rewind(step)
        return r

    def _migration_done(self, m: Migration) -> None:
        m.phase = MigrationPhase.DONE
        m.mark("resumed")
        median = self.detector.median_step_s
        gap = max(m.gaps.values(), default=None)
        info: dict[str, Any] = {
            "rank": m.rank,
            "source": m.leaver_node,
            "target": m.target,
            "boundary": m.boundary,
            "stages": m.stage_seconds(),
            "max_step_gap_s": gap,
            "median_step_s": median,
            "pause_ratio": (gap / median) if gap is not None and median else None,
            "reason": m.reason,
            "catchup_rounds": m.rounds,
            "swap_delta": m.swap_delta,
        }
        self.events.emit("migration_done", **info)
        self.migrations_done.append(info)
        self.migration = None
        self._answer_migration(m.rank, ok=True, **{k: v for k, v in info.items() if k != "rank"})

    def _abort_migration(self, why: str) -> None:
        m = self.migration
        if m is None:
            return
        self.migration = None
        if m.boundary_req is not None:
            self._early.pop(m.boundary_req, None)  # a late answer is ignored like any stale fetch
        phase = m.phase
        m.phase, m.error = MigrationPhase.ABORTED, why
        joiner = self.view.workers.get(m.joiner_sid)
        if joiner is not None and self.view.members.get(m.rank) != m.joiner_sid:
            joiner.role, joiner.rank = Role.RETIRED, None
            self.io.kill(m.joiner_sid, signal.SIGKILL)  # a prepared joiner cannot take another rank
        if m.boundary is not None and m.generation is None:
            for sid in self.view.members.values():  # ranks waiting at the boundary go on as before
                self.io.send(self.view.workers[sid], {"t": "continue"})
        self.events.emit("migration_aborted", rank=m.rank, phase=str(phase), error=why)
        self._answer_migration(m.rank, ok=False, error=why)

    # -- elasticity (runtime/elastic.py) -------------------------------------------------------------
    def _elastic_tick(self) -> None:
        """Re-plan a generation waiting for a spare (one appeared, or the wait is over); grow the
        world back while it is below its full size and spares are idle."""
        if self._deferred is not None and self._replan_at is not None:
            if time.monotonic() >= self._replan_at or self._idle_spares():
                before, replans, replacements = self._deferred
                self._deferred, self._replan_at = None, None
                self._begin_generation(before, replans=replans + 1, replacements=replacements)
            return
        z = self.resize
        if z is None:
            self._maybe_grow()
            return
        if z.generation is None:
            now = time.monotonic()
            for sid in self.view.members.values():  # a rank waiting at the boundary is not hung
                self.view.workers[sid].last_progress = now
            if time.time() - z.started > self.config.rebuild_timeout_s:
                self._abort_resize(
                    f"not every rank reached step {z.boundary} within {self.config.rebuild_timeout_s:g}s"
                )

    def _maybe_grow(self) -> None:
        if (
            self.view.world_size >= self.config.world_size
            or not self._may_start(Op.GROW)
            or time.monotonic() < self._grow_retry_at
        ):
            return
        idle = self._idle_spares()
        target = self.elastic.grow_to(world_size=self.view.world_size, idle_spares=len(idle))
        if target <= self.view.world_size:
            return
        joiners = sorted(idle)[: target - self.view.world_size]
        for sid in joiners:
            self.view.workers[sid].role = Role.JOINER  # held for the grow: no recovery takes it meanwhile
        z = Resize(
            world_size=self.view.world_size,
            new_world_size=target,
            joiners=joiners,
            started=time.time(),
            prepare_step=self.committed(),  # held in rank 0's node until a newer one commits
        )
        self.resize = z
        self.events.emit(
            "grow_start",
            world_size=self.view.world_size,
            new_world_size=target,
            prepare_step=z.prepare_step,
            joiners={str(sid): self.view.node_of(sid) for sid in joiners},
        )
        for i, sid in enumerate(joiners):
            node = self.view.node_of(sid)
            req = self.io.fetch(
                node, 0, z.prepare_step, self.view.rank_node[0], "local", as_rank=self.view.world_size + i
            )
            z.fetches[req] = sid

    def _on_grow_fetched(self, z: Resize, req: int, msg: Message) -> None:
        """A joiner's node holds the prepare step: the joiner restores it and warms up."""
        sid = z.fetches.pop(req)
        if not msg.get("ok"):
            self._abort_resize(f"fetching step {z.prepare_step} for spare {sid}: {msg.get('error')}")
            return
        self._send_prepare(sid, z.world_size + z.joiners.index(sid), z.new_world_size, z.prepare_step)

    def _on_grow_prepared(self, z: Resize, sid: int) -> None:
        """A joiner restored the prepare step and warmed up; once all have: pause at a boundary."""
        z.prepared.add(sid)
        if z.prepared < set(z.joiners) or z.boundary is not None:
            return
        z.boundary = boundary_step(self.view.latest_step)
        self.events.emit("grow_pause", boundary=z.boundary, prepare_s=time.time() - z.started)
        for m in self.view.members.values():
            self.io.send(self.view.workers[m], {"t": "pause", "at": z.boundary})

    def _on_paused_for_resize(self, z: Resize, rank: int, step: int) -> None:
        z.paused[rank] = step
        if rank == 0 and step == z.boundary and not z.boundary_reqs:
            # rank 0's step S is complete: the joiners' nodes fetch it while the others finish theirs
            for i, sid in enumerate(z.joiners):
                node, new_rank = self.view.node_of(sid), self.view.world_size + i
                req = self._fetch_early(node, 0, step, self.view.rank_node[0], as_rank=new_rank)
                z.boundary_reqs[new_rank] = req
        if len(z.paused) < self.view.world_size:
            return
        if set(z.paused.values()) != {z.boundary}:
            self._abort_resize(f"ranks stopped at steps {sorted(set(z.paused.values()))}, not {z.boundary}")
            return
        self._grow(z)

    def _grow(self, z: Resize) -> None:
        """Every rank stopped after the boundary step: a new generation with the joiners as ranks
        ``world_size..``; they fetch the boundary step from rank 0's memory. Nothing rolls back."""
        assert z.boundary is not None
        step = z.boundary
        self._open_generation()
        z.generation = self.view.generation
        old_world = self.view.world_size
        self.view.world_size = z.new_world_size
        new_ranks = list(range(old_world, self.view.world_size))
        for rank, sid in zip(new_ranks, z.joiners, strict=True):
            w = self.view.workers[sid]
            w.role, w.rank = Role.WORKER, rank
            w.last_progress, w.stepped = time.monotonic(), False
            self.view.members[rank] = sid
            self.view.rank_node[rank] = self.view.node_of(sid)
        r = self._boundary_generation(step, {rank: "grow" for rank in new_ranks}, fresh=set(new_ranks))
        self._step_at.clear()
        source = self.view.rank_node[0]
        fetches = {
            rank: self._fetch_for(r, rank, step, source, "local", src_rank=0, early=z.boundary_reqs.get(rank))
            for rank in new_ranks
        }
        self.events.emit(
            "grow",
            world_size=self.view.world_size,
            old_world_size=old_world,
            boundary=step,
            shards={
                str(k): list(sh) for k, sh in enumerate(assign_shards(self.num_shards, self.view.world_size))
            },
        )
        self._launch(r, tier="memory", fetches=fetches, grow=new_ranks)

    def _resize_done(self, z: Resize) -> None:
        self.resize = None
        self.events.emit(
            "grow_done", world_size=self.view.world_size, boundary=z.boundary, seconds=time.time() - z.started
        )

    def _abort_resize(self, why: str) -> None:
        z = self.resize
        if z is None:
            return
        self.resize = None
        for req in z.boundary_reqs.values():
            self._early.pop(req, None)  # a late answer is ignored like any stale fetch
        self._grow_retry_at = time.monotonic() + GROW_RETRY_S
        for sid in z.joiners:
            w = self.view.workers.get(sid)
            if w is None or w.role is not Role.JOINER:
                continue
            if sid in z.fetches.values():
                w.role = Role.SPARE  # not told anything yet: idle again
            else:  # it took the rank in its script (prepare): replace it with a fresh spare
                w.role = Role.RETIRED
                self.io.kill(sid, signal.SIGKILL)
                if self.view.nodes[w.node].alive:
                    self.io.spawn(w.node, Role.SPARE, None)
        for req in z.fetches:
            self.io.done(req)
        if z.generation is None:
            for sid in self.view.members.values():  # ranks waiting at the boundary go on as before
                self.io.send(self.view.workers[sid], {"t": "continue"})
        self.events.emit("grow_aborted", boundary=z.boundary, error=why)

    # -- the control store (--store etcd://; runtime/jobstore.py) ---------------------------------
    # -- durable persistence of several nodes (runtime/persistence.py) ---------------------------
    def _placement(self) -> dict[str, list[int]]:
        placement: dict[str, list[int]] = {}
        for rank in range(self.view.world_size):
            placement.setdefault(self.view.rank_node[rank], []).append(rank)
        return placement

    def _persist(self) -> None:
        """Check the persist round in flight; start the next one when due (RUNNING only)."""
        rounds = self.rounds
        if rounds is None or self.store.awaiting:
            return
        rounds.check(set(self._alive_nodes()))
        if self._may_start(Op.PERSIST) and len(self.view.latest_step) == self.view.world_size:
            if rounds.wanted(self.committed()):
                rounds.start(self.committed(), self._placement())

    def _final_persist(self) -> None:
        """Before the nodes are released: make the newest step every rank holds durable (the
        final step of a finished job, else the committed step), waiting at most persist_timeout_s."""
        rounds = self.rounds
        if rounds is None or len(self.view.latest_step) < self.view.world_size:
            return
        if any(not self.view.nodes[n].alive for n in self._placement()):
            return  # a rank's memory is gone with its node: the last committed checkpoint stands
        step = min(self.view.latest_step.values()) if self.view.phase is JobState.DONE else self.committed()
        if rounds.round is not None and rounds.round.step != step:
            rounds.abort(f"superseded by the final persist of step {step}")
        if rounds.round is None and rounds.last_step != step:
            rounds.request()
            rounds.start(step, self._placement())
        deadline = time.monotonic() + self.config.persist_timeout_s
        while rounds.round is not None and time.monotonic() < deadline:
            self._pump_events(TICK_S)
            rounds.check(set(self._alive_nodes()))
        if rounds.round is not None:
            rounds.abort(f"the final persist did not finish in {self.config.persist_timeout_s:g}s")
        if rounds.last_step != step:
            log.warning("final persist of step %d failed: %s", step, rounds.last_error)
        self._answer_clients()

    # -- the end -----------------------------------------------------------------------------------
    def _finish(self) -> None:
        """Every rank has the final step snapshotted: release members and spares."""
        if self.migration is not None:
            self._abort_migration("the job finished first")
        for rank in [q[0] for q in self._migrate_queue]:
            self._answer_migration(rank, ok=False, error="the job finished first")
        self._migrate_queue.clear()
        self._set_state(JobState.FINISHING)
        self.events.emit(
            "finish", step=min(self.view.latest_step.values(), default=0), generation=self.view.generation
        )
        for w in self.view.workers.values():
            self.io.send(w, {"t": "finish"})

    def _members_alive(self) -> bool:
        return self.view.members_alive()

    def _replenish_spares(self) -> None:
        for name in self._alive_nodes():
            node = self.view.nodes[name]
            if node.draining:
                continue
            have = self.view.spares_on(name)
            want = node.spares - have
            if self.elastic.enabled:  # a node has room for nproc + spares processes, no more
                ranks_here = sum(1 for r in self.view.members if self.view.rank_node.get(r) == name)
                want = min(want, node.nproc + node.spares - ranks_here - have)
            for _ in range(want):
                self.io.spawn(name, Role.SPARE, None)


def _transfer(msg: Message) -> Transfer:
    """A fetch's measurement from an agent's ``fetched`` answer."""
    return Transfer(
        raw_bytes=int(msg.get("raw_bytes") or 0),
        wire_bytes=int(msg.get("wire_bytes") or 0),
        seconds=float(msg.get("seconds") or 0.0),
    )


def _previous(stage: Stage) -> str:
    return {
        Stage.LAUNCH: "plan",
        Stage.RESTORE: "launch",
        Stage.REBUILD: "restore",
        Stage.RESUME: "rebuild",
        Stage.DONE: "resume",
    }.get(stage, "plan")
