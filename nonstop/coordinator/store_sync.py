"""Store mode (``--store etcd://``): the coordinator leads the job through the control store,
saves its record there every loop, and a restarted coordinator resumes from it.

* **lead**: wait out a dead predecessor's ``leader`` lease, then hold it (losing it ends this
  process: another coordinator may be acting);
* **record**: the whole :class:`~nonstop.coordinator.view.JobView` plus the operations in flight
  (a migration or grow: its joiners, whether they took the rank, whether it swapped) and the
  migration queue, saved whenever it changed;
* **resume**: the view comes back from the record; nodes whose lease lived on are awaited
  (their agents reconnect), the others are lost; once every node is back, an interrupted
  recovery is redone from the nodes' inventories, an unswapped migration or grow is aborted
  cleanly, and paused ranks are told to go on when they reconnect;
* **leases**: a node's lease in the store ending (a watch) loses the node -- unless the node is
  still heard over its channel (a store stall, or the node cut off from the store): then it is
  kept while it is heard, and lost once it has not been for a whole lease TTL; its agent
  registers a new lease meanwhile (agent/node.py);
* **stalls**: records are written and leases revoked by a :class:`~nonstop.control.jobstore.
  RecordWriter` thread, so the loop that acknowledges the nodes never waits on the store; the
  leader lease is ``leader_ttl`` long, the stall the coordinator rides through.

Threading: the coordinator's thread only (the lease keeper and the watch have their own); sends,
kills and spawns through its executor.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.control.channel import Channel
from nonstop.control.jobstore import JobStore, RecordWriter
from nonstop.control.store import LeaseKeeper, Watch
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import JobView, NodeRecord, Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.policy.phase import Busy, JobPhase
from nonstop.protocol.agent import AgentHelloMsg, NodeWelcomeMsg
from nonstop.protocol.worker import ContinueMsg, FinishMsg, ResumeMsg

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import CadenceResume, NodeLoss, Resync, SwapRecord
    from nonstop.events.log import EventLog

__all__ = ["EXIT_NOT_LEADER", "StoreSync"]

log = logging.getLogger(__name__)

EXIT_NOT_LEADER = 76  # store mode: this coordinator lost its leadership lease and stopped
LEADER_TTL_MIN_S = 10.0  # the leader lease: the longest control-store stall a coordinator rides


def process_age_s() -> float:
    """Seconds since this process started (0 where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def leader_ttl(lease_ttl_s: float) -> float:
    """The coordinator's leader lease for nodes' leases of ``lease_ttl_s``: long enough to ride
    through a store stall of 0.9 x ``LEADER_TTL_MIN_S`` (it is refreshed every tenth of it; a dead
    coordinator's successor on the same host does not wait it out: it revokes it)."""
    return max(LEADER_TTL_MIN_S, 3 * lease_ttl_s)


class StoreSync:
    """The coordinator's side of the control store (see the module docstring); inert when the
    job has no store (``jobs`` None).

    ``address``: the coordinator's control server, as the leader key names it;
    ``lease_ttl_s``: the nodes' leases (``--lease-ttl``); ``reconnect_s``: how long a node may be
    away (``--reconnect``); ``store_url``: ``--store``, as errors name it. ``swaps``: their part
    of the record.

    The node agents (a node whose lease ended is lost), the workers' protocol (a member's resume
    point) and the generations (a restored recovery is redone through them) come late, by
    :meth:`bind`: the first two call back into the store sync (a node reattaches, its lease is
    revoked; a worker resumes), and the generations are built after the node agents, so all
    three are built after it; :meth:`bind` is called once, before :meth:`open`."""

    nodes: NodeLoss
    workers: CadenceResume
    gens: Resync

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        jobs: JobStore | None,
        address: tuple[str, int],
        lease_ttl_s: float,
        reconnect_s: float,
        store_url: str,
        swaps: SwapRecord,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.address = address
        self.lease_ttl_s = lease_ttl_s
        self.reconnect_s = reconnect_s
        self.store_url = store_url
        self.swaps = swaps
        self.jobs = jobs
        self.leader: LeaseKeeper | None = None
        self.node_watch: Watch | None = None
        self.awaiting: dict[str, float] = {}  # restored nodes not reconnected yet -> since
        self.lapsed: dict[str, float] = {}  # nodes whose store lease ended while heard -> since
        self.writer: RecordWriter | None = None
        self.resync = False  # restored mid-recovery: start a new generation once nodes are back
        # restored: operations the previous coordinator had in flight, and the members to tell
        # to go on once they reconnect (they may be paused at a boundary)
        self.interrupted: dict[str, dict[str, Any]] = {}
        self.continue_on_resume: set[int] = set()

    def bind(self, *, nodes: NodeLoss, workers: CadenceResume, gens: Resync) -> None:
        """The peers that are built after the store sync (see the class docstring)."""
        self.nodes = nodes
        self.workers = workers
        self.gens = gens

    def busy(self) -> set[Busy]:
        """Restored nodes not reconnected yet hold back what needs every node."""
        return {Busy.RESYNCING} if self.awaiting else set()

    def open(self) -> None:
        """Lead the job (waiting out a dead predecessor's lease), restore its record if there is
        one, and watch the nodes' leases."""
        assert self.jobs is not None
        addr = f"{self.address[0]}:{self.address[1]}"
        t0 = self.clock.monotonic()
        ttl = leader_ttl(self.lease_ttl_s)
        self.leader = self.jobs.lead(
            addr,
            ttl,
            timeout=max(30.0, 3 * ttl),
            on_lost=lambda why: os._exit(EXIT_NOT_LEADER),  # another coordinator may be acting now
        )
        if self.jobs.took_over_dead:
            # The predecessor is gone, maybe only just: its nodes may still be playing their
            # ranks until they notice (FENCE_AT of a lease TTL). Which leases live is read a TTL
            # after it died -- at least this process's age ago (it was started after).
            time.sleep(max(0.0, self.lease_ttl_s - process_age_s()))
        live, rev = self.jobs.live_nodes()
        self.node_watch = self.jobs.watch_nodes(rev + 1)
        record = self.jobs.load()
        self.writer = RecordWriter(self.jobs)
        if record is None:
            self.events.emit(ev.CoordinatorLeads(address=addr, waited_s=self.clock.monotonic() - t0))
            return
        self.restore(record, live)
        self.events.emit(
            ev.CoordinatorResumed(
                address=addr,
                waited_s=self.clock.monotonic() - t0,
                generation=self.view.generation,
                state=str(self.view.phase),
                nodes=sorted(self.awaiting),
                lost=sorted(n for n, r in self.view.nodes.items() if not r.alive),
            )
        )

    def close(self) -> None:
        if self.jobs is None:
            return
        if self.writer is not None:
            self.writer.save(self.record())
            if not self.writer.close(timeout=max(5.0, self.lease_ttl_s)):
                log.warning("the final job record did not reach the control store")
        if self.node_watch is not None:
            self.node_watch.cancel()
        if self.leader is not None:
            try:
                self.leader.stop(revoke=True)  # the next coordinator need not wait out the TTL
            except ControlError:
                pass

    def tick(self) -> None:
        """Store mode, every loop: nodes whose lease ended are lost; restored nodes that did not
        come back in time are revoked; a restored recovery restarts once the nodes are back;
        the record is saved when it changed."""
        if self.jobs is None:
            return
        assert self.node_watch is not None
        while True:
            try:
                change = self.node_watch.get(timeout=0)
            except ControlError as e:
                self.life.fail(f"lost the watch on the nodes' leases in {self.store_url}: {e}")
                return
            if change is None:
                break
            node = self.view.nodes.get(self.jobs.node_name(change.key))
            if node is None or not node.alive:
                continue
            if change.kind == "delete":
                self.on_lease_ended(node)
            elif node.name in self.lapsed:
                since = self.lapsed.pop(node.name)
                self.events.emit(ev.NodeLeaseRenewed(node=node.name, lapsed_s=self.clock.monotonic() - since))
        now = self.clock.monotonic()
        for name, since in list(self.lapsed.items()):
            node = self.view.nodes[name]
            if not node.alive:
                del self.lapsed[name]
            elif not self.hears(node, now):
                del self.lapsed[name]
                self.awaiting.pop(name, None)
                self.nodes.lose_node(
                    node, f"its lease in the control store ended {now - since:.1f}s ago and it is not heard"
                )
        for node in self.view.nodes.values():
            gone_since = self.awaiting.get(node.name, node.disconnected_at)
            if node.alive and gone_since is not None and now - gone_since > self.reconnect_s:
                if node.lease_id:
                    self.revoke(node)  # its agent fences; the delete event then loses the node
                else:
                    self.awaiting.pop(node.name, None)
                    self.nodes.lose_node(node, f"did not reconnect within {self.reconnect_s:g}s")
        if self.interrupted and not self.awaiting:
            self.end_interrupted()
        if self.resync and not self.awaiting and self.view.phase is not JobPhase.FAILED:
            self.resync = False
            if self.view.members:
                self.gens.begin([], inventory_needed=True)
        assert self.writer is not None
        self.writer.save(self.record())

    def hears(self, node: NodeRecord, now: float) -> bool:
        """The node's channel is up and its last lease renewal arrived within a lease TTL."""
        return (
            node.chan is not None
            and node.disconnected_at is None
            and now - node.last_lease <= self.lease_ttl_s
        )

    def on_lease_ended(self, node: NodeRecord) -> None:
        """``node``'s key in the store was deleted (its lease expired or was revoked)."""
        now = self.clock.monotonic()
        if self.hears(node, now) and not node.quarantined:
            if node.name not in self.lapsed:
                self.lapsed[node.name] = now
                self.events.emit(ev.NodeLeaseLapsed(node=node.name, heard_s_ago=now - node.last_lease))
            return
        self.awaiting.pop(node.name, None)
        self.nodes.lose_node(node, "its lease in the control store ended")

    def end_interrupted(self) -> None:
        """A migration or grow the previous coordinator had in flight (every node is back now):
        one that had not swapped yet is aborted -- a joiner that took the rank in its script is
        replaced by a fresh spare, one that had not is idle again, ranks paused at the boundary
        go on; one that had swapped is finished by the resync generation (its joiners are
        members). Queued migrations were queued again by ``restore``."""
        why = "the coordinator restarted"
        v = self.view
        for kind, op in sorted(self.interrupted.items()):
            if op.get("swapped"):
                self.events.emit(ev.OperationResumed(operation=kind, generation=v.generation))
                continue
            told = {int(sid) for sid in op.get("told", [])}
            for sid in (int(s) for s in op.get("joiners", [])):
                w = v.workers.get(sid)
                if w is None or w.role is not Role.JOINER:
                    continue
                if sid in told:
                    w.role, w.rank = Role.RETIRED, None
                    self.io.kill(sid, signal.SIGKILL)
                    node = v.nodes.get(w.node)
                    if node is not None and node.alive:
                        self.io.spawn(node.name, Role.SPARE, None)
                else:
                    w.role, w.rank = Role.SPARE, None
            self.continue_on_resume |= set(v.members.values())
            for sid in list(self.continue_on_resume):
                if v.workers[sid].chan is not None:
                    self.io.send(v.workers[sid], ContinueMsg().encode())
                    self.continue_on_resume.discard(sid)
            if kind == "migration":
                self.events.emit(ev.MigrationAborted(rank=op.get("rank"), phase=op.get("phase"), error=why))
            else:
                self.events.emit(ev.GrowAborted(boundary=None, error=why))
        self.interrupted = {}

    def revoke(self, node: NodeRecord) -> None:
        """End ``node``'s lease (on the writer's thread): its agent fences unless it still hears
        this coordinator; the delete event then loses the node."""
        assert self.writer is not None
        self.writer.revoke(node.lease_id)
        node.lease_id = 0

    def reattach(self, node: NodeRecord, chan: Channel) -> None:
        """A node's agent reconnected (to a restarted coordinator, or after its channel broke): it
        is welcomed on ``chan`` (a channel that broke meanwhile raises
        :class:`~nonstop.errors.ControlError`, as a new node's welcome does)."""
        chan.tag = ("node", node.name)
        node.chan = chan
        node.disconnected_at = None
        node.last_lease = self.clock.monotonic()
        hello = AgentHelloMsg.decode(chan.hello)
        if hello.lease_id is not None:
            node.lease_id = hello.lease_id
        if hello.data_addr is not None:
            node.data_addr = hello.data_addr
        self.awaiting.pop(node.name, None)
        welcome = NodeWelcomeMsg(job_id=self.view.job_id, resumed=True, lease_ttl_s=self.lease_ttl_s)
        self.io.answer(chan, welcome.encode())
        self.events.emit(ev.NodeReconnected(node=node.name))

    def on_worker_resumed(self, w: WorkerRecord, resume: ResumeMsg) -> None:
        """A worker reconnected after the coordinator restarted: take its progress."""
        rank = w.rank
        member = rank is not None and self.view.members.get(rank) == w.spawn_id
        if member and rank is not None and resume.gen == self.view.generation:
            self.view.latest_step[rank] = max(self.view.latest_step.get(rank, 0), resume.step)
            if resume.done:
                self.view.done_ranks.add(rank)
            self.workers.resumed_cadence(resume.cadence)
        if w.spawn_id in self.continue_on_resume:  # paused for an operation that was aborted
            self.continue_on_resume.discard(w.spawn_id)
            self.io.send(w, ContinueMsg().encode())
        if self.view.phase is JobPhase.FINISHING:
            self.io.send(w, FinishMsg().encode())  # it may have missed it
        elif self.view.phase is JobPhase.RUNNING and self.view.all_done():
            self.life.finish()

    def record(self) -> dict[str, Any]:
        """What a restarted coordinator needs to carry on (saved in the store; JSON types): the
        whole view, and the operations in flight."""
        return {
            **self.view.to_record(),
            # operations in flight: a restarted coordinator ends them cleanly (end_interrupted)
            **self.swaps.record(),
        }

    def restore(self, rec: dict[str, Any], live: set[str]) -> None:
        """Take over from a dead coordinator's record; ``live``: nodes whose lease is alive."""
        now = self.clock.monotonic()
        grace = now + min(self.reconnect_s, 10.0)  # workers reconnect before they count as hung
        self.view.adopt(JobView.from_record(rec, now=now, grace_until=grace))  # the job's id too
        for name, node in self.view.nodes.items():
            if node.alive:
                self.awaiting[name] = now
        self.interrupted = {k: rec[k] for k in ("migration", "grow") if rec.get(k)}
        self.swaps.requeue(rec, now)
        state = self.view.phase  # as the record had it
        self.view.phase = JobPhase.RUNNING if state is JobPhase.RECONFIGURING else state
        self.resync = state in (JobPhase.RECONFIGURING, JobPhase.STARTING) and bool(self.view.members)
        if self.resync:
            self.view.phase = JobPhase.RECONFIGURING
        for name in sorted(self.awaiting):
            if name not in live:  # its lease ended while no coordinator was watching
                self.awaiting.pop(name)
                self.nodes.lose_node(self.view.nodes[name], "its lease in the control store ended")
