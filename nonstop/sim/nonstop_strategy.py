"""nonstop's strategy, driven by the runtime's own pure policies.

Every decision goes through :mod:`nonstop.policy.decisions`, called through the module so that the
simulator and the runtime cannot disagree (a test monkeypatches them and sees the result change);
only the failure's class is the simulator's own (:func:`nonstop.sim.actions.recovery_action` --
restart in place, replace the node, quarantine it, or migrate a planned event -- where the runtime
grades what it saw of the failure):

* :class:`~nonstop.policy.decisions.QuarantinePolicy` — a node failing too often is vacated;
* :func:`~nonstop.policy.decisions.place_replicas` — which nodes hold each node's snapshot replicas
  (asked on a window of the ring around the node: the same answer as on the whole ring, see
  :meth:`Nonstop.holders`, at O(window) cost instead of O(nodes^2));
* :func:`~nonstop.policy.decisions.choose_replacements` — a hot spare (process spare on the node, or
  a spare node), a cold process in place, or a fresh node from the scheduler's pool;
* :func:`~nonstop.policy.decisions.restore_source` — the coordinator's choice of where a rank
  restores from, asked with what the plan's inventory would hold for the failed node's ranks
  (:func:`~nonstop.sim.nonstop_costs.restore_tier`): local memory, a peer's replica or a
  survivor's rescued step (fetched), or the durable tier (then every rank rolls back to the newest
  persisted step).

Elasticity (``NonstopParams.min_world_size``) goes through :mod:`nonstop.policy.elastic` the same
way: a lost node whose ranks no hot spare can take (they would wait for a fresh node from the
scheduler's pool) is handed to :meth:`~nonstop.policy.elastic.ElasticPolicy.on_unplaced` — wait
for that node, shrink to fewer data-parallel ranks, or fail (then it waits for the pool node, as
without elasticity); the shrunk job's rate comes from
:func:`~nonstop.policy.elastic.assign_shards` (the slowest rank plays the most shards), and it
grows back through :meth:`~nonstop.policy.elastic.ElasticPolicy.grow_to` when the pool node joins.

Survivors (``NonstopParams.survivors``, the runtime's ``--survivors``): a failure a hot spare could
take goes to :func:`~nonstop.policy.survivors.choose` when :func:`~nonstop.policy.planning.may_shrink`
lets the job go on without the node -- shrink first (the survivors pause for one rebuild and train
shrunk while the spare prepares: launch, fetch, restore, a warm-up step; it then joins by a grow)
or replace first (everyone waits for the spare), with this job's costs at scale as the runtime
passes it the costs it measured.

Proactive moves (``NonstopParams.straggler``, the runtime's ``--straggler`` and ``--on-degraded``):
a fail-slow rank and a degraded node before its failure are moved live when the runtime's
detector, grading and proactive policy say so (:mod:`nonstop.sim.proactivesim`).

Granularity: one call per failed node; the node's ranks move together (a node's GPUs share its
snapshot memory and its spare), so ``failed`` holds one entry for the node's rank group. Ranks are
GPUs (one data-parallel rank per GPU, as the runtime starts them): an elastic data-parallel job
(``replica_nodes`` 0) has ``num_gpus`` shards and loses ``gpus_per_node`` ranks per node; an HSDP
job has one shard per model copy and loses the lost node's whole copy (the runtime shrinks by
replica groups), its other nodes idle until the copy grows back.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from nonstop.policy import decisions as policy
from nonstop.policy.boundary_swap import SwapKind
from nonstop.policy.decisions import FailureKind, Placement, ReplacementSource, Tier
from nonstop.policy.elastic import ElasticAction, ElasticDecision
from nonstop.policy.survivors import SurvivorChoice, SurvivorCosts
from nonstop.sim import actions, recoverysim, swapsim
from nonstop.sim.actions import RecoveryAction
from nonstop.sim.api import (
    JobSpec,
    Recovery,
    RunContext,
    SlowResponse,
    Trained,
    default_spare_nodes,
    require,
)
from nonstop.sim.calibrate import Calibration, load_calibration, rendezvous_s
from nonstop.sim.elasticsim import ElasticWorld
from nonstop.sim.failures import Cause
from nonstop.sim.nonstop_costs import (
    default_replica_nodes,
    detect_s,
    has_donors,
    restore_tier,
    swap_rebuild_s,
)
from nonstop.sim.nonstop_params import NonstopParams
from nonstop.sim.proactivesim import ProactiveMoves
from nonstop.sim.recoverysim import RecoveryCosts
from nonstop.sim.strategies import SparePool
from nonstop.sim.swapsim import SwapCosts

__all__ = ["Nonstop", "NonstopParams", "swap_rebuild_s"]

POOL = "pool"  # a fresh node from the scheduler (cold, pays node_provision_s)


class Nonstop:
    """Every-step snapshots in memory, peer replicas, hot spares, in-place rebuild, live migration.

    A process failure (crash, hang, error) restarts the node's ranks in place from local memory,
    on a process spare if one is ready; a lost node is replaced by a spare node (or the pool) that
    restores from a peer replica; a node the quarantine policy flags is vacated the same way; a
    planned event migrates live (one pause, nothing lost). With rescues the replaced ranks restore
    the survivors' rescued step instead, fetched from a donor on another node (as the runtime's
    plan does). When no memory holds the step (no rescue, and a lost node's replica holders all
    unavailable too), every rank rolls back to the newest durable checkpoint. Survivors keep
    their processes; the group is rebuilt in place (rendezvous law at the job's scale).

    Elastic (``min_world_size``): a lost node that only the scheduler's pool could replace is
    dropped instead, when the runtime's policy says so. The survivors restore their own newest
    snapshot (nothing rolled back beyond the step in flight: detect, plan, restore from memory,
    rebuild) and train on with ``W'`` ranks playing the ``num_gpus`` shards: a step takes as long
    as the slowest rank's ``max(len(shards))`` micro-batches, so the job progresses at
    ``1 / max(len(shards))`` of its full rate (``assign_shards``). The pool node, asked for when
    the recovery is planned, arrives ``node_provision_s`` later, prepares while the job trains (cold
    launch, fetch and restore rank 0's step, one warm-up step) and joins at a step boundary: a
    pause of ``grow_pause_steps`` steps plus a rendezvous, nothing rolled back.
    """

    def __init__(
        self, *, job: JobSpec, params: NonstopParams | None = None, calibration: Calibration | None = None
    ) -> None:
        self.name = "nonstop"
        self.job = job
        self.p = p = params or NonstopParams()
        self.cal = cal = calibration or load_calibration()
        b = job.state_bytes_per_gpu
        self.num_spare_nodes = default_spare_nodes(job.num_nodes) if p.spare_nodes is None else p.spare_nodes
        self.spare_gpus = self.num_spare_nodes * job.gpus_per_node
        self.stall = cal.snapshot_stall_s(b, job.step_s) if p.stall_s is None else p.stall_s
        self.replica_nodes = default_replica_nodes(job) if p.replica_nodes is None else p.replica_nodes
        copies = job.num_nodes // self.replica_nodes if self.replica_nodes else job.num_gpus
        self.every = p.interval(self.stall, job.step_s, copies=copies)
        require(
            self.stall < job.step_s * self.every,
            f"a snapshot stall of {self.stall:.2f} s does not fit in {self.every} step(s) of "
            f"{job.step_s} s: snapshot less often (--snapshot-every)",
        )
        # what every step gives up: the snapshot's stall, and the worker's own per-step cost
        self.steady_fraction = (self.stall / self.every + cal.nonstop_step_overhead_s) / job.step_s
        self.transfer = cal.peer_transfer_s(b)
        # a snapshot protects its step once its copy to host memory is done (overlapped with the
        # next step), and against a lost node once every replica has reached its holder
        self.capture = cal.capture_s(b)
        self.replica_lag = p.replicas * self.transfer
        self.restore_local = cal.restore_local_s(b)
        self.durable_read = cal.durable_read_s(b, job.num_gpus, job.gpus_per_node)
        self.persist_write = cal.durable_write_s(b, job.num_gpus, job.gpus_per_node)
        require(
            self.persist_write <= p.persist_every_s,
            f"persisting takes {self.persist_write:.0f} s: use --persist-every-s >= that",
        )
        self.swap_rebuild = swap_rebuild_s(job, self.replica_nodes)  # a boundary swap: what changed
        self.rescues = p.rescue and has_donors(self.every, copies)
        # a failure: every group, or (keep_on_failure) what changed, as a swap
        self.rebuild = self.swap_rebuild if p.keep_on_failure else rendezvous_s(job.num_nodes)
        # live migrations and grows: the runtime's own boundary-swap machine, its actions timed at
        # this job's scale (sim/swapsim.py); on links this fast the whole step beats a delta (the
        # encode costs more than the bytes it saves: bench_catchup.py), so a delta takes as long
        costs = SwapCosts(
            step_s=job.step_s,
            fetch_s=self.transfer,
            delta_fetch_s=self.transfer,
            restore_s=self.restore_local,
            rebuild_s=self.swap_rebuild,
            extra_pause_s=cal.migration_pause_steps * job.step_s,
        )
        self.migration_swap = swapsim.time_swap(SwapKind.MIGRATION, costs)
        self.migration = self.migration_swap.pause_s if p.migration_pause_s is None else p.migration_pause_s
        require(
            p.min_world_size <= job.num_gpus,
            f"--min-world-size must be in 0..{job.num_gpus} (the job's GPUs, one rank each; 0 never "
            f"shrinks); got {p.min_world_size}",
        )
        # an elastic grow: the pool node's processes start, its joiners prepare while the job trains,
        # then every rank pauses at the boundary (the same machine)
        grow_costs = replace(costs, extra_pause_s=cal.grow_pause_steps * job.step_s)
        self.grow_swap = swapsim.time_swap(SwapKind.GROW, grow_costs, joiners=job.gpus_per_node)
        self.grow_prepare = cal.launch_cold_s + self.grow_swap.prepare_s
        self.grow_pause = self.grow_swap.pause_s
        self._holders: dict[int, list[int]] = {}
        swap, plan = self.migration_swap, cal.plan_s
        self.moves = ProactiveMoves.for_job(p.straggler, p.quarantine, job, swap, self.migration, plan)

    # -- the ring of replica holders ------------------------------------------------------------
    def holders(self, pos: int) -> list[int]:
        """Positions holding replicas of node ``pos`` (``policy.place_replicas``, cached).

        Domains are blocks of ``nodes_per_domain`` consecutive positions. Walking the ring from
        ``pos``, at most ``nodes_per_domain - 1`` same-domain nodes come before ``r`` nodes of other
        domains, so the policy asked on the window ``pos .. pos + nodes_per_domain + r - 1`` gives
        the answer it gives on the whole ring (tested); small jobs use the whole ring.
        """
        if pos not in self._holders:
            n, d, r = self.job.num_nodes, self.job.nodes_per_domain, self.p.replicas
            size = n if n <= 2 * (d + r) else d + r
            names = [f"n{(pos + k) % n}" for k in range(size)]
            domains = {nm: f"d{int(nm[1:]) // d}" for nm in names}
            placed = policy.place_replicas(names, domains, r)[names[0]]
            self._holders[pos] = [int(nm[1:]) for nm in placed]
        return self._holders[pos]

    # -- per run ----------------------------------------------------------------------------------
    def begin(self, ctx: RunContext) -> None:
        del ctx
        self.work = 0.0
        self.history: dict[int, list[float]] = {}
        self.proc_spare_at: dict[int, float] = {}  # position -> when its process spare is ready again
        self.mem_back_at: dict[int, float] = {}  # position -> when its snapshot memory is usable again
        self.spares = SparePool(self.num_spare_nodes)
        self.elastic = ElasticWorld(
            num_gpus=self.job.num_gpus,
            gpus_per_node=self.job.gpus_per_node,
            min_world_size=self.p.min_world_size,
            wait_s=self.p.elastic_wait_s,
            shards_per_rank=self.p.shards_per_rank,
            drop=self.p.shrink_batch == "drop",
            replica_nodes=self.replica_nodes,
        )

    def advance(self, dt: float) -> float:
        """``Strategy.advance``: everything :meth:`train` says was given up, in one figure."""
        tr = self.train(dt)
        return tr.overhead_s + tr.shrunk_s

    def train(self, dt: float) -> Trained:
        """``dt`` of training: the snapshot stall and the worker's per-step cost (``steady_fraction``),
        and while shrunk the rate given up.

        At full size the job progresses ``dt x (1 - steady_fraction)``; with ``W'`` ranks it
        trains :meth:`ElasticWorld.rate` of that (keep: a step takes ``max(len(shards)) / M``
        times as long; drop: each step trains ``W' / W`` of the samples), and the difference is
        booked as ``shrunk`` to the cause of the newest shrink.
        """
        frac = self.steady_fraction
        if self.elastic.full:
            self.work += dt * (1.0 - frac)
            return Trained(overhead_s=dt * frac)
        useful = dt * (1.0 - frac) * self.elastic.rate(self.elastic.world)
        self.work += useful
        cause = self.elastic.newest_cause
        return Trained(overhead_s=dt * frac, shrunk_s=dt - dt * frac - useful, cause=cause, shrunk=True)

    def next_event(self) -> float | None:
        """When the next machine that replaces a dropped node is prepared to join (a grow)."""
        return self.elastic.next_join()

    def on_event(self, *, now: float) -> tuple[str, Recovery]:
        """Every pool node prepared by ``now`` joins, if ``elastic.ElasticPolicy.grow_to`` grows the
        world: every rank pauses after a boundary step, the joiners fetch it and a new generation
        starts (``grow_pause_steps`` steps + a rendezvous, nothing rolled back). Booked to the cause
        of the shrink the first joiner undoes."""
        ready, cause, joined = self.elastic.grow(now)
        if joined is None:
            return cause, Recovery()  # the policy does not grow: those nodes stay out of the job
        pause = list(self.grow_swap.stages)
        back = now + sum(s for _, s in pause) + self.transfer * max(1, self.p.replicas)
        for pos in ready:
            if self.mem_back_at.get(pos) == math.inf:  # a new machine: its memory holds replicas again
                self.mem_back_at[pos] = back
                self.proc_spare_at[pos] = back
        return cause, Recovery(pause=pause, replacement=joined, resize="grow")

    def _lost(self, tier: Tier) -> float:
        """Progress rolled back on a restore from ``tier``: back to the newest snapshot boundary
        whose copy had landed where ``tier`` reads it (host memory ``capture`` after the boundary, a
        peer's ``replica_lag`` later still), as the runtime restores the newest step every rank has
        whole; a durable restore goes back to the newest persist that had finished writing."""
        if tier is Tier.DURABLE:
            every, lag = self.p.persist_every_s, self.persist_write
        elif self.rescues:  # the survivors' state of the last completed step is rescued
            every, lag = self.job.step_s, 0.0
        else:
            every = self.job.step_s * self.every
            lag = self.capture + (self.replica_lag if tier is Tier.PEER else 0.0)
        committed = max(0.0, math.floor((self.work - lag) / every) * every)
        return self.work - committed

    def on_failure(self, *, now: float, node: int, cause: Cause, recovering: bool) -> Recovery:
        cal = self.cal
        if self.elastic.gone(node):  # dropped by a shrink: no machine plays its unit until one joins
            return Recovery()
        name = f"n{node}"
        hist = self.history.setdefault(node, [])
        hist.append(now)
        quarantined = self.p.quarantine.should_quarantine(hist, now=now)
        action = actions.recovery_action(cause.kind, quarantined=quarantined, planned=cause.planned)
        alive = cause.kind is not FailureKind.NODE_LOST or cause.planned  # notice: still up
        stays = alive and action is RecoveryAction.RESTART_IN_PLACE  # the node keeps playing its ranks
        holders = [h for h in self.holders(node) if self.mem_back_at.get(h, 0.0) <= now]
        spares: dict[int, str] = {}
        if stays and self.p.spares_per_node > 0 and self.proc_spare_at.get(node, 0.0) <= now:
            spares[0] = name
        # Spare nodes are interchangeable (all idle, load 0): the policy takes the first in order,
        # so offering the first few gives its answer at O(1) instead of O(spares) per failure.
        idle = self.spares.idle(now, limit=2)
        spares.update({i + 1: s for i, s in enumerate(idle)})
        live = ([name] if alive else []) + [f"n{h}" for h in holders] + idle + [POOL]
        load = {nm: 1 for nm in live if nm.startswith("n")}
        # an elastic job starts no cold process on another node (as the runtime): the ranks no
        # spare takes are unplaced, and the elastic policy decides (a planned move is unchanged)
        elastic_here = self.elastic.policy.enabled and action is not RecoveryAction.MIGRATE
        placed = policy.choose_replacements(
            failed={0: name},
            spares=spares,
            data_nodes={0: [f"n{h}" for h in holders]},
            live_nodes=live,
            load=load,
            quarantined=[] if stays else [name],
            cold_elsewhere=not elastic_here,
        )
        resize: str | None = None
        waited = 0.0
        if 0 in placed:
            placement = placed[0]
            if placement.source is ReplacementSource.SPARE and action is not RecoveryAction.MIGRATE:
                prepare = self._spare_prepare_s(in_place=placement.node == name)
                if self.survivor_choice(prepare).shrink_first:
                    self._take(node, placement, healthy=action is RecoveryAction.RESTART_IN_PLACE, now=now)
                    shrunk = ElasticDecision(
                        action=ElasticAction.SHRINK, world_size=self.elastic.world - self.elastic.unit
                    )
                    return self._shrink(
                        now,
                        node,
                        cause,
                        action,
                        shrunk,
                        0.0,
                        recovering,
                        join_after_s=prepare,
                        first=True,
                        keeps_machine=placement.node == name,
                    )
        else:
            decision, waited = self.elastic.unplaced(cal.node_provision_s)
            resize = decision.action.value
            if decision.action is ElasticAction.SHRINK:
                return self._shrink(now, node, cause, action, decision, waited, recovering)
            placement = Placement(node=POOL, spare=None)  # it waited for the pool node, or gave up
        # a failure while training (not one during a recovery, nor a planned move) is rescued
        rescued = self.rescues and not recovering and action is not RecoveryAction.MIGRATE
        tier = restore_tier(
            placement.node, node, num_nodes=self.job.num_nodes, alive=alive, holders=holders, rescued=rescued
        )
        if action is RecoveryAction.MIGRATE:
            lost = 0.0
            if self.p.migration_pause_s is None:
                pause = [("plan", cal.plan_s), *self.migration_swap.stages]
            else:
                pause = [("plan", cal.plan_s), ("restore", self.migration)]
        else:
            lost = 0.0 if recovering and tier is not Tier.DURABLE else self._lost(tier)
            if placement.source is ReplacementSource.SPARE:
                launch = cal.launch_spare_s
            elif placement.node == POOL:
                launch = cal.node_provision_s + cal.launch_cold_s
            else:
                launch = cal.launch_cold_s
            pause = [("detect", detect_s(self.cal, cause.kind)), *self._generation(tier, launch)]
        self.work -= lost
        # bookkeeping: spares used, machines leaving, memory that must be re-replicated
        back = sum(s for _, s in pause) + self.transfer * max(1, self.p.replicas)
        if placement.source is ReplacementSource.SPARE or placement.node != name:
            self._take(node, placement, healthy=action is RecoveryAction.RESTART_IN_PLACE, now=now)
        if placement.node != name:
            self.mem_back_at[node] = now + back
            self.history[node] = []  # a different machine plays this position now
            self.proc_spare_at[node] = now + back
        source = "pool" if placement.node == POOL else placement.source.value
        return Recovery(
            pause=pause, lost_work_s=lost, action=action, tier=tier, replacement=source, resize=resize
        )

    # -- proactive moves (sim/proactivesim.py decides) ------------------------------------------
    def _has_target(self, now: float) -> bool:
        """Another node has an idle hot spare: a process spare (each node keeps one) or a spare node."""
        return (self.job.num_nodes > 1 and self.p.spares_per_node > 0) or bool(self.spares.idle(now, limit=1))

    def on_slow(self, *, now: float, node: int, factor: float, duration_s: float) -> SlowResponse:
        """``Proactive.on_slow`` (the runtime knows neither the GPU nor how long it will last)."""
        return self.moves.on_slow(now=now, factor=factor, has_target=self._has_target(now))

    def on_warning(self, *, now: float, node: int, cause: Cause, lead_s: float) -> bool:
        """``Proactive.on_warning`` (a position a shrink dropped has no machine to drain)."""
        absent = self.elastic.gone(node)
        return not absent and self.moves.on_warning(
            cause=cause, lead_s=lead_s, has_target=self._has_target(now)
        )

    def _take(self, node: int, placement: Placement, *, healthy: bool, now: float) -> None:
        """A spare node taken for ``node`` (its machine comes back as a spare after repair unless
        it was healthy); a process spare on the node itself warms up again."""
        if placement.node == f"n{node}":
            self.proc_spare_at[node] = now + self.cal.launch_cold_s
        elif placement.node != POOL:
            self.spares.take(placement.node, now=now, back_after_s=0.0 if healthy else self.cal.repair_s)

    def _spare_prepare_s(self, *, in_place: bool) -> float:
        """A hot spare's time to be ready to train a lost node's ranks: its launch, the fetch of
        the step from a peer (a spare node), the restore, and one warm-up step."""
        fetch = 0.0 if in_place else self.transfer
        return max(self.cal.launch_spare_s, fetch) + self.restore_local + self.job.step_s

    def survivor_choice(self, prepare_s: float) -> SurvivorChoice:
        """The runtime's choice (:meth:`ElasticWorld.survivor_choice`) for a node a hot spare
        could replace, with this job's costs at scale: the spare's launch, fetch and restore
        (``prepare_s`` less its warm-up step), one rebuild of the group, the grow's pause."""
        costs = SurvivorCosts(
            step_s=self.job.step_s,
            restore_s=prepare_s - self.job.step_s,
            rebuild_s=self.rebuild,
            swap_s=self.grow_pause,
        )
        return self.elastic.survivor_choice(self.p.survivors, costs)

    def _shrink(
        self,
        now: float,
        node: int,
        cause: Cause,
        action: RecoveryAction,
        decision: ElasticDecision,
        waited: float,
        recovering: bool,
        *,
        join_after_s: float | None = None,
        first: bool = False,
        keeps_machine: bool = False,
    ) -> Recovery:
        """Go on without node ``node``: the survivors restore their own newest step (the tier the
        policy picks for ranks whose memory is alive) and rebuild a group of
        ``decision.world_size`` ranks; a pool node is asked for and joins once prepared, or
        (``join_after_s``: a hot spare, shrink ``first``) the spare joins that long after the plan;
        ``keeps_machine``: the spare is a process on the node itself (its memory stays usable)."""
        cal = self.cal
        tier = restore_tier(
            f"n{node}",
            node,
            num_nodes=self.job.num_nodes,
            alive=True,
            holders=[],
            rescued=False,
            survivor=True,
        )
        lost = 0.0 if recovering and tier is not Tier.DURABLE else self._lost(tier)
        detect = detect_s(self.cal, cause.kind)
        # the wait for a spare is part of the planning
        pause = [("detect", detect), *self._generation(tier, None, waited_s=waited)]
        self.work -= lost
        if not keeps_machine:
            self.history[node] = []  # its machine leaves the job
            self.mem_back_at[node] = math.inf  # until a machine plays the position again
            self.proc_spare_at[node] = math.inf
        if join_after_s is None:
            join_after_s = cal.node_provision_s + self.grow_prepare
        self.elastic.drop(
            node,
            cause=cause.name,
            world_size=decision.world_size,
            join_at=now + detect + cal.plan_s + join_after_s,
            joiner="spare" if first else POOL,
        )
        return Recovery(
            pause=pause,
            lost_work_s=lost,
            action=action,
            tier=tier,
            replacement="spare" if first else "shrink",
            resize="shrink_first" if first else "shrink",
        )

    def _generation(
        self, tier: Tier, launch_s: float | None, *, waited_s: float = 0.0
    ) -> list[tuple[str, float]]:
        """Plan, then the new generation's setup, timed by the runtime's own machine
        (:mod:`nonstop.sim.recoverysim`): the replacement launches while its node fetches the
        step from a peer (PEER); a durable install comes first, inside the plan (as the runtime
        plans FROM_DURABLE: every node installs, then the generation starts); ``launch_s`` None:
        nothing is replaced (a shrink)."""
        plan = self.cal.plan_s + waited_s + (self.durable_read if tier is Tier.DURABLE else 0.0)
        if self.rescues:  # the plan waits for the survivors' rescue writes (policy/rescue.py)
            plan += self.capture
        timing = recoverysim.time_recovery(
            RecoveryCosts(
                launch_s=launch_s,
                fetch_s=self.transfer if tier is Tier.PEER and launch_s is not None else None,
                restore_s=self.restore_local,
                rebuild_s=self.rebuild,
                step_s=self.job.step_s,
            )
        )
        return [("plan", plan), *((n, s) for n, s in timing.pause if n != "launch" or launch_s is not None)]

    def describe(self) -> dict[str, Any]:
        return describe_nonstop(self)


def describe_nonstop(s: Nonstop) -> dict[str, Any]:
    """Every setting and derived cost of a nonstop strategy, for the report."""
    return {
        "strategy": s.name,
        "snapshot_every": s.every,
        "snapshot_budget": s.p.snapshot_budget,
        "snapshot_max_age_s": s.p.snapshot_max_age_s,
        "stall_s": s.stall,
        "stall_fraction": s.stall / (s.job.step_s * s.every),
        "step_overhead_s": s.cal.nonstop_step_overhead_s,
        "steady_fraction": s.steady_fraction,
        "replicas": s.p.replicas,
        "capture_s": s.capture,
        "replica_lag_s": s.replica_lag,
        "spares_per_node": s.p.spares_per_node,
        "spare_nodes": s.num_spare_nodes,
        "persist_every_s": s.p.persist_every_s,
        "persist_write_s": s.persist_write,
        "restore_local_s": s.restore_local,
        "peer_transfer_s": s.transfer,
        "durable_read_s": s.durable_read,
        "rebuild_s": s.rebuild,
        "replica_nodes": s.replica_nodes,
        "swap_rebuild_s": s.swap_rebuild,
        "keep_on_failure": s.p.keep_on_failure,
        "rescue": s.rescues,
        "migration_pause_s": s.migration,
        "min_world_size": s.p.min_world_size,
        "elastic_wait_s": s.p.elastic_wait_s,
        "shards_per_rank": s.p.shards_per_rank,
        "shrink_batch": s.p.shrink_batch,
        "survivors": s.p.survivors.value,
        "proactive": s.moves.describe(),
        "grow_prepare_s": s.grow_prepare,
        "grow_pause_s": s.grow_pause,
        "quarantine": {
            "max_failures": s.p.quarantine.max_failures,
            "window_s": s.p.quarantine.window_s,
        },
    }
