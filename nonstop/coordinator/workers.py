"""The workers' protocol on the coordinator: connections, heartbeats, step reports, rendezvous
``kv``, restore/ready/done reports, faults, migrations asked by a rank, event subscriptions.

A worker's connection is accepted only for a spawn id the coordinator launched, on a live node,
and not already connected (a reconnect to a restarted coordinator carries ``resume``). Every
message but heartbeats, fault timestamps, subscriptions and a joiner's preparation is **fenced**:
it counts only from a member of the current generation (:meth:`WorkerProtocol.on_message`); a
rendezvous request that is fenced is answered with the reason, so its caller does not wait.

Threading: the coordinator's thread only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.control.channel import Channel, Message
from nonstop.coordinator.view import Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.policy import reconfiguration as recovery
from nonstop.policy.cadence import Cadence, CadenceTuner
from nonstop.policy.phase import JobPhase
from nonstop.protocol import wire
from nonstop.protocol.rendezvous import kv_refusal
from nonstop.protocol.wire import decode_worker

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["WorkerProtocol", "groups_joined"]


class WorkerProtocol:
    """The coordinator's side of the worker protocol (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        cfg = c.config
        # --snapshot-budget: the snapshot interval tuned to the stall measured (policy/cadence.py)
        self.cadence = (
            CadenceTuner(
                budget=cfg.snapshot.budget,
                floor=cfg.snapshot.every,
                max_age_s=cfg.snapshot.max_age_s,
                copy_group=c.mesh.copy_group if c.mesh is not None else None,
            )
            if cfg.snapshot.budget > 0 and cfg.snapshot.mode != "off"
            else None
        )

    @property
    def rescues(self) -> bool:
        """Whether steps go unsnapshotted now, so a failure's survivors rescue the state after
        their last completed step (policy/rescue.py): ``--snapshot-every`` above 1, or an
        interval a ``--snapshot-budget`` widened (announced: the ranks rescue from then on)."""
        tuned = self.cadence is not None and self.cadence.current.every > 1
        return self.c.config.snapshot.every > 1 or tuned

    def resumed_cadence(self, said: object) -> None:
        """A member reconnected to this restarted coordinator saying the interval it snapshots
        at (``{every, since}``, its resume point): the tuner takes it up, arming the rescues
        (:meth:`~nonstop.policy.cadence.CadenceTuner.adopt`). Malformed: ignored."""
        if self.cadence is None or not isinstance(said, dict):
            return
        every, since = said.get("every"), said.get("since")
        if not (type(every) is int and type(since) is int and every >= 1 and since >= 0):
            return
        if self.cadence.adopt(Cadence(every=every, since=since)):
            self._announced(self.cadence.current)  # (not measured here: stall_s and step_s None)

    def on_event(self, kind: str, chan: Channel, msg: Message | None) -> None:
        """A worker's connection opened, sent ``msg`` or closed."""
        c = self.c
        if kind == "open":
            sid = int(chan.hello.get("spawn_id", -1))
            w = c.view.workers.get(sid)
            node = c.view.nodes.get(c.view.node_of(sid))
            resume = chan.hello.get("resume")
            reconnect = resume is not None and w is not None and (w.chan is None or w.chan.closed)
            if w is None or (w.chan is not None and not reconnect) or node is None or not node.alive:
                c.events.emit(
                    ev.Refused(peer=chan.peer, reason=f"unknown, duplicate or fenced spawn id {sid}")
                )
                chan.close()
                return
            chan.tag = sid
            w.chan = chan
            w.last_hb = time.monotonic()
            c.events.emit(ev.Connect(spawn_id=sid, role=w.role, rank=w.rank, resumed=resume is not None))
            if isinstance(resume, dict):
                c.store.on_worker_resumed(w, resume)
            else:
                self.on_connect(w)
        elif kind == "msg" and msg is not None:
            w = c.view.workers.get(chan.tag)
            if w is not None and w.chan is chan:
                self.on_message(w, msg)
        elif kind == "close":
            w = c.view.workers.get(chan.tag)
            if w is not None and w.chan is chan:
                w.chan_closed_at = time.monotonic()

    def on_connect(self, w: WorkerRecord) -> None:
        """A worker connected (not a reconnect): the job may start, a spare may take a rank."""
        c = self.c
        if c.view.phase is JobPhase.STARTING:
            if c.view.members and all(
                c.view.workers[sid].chan is not None for sid in c.view.members.values()
            ):
                c.gens.begin([])
            return
        r = c.gens.reconf
        if r is not None and w.role is Role.SPARE and r.waiting_launch:
            # A spare came up before a cold process launched for a rank on the same node: it
            # takes the rank, and the cold process will wait as a spare when it connects.
            node = w.node
            rank = min((k for k in r.waiting_launch if c.view.rank_node.get(k) == node), default=None)
            if rank is not None:
                cold = c.view.workers[c.view.members[rank]]
                cold.role, cold.rank = Role.SPARE, None
                w.role, w.rank = Role.WORKER, rank
                c.view.members[rank] = w.spawn_id
                r.replacements[rank] = "spare"
                c.events.emit(ev.SpareTakesOver(rank=rank, spawn_id=w.spawn_id, cold_spawn_id=cold.spawn_id))
        if r is not None and w.rank is not None and w.rank in r.waiting_launch:
            c.gens.report(recovery.Launched(w.rank, time.time()))

    def on_message(self, w: WorkerRecord, msg: Message) -> None:
        """One message from a worker, decoded (:func:`~nonstop.protocol.wire.decode_worker`);
        everything but heartbeats, fault timestamps and a joiner's preparation is fenced: it
        counts only from a member of the current generation."""
        c = self.c
        m = decode_worker(msg)
        now = time.monotonic()
        if isinstance(m, wire.Heartbeat):
            w.last_hb, w.coll, w.idle_s, w.moving, w.at = now, m.coll, m.idle_s, m.moving, m.at
            w.excused = False  # (it speaks again: a later silence is judged afresh)
            return
        if isinstance(m, wire.Injected):
            w.fault_at = m.ts
            c.events.emit(
                ev.FaultInjected(
                    rank=m.rank, step=m.step, fault_kind=m.kind, spawn_id=w.spawn_id, node=w.node
                )
            )
            return
        if isinstance(m, wire.HealthReport):  # issue 21: any process on a node speaks for it
            c.health.on_probe(w.node, m.verdict, probe=m.probe, detail=m.detail)
            return
        if isinstance(m, wire.Subscribe):  # any process, any generation: Session.on_event
            if w.chan is not None:
                c.feed.subscribe(w.spawn_id, w.chan, m.kinds)
            return
        if isinstance(m, wire.Fault) and m.usage:  # the script's mistake, from any of its processes
            who = f"rank {w.rank}" if w.rank is not None else f"process {w.spawn_id}"
            c.events.emit(ev.FaultReport(rank=w.rank, spawn_id=w.spawn_id, error=m.error))
            c.fail(f"{who}: {m.error}", usage=True)  # no recovery fixes it: nonstop run exits 2
            return
        if isinstance(m, wire.Restored) and c.swaps.on_restored(w):
            return  # a joiner prepared its rank
        if m is None:
            return  # a kind this coordinator does not know
        if isinstance(m, wire.Fault) and m.rescue is not None and c.view.is_member(w) and m.gen >= w.told_gen:
            w.rescue = m.rescue  # (reported from the generation the plan being made is leaving)
        if m.gen != c.view.generation or w.rank is None or not c.view.is_member(w):
            if isinstance(m, wire.Raw):  # a rendezvous request: the caller must hear why
                c.io.send(w, kv_refusal(msg, "fenced: not a member of this generation"))
            return  # fenced: an older generation, or not (any more) a member
        rank, r = w.rank, c.gens.reconf
        if isinstance(m, wire.Ready) and m.layouts is not None and rank == 0:
            c.resize.layouts = m.layouts  # what a later reshard plans its fetches by
        if isinstance(m, wire.Raw):
            chan = w.chan
            assert chan is not None
            for reply, out in c.kv.handle(dict(m.msg), chan.send):
                try:
                    reply(out)
                except ControlError:
                    pass
        elif isinstance(m, wire.Step) and m.again:  # its timing was reported already: only the snapshot
            c.view.latest_step[rank] = max(c.view.latest_step.get(rank, 0), m.step)
        elif isinstance(m, wire.Step):
            w.last_progress, w.stepped, w.last_step_wall = now, True, time.time()
            c.detector.record_step(m.step_s)
            if m.snapped:  # a step counts as committed only once its snapshot is complete
                c.view.latest_step[rank] = m.step
            c.view.reached_step[rank] = max(c.view.reached_step.get(rank, 0), m.step)
            c.swaps.on_step(rank, m.step)
            c.health.on_step(w, rank, m)  # issue 21: compute time (step_s - wait_s) for fail-slow
            c.gens.report(recovery.Stepped(rank, time.time()))
            if c.monitor is not None:
                c.monitor.on_step(rank, m.step_s, m.snap_s, m.nbytes)
            self._tune(m, rank)
        elif isinstance(m, wire.Restored):
            c.gens.report(recovery.Restored(rank, time.time()))
        elif isinstance(m, wire.Ready) and r is not None:
            w.last_progress = now
            if r.restore_step is None:  # a fresh start: step 0 is snapshotted (replicable)
                c.view.latest_step.setdefault(rank, 0)
            c.gens.report(recovery.Joined(rank, time.time()))
            if self.cadence is not None and self.cadence.current.since > 0:  # (one it has not heard)
                c.io.send(w, self.cadence.current.message())
            if m.groups is not None:
                c.events.emit(groups_joined(m, rank, m.groups))

        elif isinstance(m, wire.Done):
            c.view.latest_step[rank] = m.step
            c.view.done_ranks.add(rank)
            c.gens.report(recovery.Stepped(rank, time.time()))
            if c.view.phase is JobPhase.RUNNING and c.view.all_done():
                c.finish()
        elif isinstance(m, wire.Migrate):
            error = c.swaps.request_migration(rank, m.to, "migrate")
            if error is not None:
                c.events.emit(ev.MigrationRefused(rank=rank, target=m.to, reason=error))
        elif isinstance(m, wire.Paused):
            c.swaps.on_paused(rank, m.step)
        elif isinstance(m, wire.Fault):
            w.fault_report = (now, m.error)
            c.events.emit(ev.FaultReport(rank=rank, spawn_id=w.spawn_id, error=m.error))

    def _tune(self, m: wire.Step, rank: int) -> None:
        """A step report, to the cadence tuner; a new interval goes to every member."""
        tuner = self.cadence
        if tuner is None:
            return
        c = self.c
        refused = tuner.refusal
        new = tuner.on_step(
            step=m.step,
            step_s=m.step_s,
            snap_s=m.snap_s,
            snapped=m.snapped,
            world_size=c.view.world_size,
            rank=rank,
            rest=m.rest,
        )
        if tuner.refusal is not None and refused is None:  # (said once)
            self._announced(tuner.current, refused=tuner.refusal)
        if new is not None:
            c.io.send_members(new.message())
            self._announced(new)

    def _announced(self, cadence: Cadence, *, refused: str | None = None) -> None:
        """Log the interval from ``cadence.since`` on, with what it was measured on (``refused``:
        kept although a wider one was called for, and why)."""
        tuner = self.cadence
        assert tuner is not None
        stall_s, step_s = tuner.measured or (None, None)
        self.c.events.emit(
            ev.SnapshotCadence(
                every=cadence.every,
                since=cadence.since,
                stall_s=stall_s,
                step_s=step_s,
                budget=tuner.budget,
                refused=refused,
            )
        )


def groups_joined(m: wire.Ready, rank: int, groups: tuple[int, int, float]) -> ev.GroupsJoined:
    kept, built, mesh_s = groups
    return ev.GroupsJoined(gen=m.gen, rank=rank, kept=kept, built=built, mesh_s=mesh_s, rebuild_s=m.rebuild_s)
