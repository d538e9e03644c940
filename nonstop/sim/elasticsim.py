"""The simulated job's elastic world: how many ranks play, who is out, who joins when.

:class:`ElasticWorld` is the state nonstop's simulated strategy keeps about resizing, and the
runtime's questions it asks on that state, each through the runtime's own module (tests
monkeypatch them and see the simulation change):

* :meth:`ElasticWorld.unplaced` -- :meth:`~nonstop.runtime.elastic.ElasticPolicy.on_unplaced` for
  a node's ranks that no hot spare can take (wait for the pool node, shrink, or fail);
* :meth:`ElasticWorld.survivor_choice` -- :func:`~nonstop.runtime.survivors.choose` (shrink first
  or replace first), when :func:`~nonstop.runtime.planning.may_shrink` lets the job go on without
  the node;
* :meth:`ElasticWorld.grow` -- :meth:`~nonstop.runtime.elastic.ElasticPolicy.grow_to` when
  prepared machines are ready to join;
* :meth:`ElasticWorld.slowest_rank_shards` -- :func:`~nonstop.runtime.elastic.assign_shards`: the
  shrunk job's rate.

Granularity: positions are nodes; a node's ``gpus_per_node`` ranks leave and join together.
"""

from __future__ import annotations

import heapq

from nonstop.runtime import elastic, planning, survivors
from nonstop.runtime.elastic import ElasticAction, ElasticDecision
from nonstop.runtime.survivors import SurvivorChoice, SurvivorCosts, SurvivorMode
from nonstop.sim.api import STEADY

__all__ = ["ElasticWorld"]


class ElasticWorld:
    """The world size, the positions dropped by a shrink (with their causes) and the machines
    that will join them, for one simulated run."""

    def __init__(
        self, *, num_gpus: int, gpus_per_node: int, min_world_size: int, wait_s: float, shards_per_rank: int
    ) -> None:
        self.num_gpus = num_gpus
        self.gpus_per_node = gpus_per_node
        self.shards_per_rank = shards_per_rank
        self.policy = elastic.ElasticPolicy(
            full_world_size=num_gpus, min_world_size=min_world_size or num_gpus, wait_s=wait_s
        )
        self.world = num_gpus  # data-parallel ranks playing now
        self.absent: dict[int, str] = {}  # position dropped by a shrink -> its cause, until it joins
        self._joins: list[tuple[float, int]] = []  # (when a machine is ready to join, its position)
        self._joiner: dict[int, str] = {}  # position -> what joins it ("pool" or a hot "spare")
        self._slowest: dict[int, int] = {}  # world size -> most shards one rank plays

    @property
    def full(self) -> bool:
        return self.world >= self.num_gpus

    @property
    def newest_cause(self) -> str:
        """The cause of the newest shrink still in effect (what shrunk time is booked to)."""
        return next(reversed(self.absent.values()), STEADY)

    def slowest_rank_shards(self, world_size: int) -> int:
        """The shards the busiest of ``world_size`` ranks plays (``elastic.assign_shards`` of the
        job's ``num_gpus x shards_per_rank`` shards); over ``shards_per_rank``, the factor by which
        a step of the shrunk job is longer than the full job's."""
        if world_size not in self._slowest:
            shards = elastic.assign_shards(self.num_gpus * self.shards_per_rank, world_size)
            self._slowest[world_size] = max(len(s) for s in shards)
        return self._slowest[world_size]

    def rate(self, world_size: int) -> float:
        """A job of ``world_size`` ranks' speed over the full job's (0 without ranks)."""
        return self.shards_per_rank / self.slowest_rank_shards(world_size) if world_size > 0 else 0.0

    def unplaced(self, provision_s: float) -> tuple[ElasticDecision, float]:
        """What the runtime's policy does with a node's ranks no spare can take, asked again after
        each WAIT, as the runtime re-plans. A WAIT the pool node ends (it arrives ``provision_s``
        after the plan) or that names no time waits for it: the decision is returned with that
        wait. Returns the last decision and the seconds waited before it."""
        waited = 0.0
        while True:
            d = self.policy.on_unplaced(world_size=self.world, unplaced=self.gpus_per_node, waited_s=waited)
            if d.action is not ElasticAction.WAIT:
                return d, waited
            if d.wait_s <= 0 or waited + d.wait_s >= provision_s:
                return d, provision_s
            waited += d.wait_s

    def survivor_choice(self, mode: SurvivorMode, costs: SurvivorCosts) -> SurvivorChoice:
        """The runtime's choice for a node a hot spare could replace: may the job go on without
        its ranks (elastic, not below the minimum), and at what rate, with ``costs``."""
        missing = range(self.world - self.gpus_per_node, self.world)
        can = self.policy.enabled and planning.may_shrink(self.policy, self.world, missing)
        rate = min(1.0, self.rate(self.world - self.gpus_per_node))
        return survivors.choose(mode, can_shrink=can, costs=costs, rate=rate)

    def drop(self, node: int, *, cause: str, world_size: int, join_at: float, joiner: str) -> None:
        """Node ``node`` is out (a shrink to ``world_size``); ``joiner`` is ready to take its
        place at ``join_at``."""
        self.world = world_size
        self.absent[node] = cause
        self._joiner[node] = joiner
        heapq.heappush(self._joins, (join_at, node))

    def next_join(self) -> float | None:
        return self._joins[0][0] if self._joins else None

    def grow(self, now: float) -> tuple[list[int], str, str | None]:
        """The machines ready by ``now`` join if the runtime's ``grow_to`` grows the world.
        Returns the positions that were ready, the cause of the shrink the first undoes, and what
        joined (``"pool"`` or ``"spare"``; None: the policy does not grow, they stay out)."""
        ready: list[int] = []
        while self._joins and self._joins[0][0] <= now:
            ready.append(heapq.heappop(self._joins)[1])
        cause = self.absent.get(ready[0], STEADY) if ready else STEADY
        target = self.policy.grow_to(world_size=self.world, idle_spares=len(ready) * self.gpus_per_node)
        if target <= self.world:
            return ready, cause, None
        self.world = target
        sources = {self._joiner.pop(pos) for pos in ready}
        for pos in ready:
            self.absent.pop(pos, None)
        return ready, cause, min(sources)
