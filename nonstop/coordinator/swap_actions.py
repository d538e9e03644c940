"""What a boundary swap's machine asks for, carried out: the swap's I/O and its generation.

:class:`SwapActions` executes the actions of one :class:`~nonstop.policy.boundary_swap.BoundarySwap`
that touch the world -- fetches to the joiners' nodes (prepare, catch-up and the boundary, the
last asked early through the restore sources), the ``reconfigure``/``pause``/``continue``
messages, retiring or releasing joiners, and the swap itself: a new generation with the joiners
in their ranks (through the generations). It keeps the fetches in flight that the swap asked for
(:meth:`owns`, :meth:`answered`); what the swap's bookkeeping is -- the queue, the machine in
flight, its end -- stays with :class:`~nonstop.coordinator.swaps.Swaps`.

Threading: the coordinator's thread only; I/O through its executor.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.torch_env import rank_env
from nonstop.coordinator.view import Role
from nonstop.policy.boundary_swap import (
    Action,
    BoundarySwap,
    Continue,
    Emit,
    Fetch,
    Pause,
    Prepare,
    Release,
    Retire,
    SwapKind,
    SwapNow,
)
from nonstop.protocol.worker import ContinueMsg, PauseMsg, ReconfigureMsg

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.peers import BoundarySources, SwapGenerations, SwapShards
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog

__all__ = ["SwapActions"]


class SwapActions:
    """Carries out a boundary swap's actions (see the module docstring).

    ``sources``: where the boundary fetches go (the restore sources, which adopt an early one in
    the swap's generation). The generations and the job's sizes come late, by :meth:`bind`: both
    call back into the swaps (a generation done ends the swap; a resize reads the swaps' step
    timings), so they are built after them; :meth:`bind` is called once, before the first event."""

    gens: SwapGenerations
    resize: SwapShards

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        sources: BoundarySources,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.sources = sources
        self.reqs: dict[int, tuple[str, int]] = {}  # fetch request id -> (purpose, joiner spawn id)

    def bind(self, *, gens: SwapGenerations, resize: SwapShards) -> None:
        """The peers that are built after the swaps (see the class docstring)."""
        self.gens = gens
        self.resize = resize

    # -- the fetches in flight --------------------------------------------------------------------
    def owns(self, req: int) -> bool:
        """Whether fetch ``req`` is a swap's (a prepare or catch-up fetch)."""
        return req in self.reqs

    def answered(self, req: int) -> tuple[str, int]:
        """Fetch ``req`` (one this owns) is answered: its (purpose, joiner spawn id)."""
        purpose, sid = self.reqs.pop(req)
        self.io.done(req)
        return purpose, sid

    def forget(self, a: BoundarySwap, *, ok: bool) -> None:
        """Swap ``a`` ended: a late answer to one of its fetches is ignored like any stale fetch;
        one that did not swap (not ``ok``) drops the boundary fetches it asked early."""
        for req in [q for q, (_, sid) in self.reqs.items() if a.joiner(sid) is not None]:
            del self.reqs[req]
            self.io.done(req)
        if not ok:
            for j in a.joiners:
                if j.boundary_req is not None:
                    self.sources.drop_early(j.boundary_req)

    # -- actions ----------------------------------------------------------------------------------
    def do(self, a: BoundarySwap, act: Action) -> None:
        """Carry out ``act`` of swap ``a`` (every action but ``Finished``, the swaps' own)."""
        v = self.view
        if isinstance(act, Emit):
            self.events.emit(act.event())
        elif isinstance(act, Fetch):
            self._fetch(a, act)
        elif isinstance(act, Prepare):
            self._send_prepare(act.sid, act.rank, act.world_size, act.step)
        elif isinstance(act, Pause):
            self.io.send_members(PauseMsg(at=act.at).encode())
        elif isinstance(act, Continue):
            self.io.send_members(ContinueMsg().encode())
        elif isinstance(act, Retire):
            w = v.workers.get(act.sid)
            if w is not None and w.live and not v.is_member(w):
                w.role, w.rank = Role.RETIRED, None
                self.io.kill(act.sid, signal.SIGKILL)  # a prepared joiner cannot take another rank
                if act.respawn and v.nodes[w.node].alive:
                    self.io.spawn(w.node, Role.SPARE, None)
        elif isinstance(act, Release):
            w = v.workers.get(act.sid)
            if w is not None and w.role is Role.JOINER:
                w.role, w.rank = Role.SPARE, None  # not told anything yet: idle again
        elif isinstance(act, SwapNow):
            self.swap(a, act)

    def _fetch(self, a: BoundarySwap, act: Fetch) -> None:
        if act.purpose == "boundary":
            j = a.joiner(act.sid)
            assert j is not None
            j.boundary_req = self.sources.fetch_early(
                act.target, act.rank, act.step, act.source, as_rank=act.as_rank, base=act.base
            )
            return
        req = self.io.fetch(
            act.target,
            act.rank,
            act.step,
            act.source,
            "local",
            as_rank=act.as_rank,
            base=act.base,
            track=act.track,
        )
        self.reqs[req] = (act.purpose, act.sid)
        if act.purpose == "catchup" and a.catch is not None:
            a.catch.catchup_req = req

    def swap(self, a: BoundarySwap, s: SwapNow) -> None:
        """Every rank stopped after the boundary: the generation with the joiners in their ranks."""
        v = self.view
        if s.leaver is not None:
            leaver = v.workers[s.leaver]
            leaver.role, leaver.rank = Role.RETIRED, None  # its exit is no failure
            self.io.kill(s.leaver, signal.SIGKILL)  # its snapshot of the boundary stays in its node's memory
        self.gens.open_generation()
        a.generation = v.generation
        old_world = v.world_size
        v.world_size = s.world_size
        now = self.clock.monotonic()
        for rank, (sid, node) in s.ranks.items():
            w = v.workers[sid]
            w.role, w.rank = Role.WORKER, rank
            w.last_progress, w.stepped = now, False
            v.members[rank] = sid
            v.rank_node[rank] = node
        label = str(a.kind) if a.kind is SwapKind.MIGRATION else "grow"
        r = self.gens.boundary_generation(
            s.step, dict.fromkeys(s.ranks, label), fresh=set(s.ranks) if s.fresh else None
        )
        early = {j.rank: j.boundary_req for j in a.joiners}
        fetches = {}
        if not a.fetch_boundary:  # every rank reshards from all the old ranks' boundary
            self.resize.reshard_at_boundary(r, s.step, old_world)
        else:
            for rank in s.ranks:
                src_rank, src = s.sources.get(rank, (s.source_rank, s.source))
                fetches[rank] = self.sources.fetch_for(
                    r, rank, s.step, src, "local", src_rank=src_rank, base=s.base, early=early.get(rank)
                )
        if a.kind is SwapKind.GROW:
            shards = self.resize.data_shards(v.world_size)
            self.events.emit(
                ev.Grow(
                    world_size=v.world_size,
                    old_world_size=old_world,
                    boundary=s.step,
                    shards={str(k): list(sh) for k, sh in enumerate(shards)},
                )
            )
            self.gens.launch(r, tier="memory", fetches=fetches, grow=sorted(s.ranks))
        else:
            self.gens.launch(r, tier="memory", fetches=fetches, migration=a.rank)

    def _send_prepare(self, sid: int, rank: int, world_size: int, step: int | None) -> None:
        """Tell a joiner (a migration's or a grow's) its rank: it restores ``step``, which its node
        holds, and warms up while the job trains; it is no member until the swap."""
        shards = self.resize.shards_of(rank, world_size)
        self.io.send(
            self.view.workers[sid],
            ReconfigureMsg(
                gen=self.view.generation,
                rank=rank,
                world_size=world_size,
                env=rank_env(self.view, sid, rank, world_size),  # its node's, if the swap happens
                restore_step=step,
                recovery=False,
                prepare=True,
                shards=tuple(shards["shards"]) if "shards" in shards else None,
                num_shards=shards.get("num_shards"),
                divisor=shards.get("divisor"),
            ).encode(),
        )
