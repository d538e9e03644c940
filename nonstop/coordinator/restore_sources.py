"""Where each rank's restore step comes from: another node's memory (fetches) or the durable tier.

* **fetches**: a node that will play a rank without holding its restore step in memory fetches
  it from a peer that does (the target's own replica first: a copy within the node); a
  generation waits for its fetches before the rank restores. A swap's boundary fetch is asked
  for *early*, as soon as the source rank completed the step, before its generation exists; the
  generation adopts it (waited for while in flight, asked again if it failed). A fetch that
  fails fails the job: the step exists nowhere else the plan knows of.
* **durable tier**: every node installs its ranks of the newest checkpoint that loads (older
  ones on failure); a checkpoint of another world size serves an elastic job only.

Collaborators: the view, the executor (every request to a node), the event log, the job's life
(a fetch that fails fails the job), the durable tier's URL and whether the job is elastic; and,
bound late (:meth:`RestoreSources.bind`, since both are built with this operation as their peer),
the generation being set up (a :class:`~nonstop.coordinator.peers.FetchWaiter`: its generation
and where a finished fetch is reported) and the job's size (a
:class:`~nonstop.coordinator.peers.ReshardNeeds`: which old ranks a node's ranks reshard from).

Threading: the coordinator's thread only. I/O goes through the executor; the nodes' answers to an
install are events, judged by :meth:`RestoreSources.install_tick`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import NodeRecord
from nonstop.errors import NonstopError
from nonstop.policy.decisions import restore_source
from nonstop.policy.elastic import resume_sources
from nonstop.policy.planning import Inventory
from nonstop.policy.reconfiguration import FetchDone, Reconfiguration
from nonstop.protocol.agent import InstallDurableMsg
from nonstop.protocol.wire import Fetched, Installed, Lost

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import FetchWaiter, ReshardNeeds
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog

__all__ = ["DurableSteps", "RestoreSources"]


class DurableSteps(Protocol):
    """What the restore sources read of a durable tier (a
    :class:`~nonstop.snapshot.durable.DurableStore`); each may raise ``NonstopError``."""

    def steps(self) -> list[int]: ...

    def latest_step(self) -> int | None: ...

    def world_size_at(self, step: int) -> int: ...


def open_durable(url: str) -> DurableSteps:
    """The durable tier at ``url`` (imported here: the tier's backends load only when used)."""
    from nonstop.snapshot.durable import DurableStore

    return DurableStore(url)


class RestoreSources:
    """Fetches in flight (``waiting_fetch``), early boundary fetches (``early``), durable installs.

    ``durable_url``: the durable tier (None: none configured); ``elastic``: the job may change
    size, so a checkpoint of another world size serves it; ``install_timeout_s``: how long an
    install waits for every node's answer (``--persist-timeout``); ``durable``: opens the tier
    at a URL (a fake in a test). :meth:`bind` must be called before the first generation."""

    setup: FetchWaiter
    needs: ReshardNeeds

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        durable_url: str | None,
        elastic: bool,
        install_timeout_s: float,
        durable: Callable[[str], DurableSteps] = open_durable,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.durable_url = durable_url
        self.elastic = elastic
        self.install_timeout_s = install_timeout_s
        self.durable = durable
        self.clock = clock
        self.waiting_fetch: dict[int, tuple[int, int]] = {}  # request id -> (rank, generation)
        # fetches asked for before their generation (a swap's boundary): request id -> (rank, ok),
        # ok None while in flight; the generation adopts them (``fetch_for(early=...)``)
        self.early: dict[int, tuple[int, bool | None]] = {}
        self.installing: _Install | None = None  # a durable checkpoint being installed
        # a reshard's fetches to one node: request id -> (the node's shared barrier, the old rank)
        self.barriers: dict[int, tuple[_Barrier, int]] = {}

    def bind(self, *, setup: FetchWaiter, needs: ReshardNeeds) -> None:
        """The peers built after this operation (each is given it): the generation being set up,
        which waits for the fetches, and the job's size, which says what a reshard needs. A late
        bind breaks the cycles (setup -> sizes -> sources -> setup) without a request type."""
        self.setup = setup
        self.needs = needs

    def new_generation(self, generation: int) -> None:
        """Generation ``generation`` opened: the install in progress is abandoned, and the
        fetches of older generations are forgotten (a late answer is ignored)."""
        self.cancel_install()
        for req in [q for q, (_, gen) in self.waiting_fetch.items() if gen < generation]:
            del self.waiting_fetch[req]
            self.io.done(req)

    def drop_early(self, req: int) -> None:
        """A swap that asked for boundary fetch ``req`` ended: a late answer is ignored."""
        self.early.pop(req, None)

    def fetch_for(
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
        if early is not None and early in self.early:
            ok = self.early.pop(early)[1]
            if ok is not False:
                if ok is None:
                    self.waiting_fetch[early] = (rank, r.generation)
                    r.waiting_fetch.add(rank)
                return f"{source}:{kind}"
        src = rank if src_rank is None else src_rank
        req = self.io.fetch(self.view.rank_node[rank], src, step, source, kind, as_rank=rank, base=base)
        self.waiting_fetch[req] = (rank, r.generation)
        r.waiting_fetch.add(rank)
        return f"{source}:{kind}"

    def fetch_early(
        self, target: str, rank: int, step: int, source: str, *, as_rank: int, base: int | None = None
    ) -> int:
        """A swap's boundary fetch asked for as soon as the source rank completed the step, before
        its generation exists (the other ranks are still finishing theirs); a request id for
        ``_fetch_for(early=...)``."""
        req = self.io.fetch(target, rank, step, source, "local", as_rank=as_rank, base=base)
        self.early[req] = (as_rank, None)
        return req

    def plan_fetches(self, r: Reconfiguration, step: int, avail: Inventory) -> dict[int, str]:
        """Have each node that will play a rank without holding ``step`` of it fetch it from the
        holder :func:`~nonstop.policy.decisions.restore_source` names (the simulator's choice too)."""
        out: dict[int, str] = {}
        for rank in range(self.view.world_size):
            target = self.view.rank_node[rank]
            src = restore_source(target=target, holders=avail.get(rank, {}).get(step, []))
            assert src is not None, f"rank {rank} holds step {step} nowhere in memory"  # the plan's step
            if not src.fetch:
                continue
            assert src.node is not None and src.kind is not None
            out[rank] = self.fetch_for(r, rank, step, src.node, src.kind, src_rank=r.from_rank.get(rank))
        return out

    def plan_reshard(
        self, r: Reconfiguration, step: int, avail: Inventory, old_world: int
    ) -> dict[str, dict[int, str]]:
        """A resize that reshards (a sharded job without replicas): every node playing a rank of
        generation ``r`` needs every old rank's ``step`` in its memory -- in its own slots (an
        old rank it played), else in its replica slots (a replica it holds, or fetched there from
        a holder) -- only the old ranks whose shards the node's ranks need, where the job's
        layouts are known (``Resizing.needed_on``). Returns node -> old rank -> ``local`` |
        ``replica``, where the node's ranks read them; its ranks are told their generation once
        all its fetches are done."""
        where: dict[str, dict[int, str]] = {}
        view = self.view
        for node in sorted({view.rank_node[rank] for rank in range(view.world_size)}):
            mine: dict[int, str] = {}
            reqs: dict[int, int] = {}  # request -> old rank
            for old in sorted(self.needs.needed_on(node, old_world)):
                holders = [(str(n), str(k)) for n, k in avail.get(old, {}).get(step, [])]
                if (node, "local") in holders or (node, "replica") in holders:
                    mine[old] = "local" if (node, "local") in holders else "replica"
                    continue
                src_node, kind = sorted(holders, key=lambda h: (h[1] != "local", h[0]))[0]
                req = self.io.fetch(node, old, step, src_node, kind, into="replica")
                self.waiting_fetch[req] = (-1, r.generation)  # (dropped with its generation)
                reqs[req] = old
                mine[old] = "replica"
            where[node] = mine
            if reqs:
                barrier = _Barrier(
                    ranks={rank for rank in range(view.world_size) if view.rank_node[rank] == node},
                    left=set(reqs),
                )
                r.waiting_fetch |= barrier.ranks
                self.barriers.update({q: (barrier, old) for q, old in reqs.items()})
        return where

    def on_fetched(self, node: NodeRecord, msg: Fetched) -> None:
        """A fetch a generation waits for (or a swap's boundary fetch, asked early) ended."""
        req = msg.id
        entry = self.barriers.pop(req, None)
        if entry is not None:  # one of a reshard's fetches to this node
            barrier, old = entry
            _, gen = self.waiting_fetch.pop(req, (-1, -1))
            self.io.done(req)
            self.events.emit(
                ev.Fetched(node=node.name, rank=old, ok=msg.ok, seconds=msg.seconds, error=msg.error)
            )
            r = self.setup.reconf
            if r is None or gen != r.generation:
                return
            if not msg.ok:
                self.life.fail(f"old rank {old}'s step could not be fetched to node {node.name}: {msg.error}")
                return
            barrier.left.discard(req)
            if not barrier.left:
                for rank in sorted(barrier.ranks):
                    self.setup.report(FetchDone(rank, self.clock.wall()))
            return
        if req in self.early:  # arrived before the swap adopted it: nothing waits on it yet
            rank = self.early[req][0]
            self.early[req] = (rank, msg.ok)
            self.io.done(req)
            self.events.emit(
                ev.Fetched(
                    node=node.name, rank=rank, ok=msg.ok, seconds=msg.seconds, error=msg.error, early=True
                )
            )
            return
        rank, gen = self.waiting_fetch.pop(req, (-1, -1))
        self.io.done(req)
        r = self.setup.reconf
        self.events.emit(
            ev.Fetched(node=node.name, rank=rank, ok=msg.ok, seconds=msg.seconds, error=msg.error)
        )
        if r is None or gen != r.generation:
            return
        if not msg.ok:
            self.life.fail(f"rank {rank} could not be fetched to node {node.name}: {msg.error}")
            return
        self.setup.report(FetchDone(rank, self.clock.wall()))

    def newest_durable(self) -> tuple[int, int] | None:
        """(step, world size) of the newest durable checkpoint, or None (none, or no tier)."""
        if self.durable_url is None:
            return None
        try:
            store = self.durable(self.durable_url)
            step = store.latest_step()
            return None if step is None else (step, store.world_size_at(step))
        except NonstopError as e:
            self.events.emit(ev.DurableUnavailable(error=str(e)))
            return None

    def restore_from_durable(self, done: Callable[[int | None], None]) -> None:
        """Have every node install its ranks from the newest durable checkpoint that loads (older
        ones when it does not); ``done(step)`` once one is installed everywhere, ``done(None)``
        when none is. The nodes' answers are events (:meth:`install_tick`)."""
        if self.durable_url is None:
            done(None)
            return
        try:
            steps = self.durable(self.durable_url).steps()
        except NonstopError as e:
            self.events.emit(ev.DurableUnavailable(error=str(e)))
            done(None)
            return
        self.install_durable(sorted(steps, reverse=True), self.view.placement(), self.durable_url, done,
                             recovery=True)  # fmt: skip

    def install_durable(
        self,
        steps: list[int],
        placement: dict[str, list[int]],
        url: str,
        done: Callable[[int | None], None],
        *,
        recovery: bool = False,
    ) -> None:
        """Have every node install its ranks of the first of ``steps`` that installs everywhere;
        ``done(step)``, or ``done(None)`` when none does. A checkpoint of another world size
        (written while the job was shrunk) serves an elastic job only: its ranks are data-parallel
        replicas (``resume_sources``). ``recovery``: a recovery's fallback (logged as one)."""
        self.installing = _Install(
            steps=list(steps), placement=placement, url=url, done=done, recovery=recovery
        )
        self._next_install()

    def cancel_install(self) -> None:
        """A newer generation: the install in progress is abandoned (late answers are ignored)."""
        inst, self.installing = self.installing, None
        if inst is not None:
            for req in inst.reqs:
                self.io.replies.pop(req, None)
                self.io.done(req)

    def _next_install(self) -> None:
        inst = self.installing
        assert inst is not None
        while inst.steps:
            step = inst.steps.pop(0)
            try:
                written = self.durable(inst.url).world_size_at(step)
            except NonstopError as e:
                self.events.emit(ev.DurableInstallFailed(step=step, errors=[str(e)]))
                continue
            sources: dict[int, int] = {}
            world = self.view.world_size
            if written != world:
                if not self.elastic:
                    errors: list[str | None] = [f"the checkpoint has {written} ranks, the job {world}"]
                    self.events.emit(ev.DurableInstallFailed(step=step, errors=errors))
                    continue
                sources = {r: s for r, s in resume_sources(written, world).items() if r != s}
            inst.step, inst.t0 = step, self.clock.monotonic()
            inst.deadline = inst.t0 + self.install_timeout_s
            inst.reqs = []
            for n, ranks in inst.placement.items():
                ask = InstallDurableMsg(
                    url=inst.url,
                    step=step,
                    ranks=tuple(ranks),
                    sources={r: sources[r] for r in ranks if r in sources},
                )
                inst.reqs.append(self.io.request(self.view.nodes[n], ask))
            return
        self.installing = None
        inst.done(None)

    def install_tick(self) -> None:
        """Judge the install in progress once every node answered (or ``persist_timeout_s``
        passed): done, or the next older checkpoint."""
        inst = self.installing
        if inst is None or inst.step is None:
            return
        replies = self.io.replies
        if any(r not in replies for r in inst.reqs) and self.clock.monotonic() < inst.deadline:
            return
        got = {r: replies.pop(r) for r in inst.reqs if r in replies}
        for r in inst.reqs:
            self.io.done(r)
        bad = [
            m.error if isinstance(m, Installed | Lost) else f"{type(m).__name__} answer"
            for m in got.values()
            if not isinstance(m, Installed) or not m.ok
        ]
        if bad or len(got) < len(inst.reqs):
            self.events.emit(ev.DurableInstallFailed(step=inst.step, errors=bad or ["timed out"]))
            self._next_install()
            return
        self.installing = None
        if inst.recovery:
            seconds = self.clock.monotonic() - inst.t0
            self.events.emit(ev.RestoreFromDurable(step=inst.step, url=inst.url, seconds=seconds))
        inst.done(inst.step)


@dataclass
class _Barrier:
    """A node's reshard fetches: its ranks wait until none is ``left``."""

    ranks: set[int]
    left: set[int]


@dataclass
class _Install:
    """A durable checkpoint being installed on every node: the steps still to try (newest first),
    the one asked for now and its requests."""

    steps: list[int]
    placement: dict[str, list[int]]
    url: str
    done: Callable[[int | None], None]
    recovery: bool
    step: int | None = None
    reqs: list[int] = field(default_factory=list)
    deadline: float = 0.0
    t0: float = 0.0
