"""The simulated job's elastic world: how many ranks play, who is out, who joins when.

:class:`ElasticWorld` is the state nonstop's simulated strategy keeps about resizing, and the
runtime's questions it asks on that state, each through the runtime's own module (tests
monkeypatch them and see the simulation change):

* :meth:`ElasticWorld.unplaced` -- :meth:`~nonstop.policy.elastic.ElasticPolicy.on_unplaced` for
  a node's ranks that no hot spare can take (wait for the pool node, shrink, or fail);
* :meth:`ElasticWorld.survivor_choice` -- :func:`~nonstop.policy.survivors.choose` (shrink first
  or replace first), when :func:`~nonstop.policy.planning.may_shrink` lets the job go on without
  the node;
* :meth:`ElasticWorld.grow` -- :meth:`~nonstop.policy.elastic.ElasticPolicy.grow_to` when
  prepared machines are ready to join;
* :meth:`ElasticWorld.rate` -- :func:`~nonstop.policy.elastic.play_shards` and
  :func:`~nonstop.policy.survivors.shrunk_rate`: the shrunk job's rate (``--shrink-batch``).

Granularity: a unit of ``unit_nodes`` nodes leaves and joins together: a node's ``gpus_per_node``
ranks in a data-parallel job, a model copy's in an HSDP job (the runtime drops whole replica
groups); a failure of a node in a unit already out touches nothing (:meth:`ElasticWorld.gone`).
"""

from __future__ import annotations

import heapq

from nonstop.policy import elastic, planning, survivors
from nonstop.policy.elastic import ElasticAction, ElasticDecision
from nonstop.policy.survivors import SurvivorChoice, SurvivorCosts, SurvivorMode
from nonstop.sim.api import STEADY

__all__ = ["ElasticWorld"]


class ElasticWorld:
    """The world size, the positions dropped by a shrink (with their causes) and the machines
    that will join them, for one simulated run."""

    def __init__(
        self,
        *,
        num_gpus: int,
        gpus_per_node: int,
        min_world_size: int,
        wait_s: float,
        shards_per_rank: int,
        drop: bool = False,
        replica_nodes: int = 0,
    ) -> None:
        self.num_gpus = num_gpus
        self.gpus_per_node = gpus_per_node
        # the nodes that leave and join together: one in a data-parallel job (replica_nodes 0;
        # its ranks are its GPUs), a model copy's in an HSDP job (the runtime shrinks by whole
        # replica groups: MeshSpec.with_world; the copy's other nodes wait idle for the grow)
        self.unit_nodes = replica_nodes or 1
        self.unit = self.unit_nodes * gpus_per_node  # GPUs per unit
        # GPUs per data-parallel rank, the unit of the data shards: one GPU, or a model copy
        self.rank_gpus = replica_nodes * gpus_per_node or 1
        self.shards_per_rank = shards_per_rank
        self.drops_batch = drop  # --shrink-batch drop: a shrunk job skips the lost ranks' shards
        self.policy = elastic.ElasticPolicy(
            full_world_size=num_gpus, min_world_size=min_world_size or num_gpus, wait_s=wait_s
        )
        self.world = num_gpus  # data-parallel ranks playing now
        self.absent: dict[int, str] = {}  # unit dropped by a shrink -> its cause, until it joins
        self._joins: list[tuple[float, int]] = []  # (when a machine is ready to join, its unit)
        self._joiner: dict[int, str] = {}  # unit -> what joins it ("pool" or a hot "spare")
        self._lost: dict[int, int] = {}  # unit -> the node whose loss dropped it
        self._rates: dict[int, float] = {}  # world size -> rate

    @property
    def full(self) -> bool:
        return self.world >= self.num_gpus

    @property
    def newest_cause(self) -> str:
        """The cause of the newest shrink still in effect (what shrunk time is booked to)."""
        return next(reversed(self.absent.values()), STEADY)

    def rate(self, world_size: int) -> float:
        """A job of ``world_size`` ranks' speed over the full job's, in samples per second (0
        without ranks): :func:`~nonstop.policy.survivors.shrunk_rate` of the shards each plays
        (:func:`~nonstop.policy.elastic.play_shards` of the job's ``num_gpus x shards_per_rank``:
        keep, the slowest rank plays the most; drop, every rank its own, fewer in all)."""
        if world_size <= 0:
            return 0.0
        if world_size not in self._rates:
            g = self.num_gpus // self.rank_gpus  # data-parallel ranks (model copies in HSDP)
            n = g * self.shards_per_rank
            full = elastic.play_shards(n, g, g)
            now = elastic.play_shards(n, g, max(1, world_size // self.rank_gpus), drop=self.drops_batch)
            self._rates[world_size] = survivors.shrunk_rate(full, now)
        return self._rates[world_size]

    def unplaced(self, provision_s: float) -> tuple[ElasticDecision, float]:
        """What the runtime's policy does with a node's ranks no spare can take, asked again after
        each WAIT, as the runtime re-plans. A WAIT the pool node ends (it arrives ``provision_s``
        after the plan) or that names no time waits for it: the decision is returned with that
        wait. Returns the last decision and the seconds waited before it."""
        waited = 0.0
        while True:
            d = self.policy.on_unplaced(world_size=self.world, unplaced=self.unit, waited_s=waited)
            if d.action is not ElasticAction.WAIT:
                return d, waited
            if d.wait_s <= 0 or waited + d.wait_s >= provision_s:
                return d, provision_s
            waited += d.wait_s

    def survivor_choice(self, mode: SurvivorMode, costs: SurvivorCosts) -> SurvivorChoice:
        """The runtime's choice for a node a hot spare could replace: may the job go on without
        its ranks (elastic, not below the minimum), and at what rate, with ``costs``."""
        missing = range(self.world - self.unit, self.world)
        can = self.policy.enabled and planning.may_shrink(self.policy, self.world, missing)
        rate = min(1.0, self.rate(self.world - self.unit))
        return survivors.choose(mode, can_shrink=can, costs=costs, rate=rate)

    def gone(self, node: int) -> bool:
        """Whether ``node``'s unit is out of the job (dropped by a shrink, not joined again)."""
        return node // self.unit_nodes in self.absent

    def drop(self, node: int, *, cause: str, world_size: int, join_at: float, joiner: str) -> None:
        """Node ``node``'s unit is out (a shrink to ``world_size``); ``joiner`` is ready to take
        the node's place at ``join_at``."""
        unit = node // self.unit_nodes
        self.world = world_size
        self.absent[unit] = cause
        self._joiner[unit] = joiner
        self._lost[unit] = node
        heapq.heappush(self._joins, (join_at, unit))

    def next_join(self) -> float | None:
        return self._joins[0][0] if self._joins else None

    def grow(self, now: float) -> tuple[list[int], str, str | None]:
        """The machines ready by ``now`` join if the runtime's ``grow_to`` grows the world.
        Returns the lost nodes whose machines were ready, the cause of the shrink the first
        undoes, and what joined (``"pool"`` or ``"spare"``; None: the policy does not grow, they
        stay out)."""
        ready: list[int] = []
        while self._joins and self._joins[0][0] <= now:
            ready.append(heapq.heappop(self._joins)[1])
        cause = self.absent.get(ready[0], STEADY) if ready else STEADY
        nodes = [self._lost[u] for u in ready]
        target = self.policy.grow_to(world_size=self.world, idle_spares=len(ready) * self.unit)
        if target <= self.world:
            return nodes, cause, None
        self.world = target
        sources = {self._joiner.pop(u) for u in ready}
        for u in ready:
            self.absent.pop(u, None)
            self._lost.pop(u, None)
        return nodes, cause, min(sources)
