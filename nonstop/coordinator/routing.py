"""The coordinator's switchboard: which operation handles each event of the control server and
each decoded message, in one place.

=====================  ===================================================================
control server event   handled by
=====================  ===================================================================
a client's hello       :class:`~nonstop.coordinator.client_requests.ClientRequests` (its channels)
a client's request     ``ClientRequests.on_request``
an agent's hello       :meth:`NodeAgents.on_open <nonstop.coordinator.node_agents.NodeAgents.on_open>`
an agent's message     :meth:`Routes.agent_message` (the table below)
an agent's close       ``NodeAgents.on_close``
a worker's hello       :meth:`WorkerProtocol.on_open <nonstop.coordinator.workers.WorkerProtocol.on_open>`
a worker's message     :meth:`Routes.worker_message` (fenced by ``WorkerProtocol.admit``)
a worker's close       ``WorkerProtocol.on_close``
=====================  ===================================================================

A message its (authenticated) sender built wrong -- a missing or mistyped field -- fails that
sender only (:meth:`Routes.dispatch`): a client gets an error, a worker's channel is closed (the
detector then recovers its rank), an agent's node is lost. The coordinator goes on either way.

Threading: the coordinator's thread only. I/O through the executor.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.control.channel import Channel, Message
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import NodeRecord, WorkerRecord
from nonstop.errors import ControlError
from nonstop.policy import reconfiguration as recovery
from nonstop.protocol.agent import (
    ExitMsg,
    FatalMsg,
    FetchedMsg,
    InstalledMsg,
    InventoryMsg,
    JudgedMsg,
    LeaseMsg,
    PreemptMsg,
    RegisteredMsg,
    ReplicatedMsg,
    SpawnedMsg,
    decode_agent,
)
from nonstop.protocol.base import HealthMsg, MigrateMsg, RawMsg, kind_of, role_of
from nonstop.protocol.client import ErrorMsg
from nonstop.protocol.worker import (
    DoneMsg,
    FaultMsg,
    HeartbeatMsg,
    InjectedMsg,
    PausedMsg,
    ReadyMsg,
    RestoredMsg,
    StepMsg,
    SubscribeMsg,
    decode_worker,
)

if TYPE_CHECKING:
    from nonstop.control.rdzv import KeyValueTable
    from nonstop.coordinator.client_requests import ClientRequests
    from nonstop.coordinator.detector import FailureDetector
    from nonstop.coordinator.event_feed import EventFeed
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.failures import Failures
    from nonstop.coordinator.health import Health
    from nonstop.coordinator.metrics import JobMonitor
    from nonstop.coordinator.node_agents import NodeAgents
    from nonstop.coordinator.peers import LaunchWatch
    from nonstop.coordinator.persistence import ClusterPersister
    from nonstop.coordinator.replication import ReplicationRounds
    from nonstop.coordinator.resizing import Resizing
    from nonstop.coordinator.restore_sources import RestoreSources
    from nonstop.coordinator.swaps import Swaps
    from nonstop.coordinator.view import JobView
    from nonstop.coordinator.workers import Fenced, WorkerProtocol
    from nonstop.events.log import EventLog

__all__ = ["Routes", "fence_rendezvous"]

log = logging.getLogger(__name__)

MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError)
"""What a message built wrong raises while it is decoded or handled (``WireError`` is a ``ValueError``)."""


class Routes:
    """The routing of the control server's events to the operations (see the module docstring).
    It holds the operations that handle messages; it decides nothing but who handles what.
    ``monitor``: the metrics hook, read at each step report (``--metrics-port`` sets it after
    the coordinator is built)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        agents: NodeAgents,
        workers: WorkerProtocol,
        clients: ClientRequests,
        failures: Failures,
        health: Health,
        swaps: Swaps,
        sources: RestoreSources,
        replication: ReplicationRounds,
        rounds: ClusterPersister | None,
        setup: LaunchWatch,
        resize: Resizing,
        kv: KeyValueTable,
        feed: EventFeed,
        detector: FailureDetector,
        monitor: Callable[[], JobMonitor | None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.agents = agents
        self.workers = workers
        self.clients = clients
        self.failures = failures
        self.health = health
        self.swaps = swaps
        self.sources = sources
        self.replication = replication
        self.rounds = rounds
        self.setup = setup
        self.resize = resize
        self.kv = kv
        self.feed = feed
        self.detector = detector
        self.monitor = monitor

    # -- the control server's events -------------------------------------------------------------
    def dispatch(self, kind: str, chan: Channel, msg: Message | None) -> None:
        """Handle one event (``open``, ``msg``, ``close``) from the control server; a malformed
        message fails its sender only (:meth:`protocol_error`)."""
        try:
            self.on_event(kind, chan, msg)
        except MALFORMED as e:
            self.protocol_error(chan, msg, e)

    def on_event(self, kind: str, chan: Channel, msg: Message | None) -> None:
        role = role_of(chan.hello)
        if kind == "open" and role == "client":
            chan.tag = ("client", len(self.clients.channels))
            self.clients.channels[len(self.clients.channels)] = chan
            self.events.emit(ev.Client(peer=chan.peer))
            return
        if kind == "open" and role == "agent":
            self.agents.on_open(chan)
            return
        tag = chan.tag
        if isinstance(tag, tuple) and tag[0] == "client":
            if kind == "msg" and msg is not None:
                self.clients.on_request(chan, msg)
            return
        if isinstance(tag, tuple) and tag[0] == "node":
            node = self.view.nodes.get(tag[1])
            if node is None or node.chan is not chan:
                return
            if kind == "msg" and msg is not None:
                self.agent_message(node, msg)
            elif kind == "close":
                self.agents.on_close(node)
            return
        if kind == "open":
            self.workers.on_open(chan)
            return
        w = self.workers.worker_of(chan)
        if w is None:
            return
        if kind == "msg" and msg is not None:
            self.worker_message(w, msg)
        elif kind == "close":
            self.workers.on_close(w)

    def protocol_error(self, chan: Channel, msg: Message | None, e: Exception) -> None:
        """``chan``'s peer sent ``msg``, which raised ``e``: an agent's node is lost, a worker's
        channel closed (its rank then recovered), a client answered an error; logged either way."""
        what = f"{type(e).__name__}: {e}"
        t = kind_of(msg) if msg is not None else None
        log.warning("malformed %r message from %s: %s", t, chan.peer, what, exc_info=True)
        tag = chan.tag
        who: dict[str, Any] = {"peer": chan.peer, "message": t, "error": what}
        if isinstance(tag, tuple) and tag[0] == "node" and tag[1] in self.view.nodes:
            who["node"] = tag[1]
            self.events.emit(ev.ProtocolError(**who))
            node = self.view.nodes[tag[1]]
            if node.alive and node.chan is chan:
                self.agents.lose_node(node, f"its agent broke the protocol ({what})")
            return
        if isinstance(tag, int) and tag in self.view.workers:
            w = self.view.workers[tag]
            who.update(spawn_id=tag, rank=w.rank)
            self.events.emit(ev.ProtocolError(**who))
            if w.chan is chan:  # the detector fails it once the channel has been closed a moment
                w.chan_closed_at = self.clock.monotonic()
            self.io.close(chan)
            return
        self.events.emit(ev.ProtocolError(**who))
        if isinstance(tag, tuple) and tag[0] == "client":
            self.io.tell(chan, ErrorMsg(error=f"malformed request: {what}").encode())
        self.io.close(chan)

    # -- an agent's messages --------------------------------------------------------------------------
    def agent_message(self, node: NodeRecord, msg: Message) -> None:
        """One message from ``node``'s agent, decoded, to the operation that owns it."""
        m = decode_agent(msg)
        match m:
            case LeaseMsg():
                self.agents.on_lease(node, m)
            case ExitMsg():
                self.agents.on_exited(m)
            case JudgedMsg():
                self.failures.on_judged(m.spawn_id, hung=m.hung, detail=m.detail)
            case SpawnedMsg():
                self.agents.on_spawned(node, m)
            case InventoryMsg() | InstalledMsg():
                self.io.on_reply(m)
            case FetchedMsg() if self.swaps.owns(m.id):  # a swap's prepare or catch-up fetch
                self.swaps.on_fetched(m)
            case FetchedMsg():
                self.sources.on_fetched(node, m)
            case ReplicatedMsg():
                self.replication.on_replicated(node.name, m)
            case PreemptMsg():
                self.swaps.on_preempt(node, m.grace_s)
            case RegisteredMsg():
                self.agents.on_registered(node, m)
            case FatalMsg():
                self.agents.on_fatal(node, m)
            case HealthMsg():  # issue 21: its probes' verdict (agent/probes.py)
                self.health.on_probe(node.name, m.verdict, probe=m.probe, detail=m.detail)
            case RawMsg() if self.rounds is not None:  # a persist round's answer
                self.rounds.on_reply(node.name, dict(m.msg))

    # -- a worker's messages ------------------------------------------------------------------------
    def worker_message(self, w: WorkerRecord, msg: Message) -> None:
        """One message from worker ``w``, decoded. Heartbeats, fault timestamps, health verdicts,
        subscriptions, a usage fault and a joiner's preparation count from any of its processes;
        everything else only from a member of the current generation (the fence)."""
        m = decode_worker(msg)
        now = self.clock.monotonic()
        match m:
            case HeartbeatMsg():
                self.workers.on_heartbeat(w, m, now)
            case InjectedMsg():
                self.workers.on_injected(w, m)
            case HealthMsg():  # issue 21: any process on a node speaks for it
                self.health.on_probe(w.node, m.verdict, probe=m.probe, detail=m.detail)
            case SubscribeMsg():  # any process, any generation: Session.on_event
                if w.chan is not None:
                    self.feed.subscribe(w.spawn_id, w.chan, m.kinds)
            case FaultMsg() if m.usage:  # the script's mistake, from any of its processes
                self.workers.on_usage_fault(w, m)
            case RestoredMsg() if self.swaps.on_restored(w):
                pass  # a joiner prepared its rank
            case None:
                pass  # a kind this coordinator does not know
            case _:
                rank = self.workers.admit(w, m, msg)
                if rank is not None:
                    self._member_message(w, rank, m, now)

    def _member_message(self, w: WorkerRecord, rank: int, m: Fenced, now: float) -> None:
        """A message of ``rank``'s, past the fence."""
        match m:
            case ReadyMsg():
                if m.layouts is not None and rank == 0:
                    self.resize.layouts = m.layouts  # what a later reshard plans its fetches by
                self.workers.on_ready(w, rank, m, now)
            case RawMsg():
                self._rendezvous(w, m)
            case StepMsg() if m.again:  # its timing was reported already: only the snapshot
                self.workers.on_snapshot_again(rank, m)
            case StepMsg():
                self.workers.on_step(w, rank, m, now)
                self.detector.record_step(m.step_s)
                self.swaps.on_step(rank, m.step)
                self.health.on_step(w, rank, m)  # issue 21: compute time (step_s - wait_s) for fail-slow
                self.setup.report(recovery.Stepped(rank, self.clock.wall()))
                monitor = self.monitor()
                if monitor is not None:
                    monitor.on_step(rank, m.step_s, m.snap_s, m.nbytes)
                self.workers.tune(m, rank)
            case RestoredMsg():
                self.setup.report(recovery.Restored(rank, self.clock.wall()))
            case DoneMsg():
                self.workers.on_done(rank, m)
            case MigrateMsg():
                error = self.swaps.request_migration(rank, m.to, "migrate")
                if error is not None:
                    self.events.emit(ev.MigrationRefused(rank=rank, target=m.to, reason=error))
            case PausedMsg():
                self.swaps.on_paused(rank, m.step)
            case FaultMsg():
                self.workers.on_fault(w, rank, m, now)

    def _rendezvous(self, w: WorkerRecord, m: RawMsg) -> None:
        """A rendezvous request (``kv``) of a member: the table's answers, to it and to the calls
        it released (a reply to a channel that broke is dropped)."""
        chan = w.chan
        assert chan is not None
        for reply, out in self.kv.handle(dict(m.msg), functools.partial(self.io.answer, chan)):
            try:
                reply(out)
            except ControlError:
                pass


def fence_rendezvous(kv: KeyValueTable) -> Callable[[int], None]:
    """What a new generation does to the rendezvous: drop the older keys and fail the calls
    parked on them (a worker gone meanwhile is not told)."""

    def fence(generation: int) -> None:
        for reply, msg in kv.new_generation(generation):
            try:
                reply(msg)
            except ControlError:
                pass

    return fence
