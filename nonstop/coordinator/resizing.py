"""A job changing size: which data shards each rank plays, a shrink carried out on the view, and
where a resharded generation reads the old ranks' state.

* **data shards** (:meth:`Resizing.data_shards`): a data-parallel job spreads its
  ``W0 x --shards-per-rank`` micro-batches over the ranks (``elastic.assign_shards``); a sharded
  job's are its data-parallel indices (``MeshSpec.data_shards``).
* **shrink** (:meth:`Resizing.shrink`): the planned :class:`~nonstop.policy.planning.Shrink`
  applied to the view -- the live ranks of a dropped group retired (a spare takes each one's
  place on its node, for a later grow), the others renumbered, the event logged.
* **shrink first** (:meth:`Resizing.survivor_choice`): whether a failure that spares could
  replace is recovered by a shrink now and a grow later (:mod:`~nonstop.policy.survivors`).
* **reshard** (a sharded job without replicas, ``MeshSpec.reshards``): every rank of the smaller
  generation cuts its new shards out of every old rank's state. :meth:`Resizing.reshard_source`
  says where that state is -- the committed step in the nodes' memory (each node told, once its
  fetches are planned, which old ranks it holds in its own slots and which in its replica slots:
  :meth:`~nonstop.coordinator.restore_sources.RestoreSources.plan_reshard`), else the newest durable
  checkpoint -- and :meth:`Resizing.reshard_for` what one rank is told.

Threading: the coordinator's thread only; I/O through its executor.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nonstop import events as ev
from nonstop.coordinator.view import Role
from nonstop.policy.boundary_swap import Joiner
from nonstop.policy.elastic import play_shards, played
from nonstop.policy.planning import Shrink, dropped_with, may_shrink
from nonstop.policy.reconfiguration import Reconfiguration
from nonstop.policy.survivors import SurvivorChoice, choose, costs_from_reports, shrunk_rate
from nonstop.reshardplan import TensorLayout, needed_old_ranks

if TYPE_CHECKING:
    from nonstop.coordinator.detector import FailureDetector
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.mesh import MeshSpec
    from nonstop.policy.elastic import ElasticPolicy
    from nonstop.policy.planning import Inventory
    from nonstop.policy.survivors import SurvivorMode

__all__ = ["Resizing"]


class StepTimings(Protocol):
    """The swaps' record of when each rank reported its steps (:mod:`nonstop.coordinator.swaps`)."""

    pause_ratios: list[float]

    def forget_steps(self) -> None: ...


class ReshardSources(Protocol):
    """Where a reshard reads the old ranks' state (:mod:`nonstop.coordinator.restore_sources`)."""

    def newest_durable(self) -> tuple[int, int] | None: ...

    def plan_reshard(
        self, r: Reconfiguration, step: int, avail: Inventory, old_world: int
    ) -> dict[str, dict[int, str]]: ...


class Resizing:
    """The coordinator's view of the job's size (see the module docstring). ``num_shards``: the
    job's data shards; ``full_world_size``: its ranks at full size; ``drop_batch``: ``--shrink-batch
    drop``; ``durable_url``: the durable tier a reshard may read; ``detector``: for the median step."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        mesh: MeshSpec | None,
        elastic: ElasticPolicy,
        survivor_mode: SurvivorMode,
        detector: FailureDetector,
        num_shards: int,
        full_world_size: int,
        drop_batch: bool,
        durable_url: str | None,
        swaps: StepTimings,
        sources: ReshardSources,
    ) -> None:
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.mesh = mesh
        self.elastic = elastic
        self.survivor_mode = survivor_mode
        self.detector = detector
        self.num_shards = num_shards
        self.full_world_size = full_world_size
        self.drop_batch = drop_batch
        self.durable_url = durable_url
        self.swaps = swaps
        self.sources = sources
        # how a sharded job's tensors are laid out (rank 0's ``ready``): a reshard's fetches are
        # planned by it (nonstop/reshardplan.py); None: every node gathers every old rank
        self.layouts: tuple[TensorLayout, ...] | None = None

    def needed_on(self, node: str, old_world: int) -> set[int]:
        """The old ranks (of ``old_world``) whose step ``node``'s ranks of the current view cut
        their shards out of in a reshard: by the reported layouts, else all."""
        mesh, v = self.mesh, self.view
        if mesh is None or not self.layouts:
            return set(range(old_world))
        mine = [r for r in range(v.world_size) if v.rank_node.get(r) == node]
        return needed_old_ranks(self.layouts, mesh.with_world(old_world), mesh.with_world(v.world_size), mine)

    @property
    def reshards(self) -> bool:
        """Whether a resize cuts every rank's shards anew (a sharded job without replicas)."""
        return self.mesh is not None and self.mesh.reshards

    def data_shards(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        """The data shards each rank of a generation of ``world_size`` ranks plays (all of the
        job's, or with ``--shrink-batch drop`` those of the ranks at the same places in the
        full job: :func:`~nonstop.policy.elastic.play_shards`)."""
        drop = self.drop_batch
        if self.mesh is not None:
            return self.mesh.data_shards(world_size, drop=drop)
        return play_shards(self.num_shards, self.full_world_size, world_size, drop=drop)

    def survivor_choice(self, missing: Sequence[int]) -> SurvivorChoice:
        """Shrink first or replace first, for a generation without the ``missing`` ranks
        (:func:`~nonstop.policy.survivors.choose`, with what the job measured so far)."""
        world = self.view.world_size
        can = (
            not self.reshards
            and bool(self.view.idle_spares())
            and may_shrink(self.elastic, world, missing)  # elastic, and not below its minimum
        )
        lost = len(dropped_with(self.elastic, world, missing))
        rate = shrunk_rate(self.data_shards(world), self.data_shards(world - lost)) if can else 0.0
        costs = costs_from_reports(
            self.view.reports, step_s=self.detector.median_step_s, swap_ratios=self.swaps.pause_ratios
        )
        return choose(self.survivor_mode, can_shrink=can, costs=costs, rate=rate)

    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]:
        """What ``rank`` is told of its data shards in ``world_size`` (default: the current one)."""
        world = self.view.world_size if world_size is None else world_size
        shards = self.data_shards(world)
        # num_shards: the job's (what a step's samples are numbered by); divisor: the gradient
        # mean's, the shards played (fewer when a shrink drops some: --shrink-batch drop)
        return {"shards": list(shards[rank]), "num_shards": self.num_shards, "divisor": played(shards)}

    def shrink(self, shrink: Shrink, why: str, *, shrink_first: bool = False) -> dict[int, int]:
        """Drop ``shrink.dropped``: the ranks that stay are renumbered ``0..W'-1`` in their old
        order and the shards spread over them; a dropped rank still alive (a sharded job drops
        whole groups) is retired and a spare takes its place on its node. Returns new rank ->
        old rank for every rank renumbered. ``shrink_first``: spares could have taken the ranks;
        the survivors go on first and the spares join by a grow."""
        v = self.view
        old_world = v.world_size
        for rank in shrink.dropped:
            sid = v.members.get(rank)
            w = v.workers.get(sid) if sid is not None else None
            if w is not None and w.live:
                w.role, w.rank = Role.RETIRED, None  # its exit is no failure
                self.io.kill(w.spawn_id, signal.SIGKILL)
                if v.nodes[w.node].alive:  # its place on the node waits as a spare for a grow
                    self.io.spawn(w.node, Role.SPARE, None)
        v.renumber(dict(shrink.new_of), shrink.world_size)
        self.swaps.forget_steps()
        self.events.emit(
            ev.Shrink(
                world_size=v.world_size,
                old_world_size=old_world,
                dropped=list(shrink.dropped),
                renumbered={str(o): n for o, n in shrink.new_of.items() if o != n},
                shards={str(r): list(sh) for r, sh in enumerate(self.data_shards(v.world_size))},
                reason=why,
                shrink_first=shrink_first,
            )
        )
        return {n: o for o, n in shrink.new_of.items() if o != n}

    def reshard_source(self, step: int | None, old_world: int) -> dict[str, Any] | None:
        """Where a resharded generation reads the old ranks' state: ``step`` of ``old_world``
        ranks in memory (``memory`` filled in per node when the fetches are planned), else the
        newest durable checkpoint (``url``); None when there is neither (the job has failed)."""
        if step is not None:
            return {"step": step, "world": old_world, "memory": {}}
        ck = self.sources.newest_durable()
        if ck is None:
            self.life.fail(
                "no step is snapshotted for every rank in memory or in the durable tier "
                f"({self.durable_url or 'none configured'}); cannot reshard the job to "
                f"{self.view.world_size} ranks (persist more often with --persist-every)"
            )
            return None
        return {"url": self.durable_url, "step": ck[0], "world": ck[1]}

    def joiners(self, idle: Mapping[int, str], target: int) -> list[Joiner]:
        """The idle spares (spawn id -> node) a grow to ``target`` ranks brings in, as ranks
        ``W..target-1``. A sharded job with replicas: each restores the shards of the rank with
        its coordinates in group 0 (a grow without replicas reshards every rank instead)."""
        v, unit = self.view, self.elastic.unit
        by_source = self.mesh is not None and not self.reshards
        return [
            Joiner(
                sid=sid,
                rank=v.world_size + i,
                node=idle[sid],
                source=(i % unit, v.rank_node[i % unit]) if by_source else None,
            )
            # by node: consecutive new ranks (a TP group) land on one node when it has the spares
            for i, sid in enumerate(sorted(idle, key=lambda sid: (idle[sid], sid))[: target - v.world_size])
        ]

    def reshard_at_boundary(self, r: Reconfiguration, step: int, old_world: int) -> None:
        """A grow of a job without replicas: every rank of generation ``r`` (the old ones paused
        after ``step``, the joiners) cuts its shards out of the old ranks' ``step``, which each
        old rank holds in its own node's memory; each node gathers them (fetches planned)."""
        held = {o: {step: [(self.view.rank_node[o], "local")]} for o in range(old_world)}
        where = self.sources.plan_reshard(r, step, held, old_world)
        r.reshard = {"step": step, "world": old_world, "memory": where}
        r.fresh = set(range(r.world_size))

    def reshard_for(self, reshard: dict[str, Any], rank: int) -> dict[str, Any]:
        """What ``rank`` reshards from: a durable checkpoint, or (memory) where its node holds
        every old rank's step: ``{old rank: "local" | "replica"}``."""
        if "memory" not in reshard:
            return reshard
        where = reshard["memory"].get(self.view.rank_node.get(rank), {})
        return {**reshard, "memory": {str(o): kind for o, kind in where.items()}}
