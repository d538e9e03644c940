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
from nonstop.errors import ControlError
from nonstop.faults import fired_at
from nonstop.runtime.detector import FailureDetector
from nonstop.runtime.elastic import (
    ElasticPolicy,
    assign_shards,
)
from nonstop.runtime.eventlog import EventLog
from nonstop.runtime.executor import Executor
from nonstop.runtime.generations import Generations
from nonstop.runtime.jobstore import JobStore
from nonstop.runtime.persistence import ClusterPersister
from nonstop.runtime.phase import Busy, JobPhase, Op, legal, may_start
from nonstop.runtime.policy import (
    FailureKind,
    QuarantinePolicy,
    classify_exit,
    describe_exit,
)
from nonstop.runtime.recovery import Failure, Stage
from nonstop.runtime.replication import ReplicationRounds
from nonstop.runtime.storesync import StoreSync
from nonstop.runtime.swapops import Swaps
from nonstop.runtime.view import JobView, NodeRecord, Role, WorkerRecord
from nonstop.snapshot.persist import Persister

__all__ = ["Coordinator", "JobResult", "JobState", "NodeRecord"]

log = logging.getLogger(__name__)

TICK_S = 0.005
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
        # replicating: the held replicated step, the one a round is sending, the newest, one to write
        self.num_slots = 4 if config.replicas > 0 and config.nnodes > 1 else 2
        self.detector = FailureDetector(config.detector)
        self.quarantine = QuarantinePolicy(
            max_failures=config.quarantine_failures, window_s=config.quarantine_window_s
        )
        self.error: str | None = None
        self.clients: dict[int, Channel] = {}
        self.client_tickets: list[tuple[Channel, int]] = []
        self.kv = KeyValueTable()
        self._exits: list[_Exit] = []
        self.replication = ReplicationRounds(
            view=self.view, io=self.io, events=events, replicas=config.replicas
        )
        self._started_at = time.monotonic()
        # store mode (--store etcd://): state saved in and restored from the control store
        self.store = StoreSync(self, jobs)
        # generations: planning, launching and timing every membership change
        self.gens = Generations(self, initial_step=initial_step)
        # live migrations and elastic grows: boundary swaps (runtime/swap.py, runtime/swapops.py)
        self.swaps = Swaps(self)

    def adopt_view(self, view: JobView) -> None:
        """Replace the view (a coordinator restarted from its record): every operation sees it."""
        self.view = self.io.view = self.replication.view = view

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
                self.fail("stopped by signal")
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
        self.gens.check_timeouts()
        if self.replication_on and self.may_start(Op.REPLICATE):
            self.replication.maybe_start(now=time.monotonic())
        self._persist()
        self.swaps.tick()
        self.gens.replan_tick()
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
            self.fail(
                f"only {len(alive)} of {self.config.nnodes} nodes joined within "
                f"{self.config.join_timeout_s:g}s; start `nonstop run --node-rank I` on every node"
            )

    def _start_job(self, nodes: list[str]) -> None:
        self.events.emit("nodes_joined", nodes=nodes)
        if self.gens.initial_step is not None:
            placement = {
                n: list(range(i * self.config.nproc_per_node, (i + 1) * self.config.nproc_per_node))
                for i, n in enumerate(nodes)
            }
            url = self.config.resume or self.durable_url
            if url is None or not self.gens.install_durable(self.gens.initial_step, placement, url):
                self.fail(
                    f"could not install the resumed checkpoint step {self.gens.initial_step} on every node"
                )
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
        if self.gens.reconf is not None:
            busy.add(Busy.RESUMING)
        if self.swaps.swapping:
            busy.add(Busy.SWAPPING)
        if self.swaps.migration is not None or self.swaps.queue:
            busy.add(Busy.MIGRATING)
        if self.swaps.grow is not None:
            busy.add(Busy.GROWING)
        if self.store.awaiting:
            busy.add(Busy.RESYNCING)
        if self.view.done_ranks:
            busy.add(Busy.ENDING)
        return busy

    def may_start(self, op: Op) -> bool:
        return may_start(op, self.view.phase, self._busy())

    def fail(self, error: str) -> None:
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
                self.lose_node(node, f"its agent broke the protocol ({what})")
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
                    self.lose_node(node, "its agent's connection closed")
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
            self.gens.on_fetched(node, msg)
        elif t == "replicated":
            self.replication.on_replicated(node.name, msg)
        elif t == "preempt":
            self.swaps.on_preempt(node, float(msg.get("grace_s", 0.0)))
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
        self.io.node_lost(node.name, keep=set(self.gens.waiting_fetch))  # fetches end with the generation
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
                error = self.swaps.request_migration(rank, target, reason)
                if error is not None:
                    chan.send({"t": "migrated", "rank": rank, "ok": False, "error": error})
                else:
                    self.swaps.clients.setdefault(rank, []).append(chan)
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
            **self.swaps.status(),
            "num_shards": self.num_shards,
            "full_world_size": self.config.world_size,
            "min_world_size": self.elastic.min_world_size,
            "shards": {
                str(r): list(sh) for r, sh in enumerate(assign_shards(self.num_shards, self.view.world_size))
            },
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
                self.gens.begin([])
            return
        r = self.gens.reconf
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
            self.gens.maybe_reconfigure(w.rank)
            self.gens.advance()

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
        if t == "restored" and self.swaps.on_restored(w):
            return  # a joiner prepared its rank
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
            self.swaps.on_step(rank, int(msg["step"]))
            if self.gens.reconf is not None:
                self.gens.reconf.stepped.add(rank)
                self.gens.advance()
        elif t == "restored" and self.gens.reconf is not None:
            self.gens.reconf.restored.add(rank)
            self.gens.advance()
        elif t == "ready" and self.gens.reconf is not None:
            self.gens.reconf.ready.add(rank)
            w.last_progress = now
            if self.gens.reconf.restore_step is None:  # a fresh start: step 0 is snapshotted (replicable)
                self.view.latest_step.setdefault(rank, 0)
            self.gens.advance()
        elif t == "done":
            self.view.latest_step[rank] = int(msg["step"])
            self.view.done_ranks.add(rank)
            if self.gens.reconf is not None:
                self.gens.reconf.stepped.add(rank)
                self.gens.advance()
            if self.view.phase is JobState.RUNNING and self.view.done_ranks >= set(
                range(self.view.world_size)
            ):
                self.finish()
        elif t == "migrate":
            error = self.swaps.request_migration(rank, msg.get("to"), "migrate")
            if error is not None:
                self.events.emit("migration_refused", rank=rank, target=msg.get("to"), reason=error)
        elif t == "paused":
            self.swaps.on_paused(rank, int(msg["step"]))
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
            self.swaps.on_exit(sid, member=is_member, how=describe_exit(rc))
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
                self.fail(f"{who} exited with {describe_exit(rc)} before joining the job: {hint}")
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
            self.lose_node(
                node,
                f"{len(node.failure_times)} failures within {self.quarantine.window_s:g}s: quarantined",
                quarantine=True,
            )

    def _on_failures(self, failures: list[Failure]) -> None:
        self.swaps.abort(f"rank {failures[0].rank} failed: {failures[0].detail}")
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
            self.fail(
                f"restart budget exhausted ({self.config.max_restarts} restarts); last failure: "
                f"rank {failures[-1].rank} {failures[-1].detail}"
            )
            return
        if self.gens.deferred is not None:
            before, replans, replacements = self.gens.deferred
            self.gens.deferred, self.gens.replan_at = None, None
            self.gens.begin(before + failures, replans=replans + 1, replacements=replacements)
            return
        previous = self.gens.reconf if self.view.phase is JobState.RECONFIGURING else None
        if previous is None:
            self.gens.begin(failures)
        else:  # a failure during a recovery: re-plan, keeping what the interrupted plan did
            self.gens.begin(
                previous.failures + failures, replans=previous.replans + 1, replacements=previous.replacements
            )

    def _detect(self) -> None:
        if self.view.phase not in (JobState.RUNNING, JobState.RECONFIGURING):
            return
        in_training = self.view.phase is JobState.RUNNING or (
            self.gens.reconf is not None and self.gens.reconf.stage is Stage.RESUME
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

    # -- planning ---------------------------------------------------------------------------------
    def await_replies(self, reqs: list[int], timeout: float) -> dict[int, Message]:
        """Wait for the replies to ``reqs`` while serving every other event (leases included)."""
        deadline = time.monotonic() + timeout
        while any(r not in self.io.replies for r in reqs) and time.monotonic() < deadline:
            self._pump_events(0.002)
            self._check_leases()
        out = {r: self.io.replies.pop(r) for r in reqs if r in self.io.replies}
        for r in reqs:
            self.io.done(r)
        return out

    def _idle_spares(self) -> dict[int, str]:
        """Connected hot spares waiting for a rank: spawn id -> node."""
        return self.view.idle_spares()

    def committed(self) -> int:
        """The committed step: what is replicated to peers (with replication), else in memory."""
        if self.replication_on and self.view.replicated_step is not None:
            return self.view.replicated_step
        return min((self.view.latest_step.get(rank, 0) for rank in range(self.view.world_size)), default=0)

    # -- live migration (runtime/migration.py) -----------------------------------------------------
    # -- elasticity (runtime/elastic.py) -------------------------------------------------------------
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
        if self.may_start(Op.PERSIST) and len(self.view.latest_step) == self.view.world_size:
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
    def finish(self) -> None:
        """Every rank has the final step snapshotted: release members and spares."""
        self.swaps.finish()
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
