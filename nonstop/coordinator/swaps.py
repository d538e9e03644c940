"""The coordinator's boundary swaps: live migrations (``nonstop migrate``, ``drain``, preemption
notices) and elastic grows, run one at a time through the pure
:class:`~nonstop.policy.boundary_swap.BoundarySwap` machine.

:class:`Swaps` queues migration requests, picks targets and joiners (the pure choices of
:mod:`nonstop.policy.migration`), starts a grow when spares are idle and the job is shrunk
(:class:`~nonstop.policy.elastic.ElasticPolicy`), feeds the machine its events (fetch answers,
a joiner restored, a rank paused or stepped, the swap's generation done, a failure, a joiner's
exit, the clock) and has the actions it returns carried out by
:class:`~nonstop.coordinator.swap_actions.SwapActions` (fetches, messages, retiring or releasing
joiners, the swap's generation) -- all but the end of a swap, which is its own: the clients
waiting for a migration answered, a failed grow tried again later.

Threading: the coordinator's thread only; I/O through its executor.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.control.channel import Channel
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import NodeRecord, Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.policy.boundary_swap import (
    Action,
    BoundarySwap,
    Finished,
    Joiner,
    SwapKind,
    SwapNow,
    SwapPhase,
)
from nonstop.policy.migration import CatchUp, Transfer, choose_joiner, choose_target
from nonstop.policy.phase import Busy, Op
from nonstop.protocol.agent import ReleaseMsg
from nonstop.protocol.client import MigratedMsg
from nonstop.protocol.wire import Fetched

if TYPE_CHECKING:
    from nonstop.coordinator.detector import FailureDetector
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import GrowJoiners, NodeLoss, PersistNow
    from nonstop.coordinator.swap_actions import SwapActions
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.policy.elastic import ElasticPolicy

__all__ = ["GROW_RETRY_S", "Swaps"]

GROW_RETRY_S = 2.0  # an aborted grow (e.g. its prepare step was overwritten) is tried again after this


class Swaps:
    """Migrations and grows of one job (see the module docstring).

    ``actions``: carries out the machine's actions (:class:`~nonstop.coordinator.swap_actions.
    SwapActions`); ``elastic``: when a grow starts and to what size; ``detector``: the median step
    a finished swap's pause is measured against; ``full_world_size``: the job's ranks at full size;
    ``rebuild_timeout_s``: how long a swap may take to swap, and a queued migration wait for a
    spare; ``swap_transfer``: ``--swap-transfer``; ``persist``: a job of several nodes' persist
    rounds (a preempted node asks for one), None with one node.

    The job's sizes (a grow's joiners) and the node agents (a drained node released) come late,
    by :meth:`bind`: both call back into the swaps (a resize reads their step timings, an agent's
    fetch answers and preemption notices come here), so they are built after them; :meth:`bind`
    is called once, before the first event."""

    resize: GrowJoiners
    nodes: NodeLoss

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        actions: SwapActions,
        elastic: ElasticPolicy,
        detector: FailureDetector,
        full_world_size: int,
        rebuild_timeout_s: float,
        swap_transfer: str,
        persist: PersistNow | None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.actions = actions
        self.elastic = elastic
        self.detector = detector
        self.full_world_size = full_world_size
        self.rebuild_timeout_s = rebuild_timeout_s
        self.swap_transfer = swap_transfer
        self.persist = persist
        self.active: BoundarySwap | None = None
        # (rank, target or None, reason, when asked): waits while no spare is ready (they may be starting)
        self.queue: list[tuple[int, str | None, str, float]] = []
        self.clients: dict[int, list[Channel]] = {}  # rank -> clients waiting for its migration
        self.done: list[dict[str, Any]] = []  # finished migrations' reports
        self.pause_ratios: list[float] = []  # finished swaps' gaps across the boundary / median step
        self._step_at: dict[int, tuple[int, float]] = {}  # rank -> (step, when its report arrived)
        self._grow_retry_at = 0.0

    def bind(self, *, resize: GrowJoiners, nodes: NodeLoss) -> None:
        """The peers that are built after the swaps (see the class docstring)."""
        self.resize = resize
        self.nodes = nodes

    # -- what the rest of the coordinator asks ----------------------------------------------------
    @property
    def migration(self) -> BoundarySwap | None:
        a = self.active
        return a if a is not None and a.kind is SwapKind.MIGRATION else None

    @property
    def grow(self) -> BoundarySwap | None:
        a = self.active
        return a if a is not None and a.kind is SwapKind.GROW else None

    @property
    def swapping(self) -> bool:
        """Ranks pause at a boundary or swap."""
        return self.active is not None and self.active.phase in (SwapPhase.PAUSE, SwapPhase.SWAP)

    @property
    def moving(self) -> bool:
        """A migration or a grow is under way or queued: one move at a time."""
        return self.active is not None or bool(self.queue)

    def busy(self) -> set[Busy]:
        """What the swaps have under way, for what may start (:meth:`JobLife.may_start
        <nonstop.coordinator.job.JobLife.may_start>`)."""
        out: set[Busy] = set()
        if self.swapping:
            out.add(Busy.SWAPPING)
        if self.migration is not None or self.queue:
            out.add(Busy.MIGRATING)
        if self.grow is not None:
            out.add(Busy.GROWING)
        return out

    def owns(self, req: int) -> bool:
        """Whether fetch ``req`` is a swap's (its answer goes to :meth:`on_fetched`)."""
        return self.actions.owns(req)

    def status(self) -> dict[str, Any]:
        """The swaps for ``nonstop status``."""
        return swaps_status(self)

    def record(self) -> dict[str, Any]:
        """The swap in flight for the store's record (see :mod:`nonstop.coordinator.store_sync`)."""
        return swaps_record(self)

    def requeue(self, rec: dict[str, Any], now: float) -> None:
        """Queue again the migrations a dead coordinator's record (:meth:`record`) had queued, as
        asked at ``now`` (its swap in flight is ended by the store sync once the nodes are back)."""
        for rank, target, reason in rec.get("migrate_queue", []):
            self.queue.append((int(rank), target, str(reason), now))

    # -- requests ---------------------------------------------------------------------------------
    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        """Queue moving ``rank`` to ``target`` (None: the policy picks a node); an error message
        when the request cannot be honoured at all."""
        v = self.view
        if not 0 <= rank < v.world_size:
            return f"no rank {rank}: the job has ranks 0..{v.world_size - 1}"
        if target is not None:
            node = v.nodes.get(target)
            if node is None or not node.alive or node.quarantined:
                return f"node {target} is not a live node of the job (nodes: {', '.join(v.alive_nodes())})"
            if v.rank_node.get(rank) == target:
                return f"rank {rank} already runs on node {target}"
        if v.phase.is_ending:
            return "the job is ending"
        m = self.migration
        if any(q[0] == rank for q in self.queue) or (m is not None and m.rank == rank):
            return f"rank {rank} is already being moved"
        self.queue.append((rank, target, reason, self.clock.monotonic()))
        self.events.emit(ev.MigrationRequested(rank=rank, target=target, reason=reason))
        return None

    def answer(self, rank: int, *, ok: bool, error: str | None = None, **info: Any) -> None:
        """Tell the clients waiting for ``rank``'s migration how it ended (a client gone is skipped)."""
        for chan in self.clients.pop(rank, []):
            try:
                self.io.answer(chan, MigratedMsg(rank=rank, ok=ok, error=error, info=info).encode())
            except ControlError:
                pass

    def on_preempt(self, node: NodeRecord, grace_s: float) -> None:
        """A node got a preemption notice: move its ranks live to other nodes within the grace
        (queued migrations); persist now in case there is not enough time."""
        if node.draining or not node.alive:
            return
        node.draining = True
        ranks = self.view.ranks_on(node.name)
        self.events.emit(ev.PreemptNotice(node=node.name, grace_s=grace_s, ranks=ranks))
        if self.persist is not None:
            self.persist.request()
        for rank in ranks:
            error = self.request_migration(rank, None, "preempt")
            if error is not None:
                self.events.emit(ev.MigrationRefused(rank=rank, target=None, reason=error))
        self.release_drained()

    def release_drained(self) -> None:
        """A draining node that plays no rank any more is released (not a failure)."""
        m = self.migration
        busy = {m.source_node} if m is not None else set()
        for node in list(self.view.nodes.values()):
            if not node.alive or not node.draining or node.name in busy:
                continue
            if any(n == node.name for n in self.view.rank_node.values()):
                continue
            self.io.send_node(node, ReleaseMsg().encode())
            self.events.emit(ev.NodeReleased(node=node.name))
            self.nodes.lose_node(node, "released after draining", failure=False)

    # -- the clock --------------------------------------------------------------------------------
    def tick(self) -> None:
        """Every loop: release drained nodes; time the active swap out, or start the next one."""
        self.release_drained()
        a = self.active
        if a is not None:
            if a.phase in (SwapPhase.PAUSE, SwapPhase.SWAP):
                now = self.clock.monotonic()
                for sid in self.view.members.values():  # a rank waiting at the boundary is not hung
                    self.view.workers[sid].last_progress = now
            self._run(a.tick(self.clock.wall(), self.rebuild_timeout_s))
            return
        if self.queue and self.life.may_start(Op.MIGRATE):
            self._start_migration(*self.queue.pop(0))
        elif self.view.world_size < self.full_world_size and self.life.may_start(Op.GROW):
            if self.clock.monotonic() >= self._grow_retry_at:
                self._maybe_grow()

    def _start_migration(self, rank: int, wanted: str | None, reason: str, asked: float) -> None:
        v = self.view
        leaver_node = v.rank_node[rank]
        idle = v.idle_spares()
        alive = v.alive_nodes()
        target = wanted
        if target is None:
            target = choose_target(
                leaver_node, idle, alive, {n: v.nodes[n].domain for n in alive}, v.load(alive)
            )
        joiner = choose_joiner(target, idle) if target is not None and target in alive else None
        if target is None or joiner is None:
            if self.clock.monotonic() - asked < self.rebuild_timeout_s:
                # Spares may still be starting (importing torch) or being replaced: ask again later.
                self.queue.append((rank, wanted, reason, asked))
                return
            why = f"no idle hot spare on node {target}" if target is not None else "no node has an idle spare"
            self.events.emit(ev.MigrationRefused(rank=rank, target=target, reason=why))
            self.answer(rank, ok=False, error=why)
            return
        w = v.workers[joiner]
        w.role, w.rank = Role.JOINER, rank  # not a member until the swap
        self.active = BoundarySwap(
            kind=SwapKind.MIGRATION,
            joiners=[Joiner(sid=joiner, rank=rank, node=target)],
            world_size=v.world_size,
            new_world_size=v.world_size,
            source_rank=rank,
            source_node=leaver_node,
            prepare_step=self.life.committed(),  # held in the leaver node's memory until a newer one commits
            started=self.clock.wall(),
            reason=reason,
            leaver_sid=v.members[rank],
            catch=CatchUp(),
            swap_mode=self.swap_transfer,
        )
        self._run(self.active.start())

    def _maybe_grow(self) -> None:
        v = self.view
        idle = v.idle_spares()
        target = self.elastic.grow_to(world_size=v.world_size, idle_spares=len(idle))
        if target <= v.world_size:
            return
        joiners = self.resize.joiners(idle, target)
        for j in joiners:
            v.workers[j.sid].role = Role.JOINER  # held for the grow: no recovery takes it meanwhile
        self.active = BoundarySwap(
            kind=SwapKind.GROW,
            joiners=joiners,
            world_size=v.world_size,
            new_world_size=target,
            source_rank=0,
            source_node=v.rank_node[0],
            prepare_step=self.life.committed(),  # held in rank 0's node until a newer one commits
            started=self.clock.wall(),
            fetch_boundary=not self.resize.reshards,
        )
        self._run(self.active.start())

    # -- events -----------------------------------------------------------------------------------
    def on_fetched(self, msg: Fetched) -> None:
        purpose, sid = self.actions.answered(msg.id)
        a = self.active
        if a is None or a.joiner(sid) is None:
            return  # the swap it was for has ended
        if purpose == "prepare":
            self._run(a.on_prepare_fetched(sid, msg.ok, msg.error, self.clock.wall()))
        else:
            t = Transfer(raw_bytes=msg.raw_bytes, wire_bytes=msg.wire_bytes, seconds=msg.seconds or 0.0)
            self._run(
                a.on_catchup_fetched(
                    msg.ok, t, delta=msg.delta, capped=msg.capped, error=msg.error, **self._progress()
                )
            )

    def on_restored(self, w: WorkerRecord) -> bool:
        """A joiner restored its prepare step; False: not a joiner of the active swap."""
        a = self.active
        if a is None or a.joiner(w.spawn_id) is None or a.phase is not SwapPhase.PREPARE:
            return False
        self._run(a.on_restored(w.spawn_id, **self._progress()))
        return True

    def on_paused(self, rank: int, step: int) -> None:
        if self.active is not None:
            self._run(self.active.on_paused(rank, step, self.clock.wall()))

    def on_step(self, rank: int, step: int) -> None:
        """Step report timing: the gap each rank saw across a swap's boundary."""
        now = self.clock.monotonic()
        prev = self._step_at.get(rank)
        self._step_at[rank] = (step, now)
        if self.active is not None:
            self.active.on_step(rank, step, prev, now)

    def on_generation_done(self, generation: int) -> None:
        a = self.active
        if a is not None and a.generation == generation:
            self._run(a.on_generation_done(median_step_s=self.detector.median_step_s, now=self.clock.wall()))

    def on_exit(self, sid: int, *, member: bool, how: str) -> None:
        """Process ``sid`` exited: a joiner's death aborts the swap it was preparing."""
        a = self.active
        if a is None or member or a.joiner(sid) is None or a.phase is SwapPhase.SWAP:
            return
        who = f"the joiner (spawn {sid})" if a.kind is SwapKind.MIGRATION else f"joining spare {sid}"
        self.abort(f"{who} exited with {how}")

    def abort(self, why: str, *, failed: Collection[int] = ()) -> None:
        """End the swap in progress (``failed``: the spawn ids of processes that failed: a swap
        already made stands unless one of them was a joiner, :meth:`BoundarySwap.abort`)."""
        if self.active is not None:
            self._run(self.active.abort(why, failed=failed))

    def finish(self) -> None:
        """The job finishes: nothing more moves."""
        self.abort("the job finished first")
        for rank in [q[0] for q in self.queue]:
            self.answer(rank, ok=False, error="the job finished first")
        self.queue.clear()

    def forget_steps(self) -> None:
        """The world was renumbered: earlier step timings belong to other ranks."""
        self._step_at.clear()

    def _progress(self) -> dict[str, Any]:
        v = self.view  # a boundary goes past the newest step completed, snapshotted or not
        latest = {r: v.reached(r) for r in v.latest_step}
        return {"latest": latest, "committed": self.life.committed(), "now": self.clock.wall()}

    # -- actions ----------------------------------------------------------------------------------
    def _run(self, actions: list[Action]) -> None:
        for act in actions:
            self._do(act)

    def _do(self, act: Action) -> None:
        a = self.active
        assert a is not None
        if isinstance(act, Finished):
            self._finished(a, act)
            return
        if isinstance(act, SwapNow) and a.kind is SwapKind.GROW:
            for rank in act.ranks:  # the members keep their numbers; the joiners' are new
                self._step_at.pop(rank, None)
        self.actions.do(a, act)

    def _finished(self, a: BoundarySwap, f: Finished) -> None:
        self.active = None
        self.actions.forget(a, ok=f.ok)
        if f.ok and f.info.get("pause_ratio") is not None:
            self.pause_ratios.append(float(f.info["pause_ratio"]))
        if a.kind is SwapKind.MIGRATION:
            if f.ok:
                self.done.append(dict(f.info))
            self.answer(a.rank, ok=f.ok, error=f.error, **{k: v for k, v in f.info.items() if k != "rank"})
        elif not f.ok:
            self._grow_retry_at = self.clock.monotonic() + GROW_RETRY_S


def swaps_status(s: Swaps) -> dict[str, Any]:
    """The migration and the grow in flight, and the queued migrations, as ``status`` shows them."""
    m, z = s.migration, s.grow
    migration = None
    if m is not None:
        migration = {"rank": m.rank, "source": m.source_node, "target": m.target, "phase": str(m.phase)}
        migration["boundary"] = m.boundary
    return {
        "migration": migration,
        "queued_migrations": [q[0] for q in s.queue],
        "growing": None if z is None else {"to": z.new_world_size, "boundary": z.boundary},
    }


def swaps_record(s: Swaps) -> dict[str, Any]:
    """The queue and the swap in flight, as the job's store records them (a restarted coordinator
    reads them back)."""
    a = s.active
    out: dict[str, Any] = {"migrate_queue": [[q[0], q[1], q[2]] for q in s.queue]}
    out["migration"] = out["grow"] = None
    if a is not None:
        out[str(a.kind)] = {
            "rank": a.rank,
            "joiners": [j.sid for j in a.joiners],
            "told": [j.sid for j in a.joiners if j.told],
            "phase": str(a.phase),
            "swapped": a.generation is not None,
        }
    return out
