"""The coordinator's boundary swaps: live migrations (``nonstop migrate``, ``drain``, preemption
notices) and elastic grows, run one at a time through the pure
:class:`~nonstop.policy.boundary_swap.BoundarySwap` machine.

:class:`Swaps` queues migration requests, picks targets and joiners (the pure choices of
:mod:`nonstop.policy.migration`), starts a grow when spares are idle and the job is shrunk
(:class:`~nonstop.policy.elastic.ElasticPolicy`), feeds the machine its events (fetch answers,
a joiner restored, a rank paused or stepped, the swap's generation done, a failure, a joiner's
exit, the clock) and carries out the actions it returns: fetches, messages, retiring or
releasing joiners, and the swap's generation (through the coordinator's generation code).

Threading: the coordinator's thread only.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.control.channel import Channel
from nonstop.coordinator.torch_env import rank_env
from nonstop.coordinator.view import NodeRecord, Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.policy.boundary_swap import (
    Action,
    BoundarySwap,
    Continue,
    Emit,
    Fetch,
    Finished,
    Joiner,
    Pause,
    Prepare,
    Release,
    Retire,
    SwapKind,
    SwapNow,
    SwapPhase,
)
from nonstop.policy.migration import CatchUp, Transfer, choose_joiner, choose_target
from nonstop.policy.phase import Busy, Op
from nonstop.protocol.client import MigratedMsg
from nonstop.protocol.wire import Fetched

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["GROW_RETRY_S", "Swaps"]

GROW_RETRY_S = 2.0  # an aborted grow (e.g. its prepare step was overwritten) is tried again after this


class Swaps:
    """Migrations and grows of one job (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self.active: BoundarySwap | None = None
        # (rank, target or None, reason, when asked): waits while no spare is ready (they may be starting)
        self.queue: list[tuple[int, str | None, str, float]] = []
        self.clients: dict[int, list[Channel]] = {}  # rank -> clients waiting for its migration
        self.done: list[dict[str, Any]] = []  # finished migrations' reports
        self.pause_ratios: list[float] = []  # finished swaps' gaps across the boundary / median step
        self._reqs: dict[int, tuple[str, int]] = {}  # fetch request id -> (purpose, joiner spawn id)
        self._step_at: dict[int, tuple[int, float]] = {}  # rank -> (step, when its report arrived)
        self._grow_retry_at = 0.0

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
        return req in self._reqs

    def status(self) -> dict[str, Any]:
        """The swaps for ``nonstop status``."""
        return swaps_status(self)

    def record(self) -> dict[str, Any]:
        """The swap in flight for the store's record (see :mod:`nonstop.coordinator.store_sync`)."""
        return swaps_record(self)

    # -- requests ---------------------------------------------------------------------------------
    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        """Queue moving ``rank`` to ``target`` (None: the policy picks a node); an error message
        when the request cannot be honoured at all."""
        v = self.c.view
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
        self.queue.append((rank, target, reason, time.monotonic()))
        self.c.events.emit(ev.MigrationRequested(rank=rank, target=target, reason=reason))
        return None

    def answer(self, rank: int, *, ok: bool, error: str | None = None, **info: Any) -> None:
        for chan in self.clients.pop(rank, []):
            try:
                chan.send(MigratedMsg(rank=rank, ok=ok, error=error, info=info).encode())
            except ControlError:
                pass

    def on_preempt(self, node: NodeRecord, grace_s: float) -> None:
        """A node got a preemption notice: move its ranks live to other nodes within the grace
        (queued migrations); persist now in case there is not enough time."""
        if node.draining or not node.alive:
            return
        node.draining = True
        ranks = self.c.view.ranks_on(node.name)
        self.c.events.emit(ev.PreemptNotice(node=node.name, grace_s=grace_s, ranks=ranks))
        if self.c.rounds is not None:
            self.c.rounds.request()
        for rank in ranks:
            error = self.request_migration(rank, None, "preempt")
            if error is not None:
                self.c.events.emit(ev.MigrationRefused(rank=rank, target=None, reason=error))
        self.release_drained()

    def release_drained(self) -> None:
        """A draining node that plays no rank any more is released (not a failure)."""
        m = self.migration
        busy = {m.source_node} if m is not None else set()
        for node in list(self.c.view.nodes.values()):
            if not node.alive or not node.draining or node.name in busy:
                continue
            if any(n == node.name for n in self.c.view.rank_node.values()):
                continue
            self.c.io.send_node(node, {"t": "release"})
            self.c.events.emit(ev.NodeReleased(node=node.name))
            self.c.agents.lose_node(node, "released after draining", failure=False)

    # -- the clock --------------------------------------------------------------------------------
    def tick(self) -> None:
        """Every loop: release drained nodes; time the active swap out, or start the next one."""
        self.release_drained()
        a = self.active
        if a is not None:
            if a.phase in (SwapPhase.PAUSE, SwapPhase.SWAP):
                now = time.monotonic()
                for sid in self.c.view.members.values():  # a rank waiting at the boundary is not hung
                    self.c.view.workers[sid].last_progress = now
            self._run(a.tick(time.time(), self.c.config.detection.rebuild_timeout_s))
            return
        if self.queue and self.c.may_start(Op.MIGRATE):
            self._start_migration(*self.queue.pop(0))
        elif self.c.view.world_size < self.c.config.world_size and self.c.may_start(Op.GROW):
            if time.monotonic() >= self._grow_retry_at:
                self._maybe_grow()

    def _start_migration(self, rank: int, wanted: str | None, reason: str, asked: float) -> None:
        v = self.c.view
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
            if time.monotonic() - asked < self.c.config.detection.rebuild_timeout_s:
                # Spares may still be starting (importing torch) or being replaced: ask again later.
                self.queue.append((rank, wanted, reason, asked))
                return
            why = f"no idle hot spare on node {target}" if target is not None else "no node has an idle spare"
            self.c.events.emit(ev.MigrationRefused(rank=rank, target=target, reason=why))
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
            prepare_step=self.c.committed(),  # held in the leaver node's memory until a newer one commits
            started=time.time(),
            reason=reason,
            leaver_sid=v.members[rank],
            catch=CatchUp(),
            swap_mode=self.c.config.operations.swap_transfer,
        )
        self._run(self.active.start())

    def _maybe_grow(self) -> None:
        v = self.c.view
        idle = v.idle_spares()
        target = self.c.elastic.grow_to(world_size=v.world_size, idle_spares=len(idle))
        if target <= v.world_size:
            return
        joiners = self.c.resize.joiners(idle, target)
        for j in joiners:
            v.workers[j.sid].role = Role.JOINER  # held for the grow: no recovery takes it meanwhile
        self.active = BoundarySwap(
            kind=SwapKind.GROW,
            joiners=joiners,
            world_size=v.world_size,
            new_world_size=target,
            source_rank=0,
            source_node=v.rank_node[0],
            prepare_step=self.c.committed(),  # held in rank 0's node until a newer one commits
            started=time.time(),
            fetch_boundary=not self.c.resize.reshards,
        )
        self._run(self.active.start())

    # -- events -----------------------------------------------------------------------------------
    def on_fetched(self, msg: Fetched) -> None:
        purpose, sid = self._reqs.pop(msg.id)
        self.c.io.done(msg.id)
        a = self.active
        if a is None or a.joiner(sid) is None:
            return  # the swap it was for has ended
        if purpose == "prepare":
            self._run(a.on_prepare_fetched(sid, msg.ok, msg.error, time.time()))
        else:
            t = Transfer(raw_bytes=msg.raw_bytes, wire_bytes=msg.wire_bytes, seconds=msg.seconds or 0.0)
            self._run(a.on_catchup_fetched(msg.ok, t, dataclasses.asdict(msg), **self._progress()))

    def on_restored(self, w: WorkerRecord) -> bool:
        """A joiner restored its prepare step; False: not a joiner of the active swap."""
        a = self.active
        if a is None or a.joiner(w.spawn_id) is None or a.phase is not SwapPhase.PREPARE:
            return False
        self._run(a.on_restored(w.spawn_id, **self._progress()))
        return True

    def on_paused(self, rank: int, step: int) -> None:
        if self.active is not None:
            self._run(self.active.on_paused(rank, step, time.time()))

    def on_step(self, rank: int, step: int) -> None:
        """Step report timing: the gap each rank saw across a swap's boundary."""
        now = time.monotonic()
        prev = self._step_at.get(rank)
        self._step_at[rank] = (step, now)
        if self.active is not None:
            self.active.on_step(rank, step, prev, now)

    def on_generation_done(self, generation: int) -> None:
        a = self.active
        if a is not None and a.generation == generation:
            self._run(a.on_generation_done(median_step_s=self.c.detector.median_step_s, now=time.time()))

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
        v = self.c.view  # a boundary goes past the newest step completed, snapshotted or not
        latest = {r: v.reached(r) for r in v.latest_step}
        return {"latest": latest, "committed": self.c.committed(), "now": time.time()}

    # -- actions ----------------------------------------------------------------------------------
    def _run(self, actions: list[Action]) -> None:
        for act in actions:
            self._do(act)

    def _do(self, act: Action) -> None:
        c, v, a = self.c, self.c.view, self.active
        assert a is not None
        if isinstance(act, Emit):
            c.events.emit(act.event())
        elif isinstance(act, Fetch):
            if act.purpose == "boundary":
                j = a.joiner(act.sid)
                assert j is not None
                j.boundary_req = c.sources.fetch_early(
                    act.target, act.rank, act.step, act.source, as_rank=act.as_rank, base=act.base
                )
                return
            req = c.io.fetch(
                act.target,
                act.rank,
                act.step,
                act.source,
                "local",
                as_rank=act.as_rank,
                base=act.base,
                track=act.track,
            )
            self._reqs[req] = (act.purpose, act.sid)
            if act.purpose == "catchup" and a.catch is not None:
                a.catch.catchup_req = req
        elif isinstance(act, Prepare):
            self._send_prepare(act.sid, act.rank, act.world_size, act.step)
        elif isinstance(act, Pause):
            c.io.send_members({"t": "pause", "at": act.at})
        elif isinstance(act, Continue):
            c.io.send_members({"t": "continue"})
        elif isinstance(act, Retire):
            w = v.workers.get(act.sid)
            if w is not None and w.live and not v.is_member(w):
                w.role, w.rank = Role.RETIRED, None
                c.io.kill(act.sid, signal.SIGKILL)  # a prepared joiner cannot take another rank
                if act.respawn and v.nodes[w.node].alive:
                    c.io.spawn(w.node, Role.SPARE, None)
        elif isinstance(act, Release):
            w = v.workers.get(act.sid)
            if w is not None and w.role is Role.JOINER:
                w.role, w.rank = Role.SPARE, None  # not told anything yet: idle again
        elif isinstance(act, SwapNow):
            self._swap(a, act)
        elif isinstance(act, Finished):
            self._finished(a, act)

    def _swap(self, a: BoundarySwap, s: SwapNow) -> None:
        """Every rank stopped after the boundary: the generation with the joiners in their ranks."""
        c, v = self.c, self.c.view
        if s.leaver is not None:
            leaver = v.workers[s.leaver]
            leaver.role, leaver.rank = Role.RETIRED, None  # its exit is no failure
            c.io.kill(s.leaver, signal.SIGKILL)  # its snapshot of the boundary stays in its node's memory
        c.gens.open_generation()
        a.generation = v.generation
        old_world = v.world_size
        v.world_size = s.world_size
        now = time.monotonic()
        for rank, (sid, node) in s.ranks.items():
            w = v.workers[sid]
            w.role, w.rank = Role.WORKER, rank
            w.last_progress, w.stepped = now, False
            v.members[rank] = sid
            v.rank_node[rank] = node
        label = str(a.kind) if a.kind is SwapKind.MIGRATION else "grow"
        r = c.gens.boundary_generation(
            s.step, dict.fromkeys(s.ranks, label), fresh=set(s.ranks) if s.fresh else None
        )
        early = {j.rank: j.boundary_req for j in a.joiners}
        fetches = {}
        if not a.fetch_boundary:  # every rank reshards from all the old ranks' boundary
            c.resize.reshard_at_boundary(r, s.step, old_world)
        else:
            for rank in s.ranks:
                src_rank, src = s.sources.get(rank, (s.source_rank, s.source))
                fetches[rank] = c.sources.fetch_for(
                    r, rank, s.step, src, "local", src_rank=src_rank, base=s.base, early=early.get(rank)
                )
        if a.kind is SwapKind.GROW:
            for rank in s.ranks:  # the members keep their numbers; the joiners' are new
                self._step_at.pop(rank, None)
            shards = c.resize.data_shards(v.world_size)
            c.events.emit(
                ev.Grow(
                    world_size=v.world_size,
                    old_world_size=old_world,
                    boundary=s.step,
                    shards={str(k): list(sh) for k, sh in enumerate(shards)},
                )
            )
            c.gens.launch(r, tier="memory", fetches=fetches, grow=sorted(s.ranks))
        else:
            c.gens.launch(r, tier="memory", fetches=fetches, migration=a.rank)

    def _send_prepare(self, sid: int, rank: int, world_size: int, step: int | None) -> None:
        """Tell a joiner (a migration's or a grow's) its rank: it restores ``step``, which its node
        holds, and warms up while the job trains; it is no member until the swap."""
        self.c.io.send(
            self.c.view.workers[sid],
            {
                "t": "reconfigure",
                "gen": self.c.view.generation,
                "rank": rank,
                "world_size": world_size,
                "env": rank_env(self.c.view, sid, rank, world_size),  # its node's, if the swap happens
                "restore_step": step,
                "recovery": False,
                "prepare": True,
                **self.c.resize.shards_of(rank, world_size),
            },
        )

    def _finished(self, a: BoundarySwap, f: Finished) -> None:
        self.active = None
        for req in [q for q, (_, sid) in self._reqs.items() if a.joiner(sid) is not None]:
            del self._reqs[req]  # a late answer is ignored like any stale fetch
            self.c.io.done(req)
        if not f.ok:
            for j in a.joiners:
                if j.boundary_req is not None:
                    self.c.sources.drop_early(j.boundary_req)
        if f.ok and f.info.get("pause_ratio") is not None:
            self.pause_ratios.append(float(f.info["pause_ratio"]))
        if a.kind is SwapKind.MIGRATION:
            if f.ok:
                self.done.append(dict(f.info))
            self.answer(a.rank, ok=f.ok, error=f.error, **{k: v for k, v in f.info.items() if k != "rank"})
        elif not f.ok:
            self._grow_retry_at = time.monotonic() + GROW_RETRY_S


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
