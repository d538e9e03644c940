"""The workers' protocol on the coordinator: connections, heartbeats, step reports, the fence,
restore/ready/done reports, faults, and the snapshot interval a ``--snapshot-budget`` tunes.

A worker's connection is accepted only for a spawn id the coordinator launched, on a live node,
and not already connected (a reconnect to a restarted coordinator carries ``resume``). Every
message but heartbeats, fault timestamps, subscriptions, health verdicts, a usage fault and a
joiner's preparation is **fenced** (:meth:`WorkerProtocol.admit`): it counts only from a member
of the current generation; a rendezvous request that is fenced is answered with the reason, so
its caller does not wait.

Which decoded worker message goes to which operation -- this one, the swaps, the health, the
generation being set up, the rendezvous table -- is :mod:`nonstop.coordinator.routing`'s; this
module keeps what the view records of each worker and the rules of its protocol.

Threading: the coordinator's thread only. I/O through the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from nonstop import events as ev
from nonstop.control.channel import Channel, Message
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import Role, WorkerRecord
from nonstop.policy import reconfiguration as recovery
from nonstop.policy.cadence import Cadence, CadenceTuner
from nonstop.policy.phase import JobPhase
from nonstop.protocol.base import Json, MigrateMsg, RawMsg
from nonstop.protocol.rendezvous import kv_refusal
from nonstop.protocol.worker import (
    CadenceMsg,
    DoneMsg,
    FaultMsg,
    HeartbeatMsg,
    InjectedMsg,
    PausedMsg,
    ReadyMsg,
    RestoredMsg,
    StepMsg,
    WorkerHelloMsg,
)

if TYPE_CHECKING:
    from nonstop.config import JobConfig
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import FirstConnects, LaunchWatch, WorkerResumes
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.mesh import MeshSpec

__all__ = ["Fenced", "WorkerProtocol", "cadence_tuner", "groups_joined"]

Fenced: TypeAlias = RestoredMsg | ReadyMsg | StepMsg | DoneMsg | PausedMsg | FaultMsg | MigrateMsg | RawMsg
"""The worker messages that count only from a member of the current generation."""


def cadence_tuner(config: JobConfig, mesh: MeshSpec | None) -> CadenceTuner | None:
    """``--snapshot-budget``: the snapshot interval tuned to the stall measured
    (:mod:`nonstop.policy.cadence`); None without a budget or without snapshots."""
    if config.snapshot.budget <= 0 or config.snapshot.mode == "off":
        return None
    return CadenceTuner(
        budget=config.snapshot.budget,
        floor=config.snapshot.every,
        max_age_s=config.snapshot.max_age_s,
        copy_group=mesh.copy_group if mesh is not None else None,
    )


class WorkerProtocol:
    """The coordinator's side of the worker protocol (see the module docstring).

    ``cadence``: the snapshot interval's tuner (:func:`cadence_tuner`; None: a fixed interval);
    ``snapshot_every``: ``--snapshot-every``. Peers: ``start`` (the job's start, told of each
    connection while the job starts), ``setup`` (the generation being set up, told of launches,
    joins and steps), ``resumes`` (store mode: a worker reconnected to a restarted coordinator)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        cadence: CadenceTuner | None,
        snapshot_every: int,
        start: FirstConnects,
        setup: LaunchWatch,
        resumes: WorkerResumes,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.cadence = cadence
        self.snapshot_every = snapshot_every
        self.start = start
        self.setup = setup
        self.resumes = resumes

    @property
    def rescues(self) -> bool:
        """Whether steps go unsnapshotted now, so a failure's survivors rescue the state after
        their last completed step (policy/rescue.py): ``--snapshot-every`` above 1, or an
        interval a ``--snapshot-budget`` widened (announced: the ranks rescue from then on)."""
        tuned = self.cadence is not None and self.cadence.current.every > 1
        return self.snapshot_every > 1 or tuned

    def resumed_cadence(self, said: CadenceMsg | None) -> None:
        """A member reconnected to this restarted coordinator saying the interval it snapshots
        at (its resume point's): the tuner takes it up, arming the rescues
        (:meth:`~nonstop.policy.cadence.CadenceTuner.adopt`). None (none, or malformed: the
        decode drops it): ignored."""
        if self.cadence is None or said is None:
            return
        if self.cadence.adopt(Cadence(every=said.every, since=said.since)):
            self._announced(self.cadence.current)  # (not measured here: stall_s and step_s None)

    # -- connections ----------------------------------------------------------------------------------
    def on_open(self, chan: Channel) -> None:
        """A worker's hello on ``chan``: accepted for a spawn id launched on a live node and not
        connected yet (or reconnecting with ``resume``); otherwise refused and closed."""
        hello = WorkerHelloMsg.decode(chan.hello)
        sid, resume = hello.spawn_id, hello.resume
        w = self.view.workers.get(sid)
        node = self.view.nodes.get(self.view.node_of(sid))
        reconnect = resume is not None and w is not None and (w.chan is None or w.chan.closed)
        if w is None or (w.chan is not None and not reconnect) or node is None or not node.alive:
            self.events.emit(
                ev.Refused(peer=chan.peer, reason=f"unknown, duplicate or fenced spawn id {sid}")
            )
            self.io.close(chan)
            return
        chan.tag = sid
        w.chan = chan
        w.last_hb = self.clock.monotonic()
        self.events.emit(ev.Connect(spawn_id=sid, role=w.role, rank=w.rank, resumed=resume is not None))
        if resume is not None:
            self.resumes.on_worker_resumed(w, resume)
        else:
            self.on_connect(w)

    def worker_of(self, chan: Channel) -> WorkerRecord | None:
        """The worker whose current channel is ``chan`` (None: an old or a refused one)."""
        w = self.view.workers.get(chan.tag)
        return w if w is not None and w.chan is chan else None

    def on_close(self, w: WorkerRecord) -> None:
        """``w``'s channel closed: the detector fails it once it has been closed a moment."""
        w.chan_closed_at = self.clock.monotonic()

    def on_connect(self, w: WorkerRecord) -> None:
        """A worker connected (not a reconnect): the job may start, a spare may take a rank."""
        if self.view.phase is JobPhase.STARTING:
            self.start.connected()
            return
        r = self.setup.reconf
        if r is not None and w.role is Role.SPARE and r.waiting_launch:
            # A spare came up before a cold process launched for a rank on the same node: it
            # takes the rank, and the cold process will wait as a spare when it connects.
            # (A rule of the generation's launch, kept here until its setup owns it: issue 46.)
            node = w.node
            rank = min((k for k in r.waiting_launch if self.view.rank_node.get(k) == node), default=None)
            if rank is not None:
                cold = self.view.workers[self.view.members[rank]]
                cold.role, cold.rank = Role.SPARE, None
                w.role, w.rank = Role.WORKER, rank
                self.view.members[rank] = w.spawn_id
                r.replacements[rank] = "spare"
                self.events.emit(
                    ev.SpareTakesOver(rank=rank, spawn_id=w.spawn_id, cold_spawn_id=cold.spawn_id)
                )
        if r is not None and w.rank is not None and w.rank in r.waiting_launch:
            self.setup.report(recovery.Launched(w.rank, self.clock.wall()))

    # -- unfenced messages ---------------------------------------------------------------------------
    def on_heartbeat(self, w: WorkerRecord, m: HeartbeatMsg, now: float) -> None:
        """``w`` is alive, and says where it is (in a collective, idle, moving)."""
        w.last_hb, w.coll, w.idle_s, w.moving, w.at = now, m.coll, m.idle_s, m.moving is True, m.at
        w.excused = False  # (it speaks again: a later silence is judged afresh)

    def on_injected(self, w: WorkerRecord, m: InjectedMsg) -> None:
        """A fault injected into ``w`` fired: when (a detection is timed from it)."""
        w.fault_at = m.ts
        self.events.emit(
            ev.FaultInjected(rank=m.rank, step=m.step, fault_kind=m.kind, spawn_id=w.spawn_id, node=w.node)
        )

    def on_usage_fault(self, w: WorkerRecord, m: FaultMsg) -> None:
        """The script's mistake, from any of its processes: no recovery fixes it, the job fails
        (``nonstop run`` exits 2)."""
        who = f"rank {w.rank}" if w.rank is not None else f"process {w.spawn_id}"
        self.events.emit(ev.FaultReport(rank=w.rank, spawn_id=w.spawn_id, error=m.error))
        self.life.fail(f"{who}: {m.error}", usage=True)

    # -- the fence ---------------------------------------------------------------------------------------
    def admit(self, w: WorkerRecord, m: Fenced, raw: Message) -> int | None:
        """The fence: ``w``'s rank if ``m`` counts (``w`` is a member of the current generation
        and ``m`` was sent in it), else None -- and a fenced rendezvous request (``raw``) is
        answered why. A member's rescue report counts from the generation a plan is leaving."""
        if (
            isinstance(m, FaultMsg)
            and m.rescue is not None
            and self.view.is_member(w)
            and m.gen >= w.told_gen
        ):
            w.rescue = m.rescue  # (reported from the generation the plan being made is leaving)
        if m.gen != self.view.generation or w.rank is None or not self.view.is_member(w):
            if isinstance(m, RawMsg):  # a rendezvous request: the caller must hear why
                self.io.send(w, kv_refusal(raw, "fenced: not a member of this generation"))
            return None  # fenced: an older generation, or not (any more) a member
        return w.rank

    # -- a member's reports ------------------------------------------------------------------------------
    def on_step(self, w: WorkerRecord, rank: int, m: StepMsg, now: float) -> None:
        """``rank`` completed step ``m.step`` (committed only once its snapshot is complete)."""
        w.last_progress, w.stepped, w.last_step_wall = now, True, self.clock.wall()
        if m.snapped:  # a step counts as committed only once its snapshot is complete
            self.view.latest_step[rank] = m.step
        self.view.reached_step[rank] = max(self.view.reached_step.get(rank, 0), m.step)

    def on_snapshot_again(self, rank: int, m: StepMsg) -> None:
        """A step whose timing was reported already, snapshotted after all: only the snapshot."""
        self.view.latest_step[rank] = max(self.view.latest_step.get(rank, 0), m.step)

    def on_ready(self, w: WorkerRecord, rank: int, m: ReadyMsg, now: float) -> None:
        """``rank`` rebuilt its groups in the generation being set up (none: ignored)."""
        r = self.setup.reconf
        if r is None:
            return
        w.last_progress = now
        if r.restore_step is None:  # a fresh start: step 0 is snapshotted (replicable)
            self.view.latest_step.setdefault(rank, 0)
        self.setup.report(recovery.Joined(rank, self.clock.wall()))
        if self.cadence is not None and self.cadence.current.since > 0:  # (one it has not heard)
            self.io.send(w, _cadence(self.cadence.current))
        if m.groups is not None:
            self.events.emit(groups_joined(m, rank, m.groups))

    def on_done(self, rank: int, m: DoneMsg) -> None:
        """``rank`` has its final step snapshotted; the job finishes when every rank has."""
        self.view.latest_step[rank] = m.step
        self.view.done_ranks.add(rank)
        self.setup.report(recovery.Stepped(rank, self.clock.wall()))
        if self.view.phase is JobPhase.RUNNING and self.view.all_done():
            self.life.finish()

    def on_fault(self, w: WorkerRecord, rank: int, m: FaultMsg, now: float) -> None:
        """``rank`` reported the exception it failed with (its exit is its failure)."""
        w.fault_report = (now, m.error)
        self.events.emit(ev.FaultReport(rank=rank, spawn_id=w.spawn_id, error=m.error))

    # -- the snapshot interval ---------------------------------------------------------------------------
    def tune(self, m: StepMsg, rank: int) -> None:
        """A step report, to the cadence tuner; a new interval goes to every member."""
        tuner = self.cadence
        if tuner is None:
            return
        refused = tuner.refusal
        new = tuner.on_step(
            step=m.step,
            step_s=m.step_s,
            snap_s=m.snap_s,
            snapped=m.snapped,
            world_size=self.view.world_size,
            rank=rank,
            rest=m.rest,
        )
        if tuner.refusal is not None and refused is None:  # (said once)
            self._announced(tuner.current, refused=tuner.refusal)
        if new is not None:
            self.io.send_members(_cadence(new))
            self._announced(new)

    def _announced(self, cadence: Cadence, *, refused: str | None = None) -> None:
        """Log the interval from ``cadence.since`` on, with what it was measured on (``refused``:
        kept although a wider one was called for, and why)."""
        tuner = self.cadence
        assert tuner is not None
        stall_s, step_s = tuner.measured or (None, None)
        self.events.emit(
            ev.SnapshotCadence(
                every=cadence.every,
                since=cadence.since,
                stall_s=stall_s,
                step_s=step_s,
                budget=tuner.budget,
                refused=refused,
            )
        )


def groups_joined(m: ReadyMsg, rank: int, groups: tuple[int, int, float]) -> ev.GroupsJoined:
    kept, built, mesh_s = groups
    return ev.GroupsJoined(gen=m.gen, rank=rank, kept=kept, built=built, mesh_s=mesh_s, rebuild_s=m.rebuild_s)


def _cadence(c: Cadence) -> Json:
    """The order that tells the ranks snapshot interval ``c``."""
    return CadenceMsg(every=c.every, since=c.since).encode()
