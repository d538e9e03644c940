"""Generations: every membership change of a job -- its start, a recovery, a boundary swap --
is a new generation, planned, launched and timed here. This module is the executor of three
pure pieces; it feeds them events (with the time) and carries their actions out:

* **wait** (:class:`~nonstop.policy.planning.Pending`): the generation waits for the live
  nodes' inventories when a restore is needed (their answers are events; the survivors' rescue
  reports too, with ``--snapshot-every`` > 1: :mod:`nonstop.coordinator.plan_asks` asks them), or,
  after an elastic ``WAIT`` plan, for a spare; a failure meanwhile merges into it;
* **plan** (:func:`~nonstop.policy.planning.plan_generation`): who plays each missing rank,
  which step every rank restores (memory first, then the durable tier), a shrink or a wait;
* **launch**: spares take ranks, cold processes start, nodes that lack a rank's restore step
  fetch it from a peer (:mod:`nonstop.coordinator.restore_sources`; a swap's boundary fetch may have been
  asked for earlier and is adopted);
* **setup** (:class:`~nonstop.policy.reconfiguration.Reconfiguration`, a machine): launch -> restore
  -> rebuild -> resume -> done, each timed; a stage that overruns ``rebuild_timeout_s`` has its
  laggards killed (and recovered);
* a failure during a generation's setup starts the next one, inheriting the failures.

Threading: the coordinator's thread only. I/O goes through the coordinator's executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.coordinator.plan_asks import PlanAsks
from nonstop.coordinator.torch_env import rank_env
from nonstop.coordinator.view import Role
from nonstop.errors import ControlError
from nonstop.policy.phase import Busy, JobPhase
from nonstop.policy.planning import (
    Inventory,
    Pending,
    Plan,
    PlanAction,
    PlanNow,
    SpareIdle,
    Waited,
    plan_generation,
)
from nonstop.policy.reconfiguration import (
    Action,
    Failure,
    Finished,
    KillLaggards,
    Rebuild,
    Reconfiguration,
    Reconfigure,
    RecoveryEvent,
    Resumed,
    Stage,
    StageEnded,
    Tick,
)
from nonstop.policy.rescue import Report

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["Generations"]


class Generations:
    """The current generation's setup (``reconf``) and what it waits for (see the module docstring)."""

    def __init__(
        self,
        c: Coordinator,
        *,
        initial_step: int | None,
        asks: PlanAsks,
        exits_waiting: Callable[[set[int]], bool],
    ) -> None:
        """``exits_waiting``: whether any of these spawn ids' exits is reported but not handled
        yet (:meth:`Failures.waiting <nonstop.coordinator.failures.Failures.waiting>`)."""
        self.c = c
        self.exits_waiting = exits_waiting
        self.initial_step = initial_step  # resumed from the durable tier: install this first
        self.reconf: Reconfiguration | None = None
        # a generation not planned yet: what it waits for (inventories, a spare, an install)
        self.pending: Pending | None = None
        # what the generation being planned asked the nodes and the survivors (planwait.py)
        self.asks = asks
        self._deferral_logged = 0  # the generation whose plan was last deferred for exits
        # a sharded job resumed from a checkpoint of another size: {url, step, world}, which the
        # first generation's workers reshard (nothing is installed on the nodes), and any later
        # one's when memory is lost before a checkpoint of the job's own size exists
        self.reshard: dict[str, Any] | None = None

    def recover(self, failures: list[Failure]) -> None:
        """Start the generation that recovers ``failures``. A generation not planned yet is
        planned for these failures too; one being set up is re-planned, keeping what the
        interrupted plan did (its replacements, its count of re-plans)."""
        pending = self.pending
        if pending is not None:  # a generation not planned yet: plan it for these failures too
            self.pending = None
            self.begin(
                pending.failures + failures,
                replans=pending.replans + 1,
                replacements=pending.replacements,
                rescue=pending.rescue,  # (the survivors left their steps for the first failure)
            )
            return
        previous = self.reconf if self.c.view.phase is JobPhase.RECONFIGURING else None
        if previous is None:
            self.begin(failures)
        else:  # a failure during a recovery: re-plan, keeping what the interrupted plan did
            self.begin(
                previous.failures + failures, replans=previous.replans + 1, replacements=previous.replacements
            )

    def in_training(self) -> bool:
        """The members train: the job runs, or the generation being set up has resumed."""
        r = self.reconf
        return self.c.view.phase is JobPhase.RUNNING or (r is not None and r.stage is Stage.RESUME)

    def rebuilding(self) -> set[int]:
        """The ranks not yet ready in the rebuild stage of the generation being set up."""
        r = self.reconf
        if r is None or r.stage is not Stage.REBUILD:
            return set()
        return set(range(self.c.view.world_size)) - r.ready

    def busy(self) -> set[Busy]:
        """A generation being set up holds back the background operations."""
        return {Busy.RESUMING} if self.reconf is not None else set()

    def reshard_first(self, source: dict[str, Any]) -> None:
        """The job resumes from a checkpoint of another size (``source``: its ``url``, ``step``
        and ``world``): the first generation's ranks reshard from it, nothing is installed."""
        self.reshard = source

    def replan_tick(self) -> None:
        """Re-plan a generation waiting for a spare (one appeared, or the wait is over)."""
        p = self.pending
        if p is None or p.replan_at is None:
            return
        now = time.monotonic()
        ev = SpareIdle(now) if self.c.view.idle_spares() else Waited(now)
        if p.on_event(ev):  # [Replan]
            self.pending = None
            self.begin(p.failures, replans=p.replans + 1, replacements=p.replacements, rescue=p.rescue)

    def check_timeouts(self) -> None:
        """A stage that overran ``rebuild_timeout_s`` has its laggards killed (the machine says who)."""
        if self.c.view.phase is JobPhase.RECONFIGURING:
            self.report(Tick(time.time()))

    def inventory_tick(self) -> None:
        """Feed the nodes' inventory answers (and lost nodes, and the time) to the pending plan;
        plan once it says so (every node answered, or ``planwait.PLAN_WAIT_S`` passed). Exits not handled
        yet are handled first: a second node lost while the nodes answered is planned together
        with the first (``on_failures`` merges them into the pending plan)."""
        p = self.pending
        if p is None or not p.inventory_wait:
            return
        members = set(self.c.view.members.values())
        if self.exits_waiting(members):
            if self._deferral_logged != self.c.view.generation:
                self._deferral_logged = self.c.view.generation
                self.c.events.emit(ev.ReplanDeferred(generation=self.c.view.generation))
            return
        out = self.asks.events(p, time.monotonic())
        for a in out:
            if isinstance(a, PlanNow):
                self.asks.drop()
                self.initial_step = None
                self._plan(a.inventory, a.rescues)
                return

    def begin(
        self,
        failures: list[Failure],
        *,
        replans: int = 0,
        replacements: dict[int, str] | None = None,
        inventory_needed: bool = False,
        rescue: bool | None = None,
    ) -> None:
        """Open generation + 1 and plan it. Every rank restores the newest step all ranks hold
        (memory first, then durable) when there are ``failures``, a resumed checkpoint to
        install, or ``inventory_needed`` (a restarted coordinator redoing an interrupted
        recovery): the nodes' inventories are asked for first, and the plan waits for them as
        events (:class:`~nonstop.policy.planning.Pending`; the coordinator serves everything
        else meanwhile; a failure meanwhile merges into this plan). The decision is
        :func:`~nonstop.policy.planning.plan_generation`'s. ``rescue``: whether the survivors
        may report rescues (:mod:`nonstop.policy.rescue`); None: if the job was training (a
        failure during a generation's setup finds no survivor in a step)."""
        if rescue is None:
            rescue = self.c.view.phase is JobPhase.RUNNING
        self.open_generation()
        self.pending = p = Pending(
            failures=failures, replans=replans, replacements=dict(replacements or {}), rescue=rescue
        )
        if failures or self.initial_step is not None or inventory_needed:
            out = self.asks.ask(p, time.monotonic())
        else:
            out = [PlanNow(None)]
        for a in out:
            self._plan(a.inventory, a.rescues)

    def _plan(self, inventory: Inventory | None, rescues: Mapping[int, Report]) -> None:
        """Decide (pure ``plan_generation``) for the pending generation and carry it out."""
        p = self.pending
        assert p is not None
        failures, replans, replacements = p.failures, p.replans, p.replacements
        now = time.time()
        if self.reshard is not None and not failures:  # the first generation: every rank is present
            self.pending = None
            plan = Plan(action=PlanAction.REPLACE)
            step = int(self.reshard["step"])
            self._start(
                failures, replans, replacements, plan, {}, step, "durable", {}, now, reshard=self.reshard
            )
            return
        alive_nodes = self.c.view.alive_nodes()
        missing = [r for r in range(self.c.view.world_size) if r not in self.c.view.members]
        choice = self.c.resize.survivor_choice(missing) if failures and missing else None
        plan = plan_generation(
            world_size=self.c.view.world_size,
            present=set(self.c.view.members),
            last_node=dict(self.c.view.rank_node),
            inventory=inventory,
            idle_spares=self.c.view.idle_spares(),
            live_nodes=alive_nodes,
            load=self.c.view.load(alive_nodes),
            elastic=self.c.elastic,
            waited_s=now - min((f.detected_at for f in failures), default=now),
            recovering=bool(failures),
            reshard=self.c.resize.reshards,
            shrink_first=choice is not None and choice.shrink_first,
            avoid={f.rank: f.avoid_node for f in failures if f.avoid_node is not None},
            rescue=self.asks.rescue(rescues),
        )
        if plan.action is PlanAction.FAIL:
            self.pending = None
            self.c.fail(plan.reason)
            return
        if plan.action is PlanAction.WAIT:
            for sid in self.c.view.members.values():  # their fault reports are answered after the wait
                self.c.view.workers[sid].fault_report = None
                self.c.view.workers[sid].told_to_raise_at = None
            p.wait_for_spare(time.monotonic() + plan.wait_s)
            self.c.events.emit(ev.ElasticWait(ranks=list(plan.unplaced), wait_s=plan.wait_s))
            return
        from_rank: dict[int, int] = {}
        old_world = self.c.view.world_size
        if plan.shrink is not None:
            why = choice.reason if plan.shrink_first and choice is not None else plan.reason
            from_rank = self.c.resize.shrink(plan.shrink, why, shrink_first=plan.shrink_first)
        placements, avail, restore_step = plan.placements, plan.inventory, plan.restore_step
        from_rank.update(plan.donors)  # they restore a survivor's rescued step (policy/rescue.py)
        for rank, pl in placements.items():
            self.c.view.rank_node[rank] = pl.node
        if plan.reshard:  # every rank cuts its new shards out of all the old ranks'
            self.pending = None
            source = self.c.resize.reshard_source(restore_step, old_world)
            if source is not None:
                step, tier = int(source["step"]), "durable" if "url" in source else "memory"
                self._start(failures, replans, replacements, plan, {}, step, tier, avail, now, reshard=source)
            return
        if plan.action is PlanAction.FROM_DURABLE:
            # A failure while the nodes install merges into this plan (it stays pending), as one
            # while they answer inventories does.
            p.installing = True

            def installed(step: int | None) -> None:
                self.pending = None
                if step is None and self.reshard is not None:
                    # a sharded job resumed on another mesh has no checkpoint of its own size yet:
                    # every rank reshards the one it resumed from again
                    again = int(self.reshard["step"])
                    self._start(failures, replans, replacements, plan, from_rank, again, "durable", {}, now,
                                reshard=self.reshard)  # fmt: skip
                    return
                if step is None:
                    # Survivors hold later state than any fresh process could: never mix them.
                    self.c.fail(
                        "no step is snapshotted for every rank in memory or in the durable tier "
                        f"({self.c.durable_url or 'none configured'}); "
                        "cannot recover this failure (persist more often with --persist-every)"
                    )
                elif any(
                    pl.spare is not None and not self.c.view.live(pl.spare) for pl in placements.values()
                ):
                    self.begin(
                        failures, replans=replans + 1, replacements=replacements
                    )  # a spare died meanwhile
                else:
                    self._start(failures, replans, replacements, plan, from_rank, step, "durable", {}, now)

            self.c.sources.restore_from_durable(installed)
            return
        self.pending = None
        self._start(failures, replans, replacements, plan, from_rank, restore_step, "memory", avail, now)

    def _start(
        self,
        failures: list[Failure],
        replans: int,
        replacements: dict[int, str],
        plan: Plan,
        from_rank: dict[int, int],
        restore_step: int | None,
        tier: str,
        avail: Inventory,
        now: float,
        *,
        reshard: dict[str, Any] | None = None,
    ) -> None:
        """Carry the plan out: the generation's record, spares and cold processes, fetches, launch.
        ``reshard``: every rank cuts its shards out of that checkpoint of another size."""
        placements, unplaced = plan.placements, plan.unplaced
        r = Reconfiguration(
            generation=self.c.view.generation,
            world_size=self.c.view.world_size,
            failures=failures,
            restore_step=restore_step,
            replans=replans,
            replacements=dict(replacements or {}),
        )
        r.marks["detect"] = max((f.detected_at for f in failures), default=now)
        r.from_rank = from_rank
        if reshard is not None:
            r.reshard = reshard
            r.fresh = set(range(r.world_size))  # each rank writes its new shards into its own slots
        elif unplaced:  # renumbered ranks and new processes write their new number's slots afresh
            r.fresh = set(from_rank) | set(placements)
        if failures and restore_step is not None:
            r.lost_steps = max(0, self.c.committed() - restore_step)
            # completed by some rank past the restored step, to be trained again: the failed
            # rank's step in flight where the others finished it, and with --snapshot-every K up
            # to K - 1 steps more that were never committed
            reached = max(map(self.c.view.reached, self.c.view.latest_step), default=restore_step)
            r.redone_steps = max(0, reached - restore_step)
        if restore_step is not None:
            self.c.view.rewind(restore_step)
        if failures:  # the survivors' gap runs from their last step before the failure
            for rank, sid in self.c.view.members.items():
                w = self.c.view.workers.get(sid)
                if rank not in placements and w is not None and w.live and w.last_step_wall:
                    r.survivors_since[rank] = w.last_step_wall
        for rank, p in sorted(placements.items()):
            r.replacements[rank] = p.source.value
            if p.spare is not None:
                w = self.c.view.workers[p.spare]
                w.rank, w.role = rank, Role.WORKER
                w.last_progress, w.stepped = time.monotonic(), False
                self.c.view.members[rank] = p.spare
            else:
                self.c.io.spawn(p.node, Role.WORKER, rank)
                r.waiting_launch.add(rank)
        r.marks["plan"] = time.time()
        if reshard is not None and "memory" in reshard:
            assert restore_step is not None
            reshard["memory"] = self.c.sources.plan_reshard(r, restore_step, avail, int(reshard["world"]))
            fetches: dict[int, str] = {}
        elif tier == "memory" and restore_step is not None:
            fetches = self.c.sources.plan_fetches(r, restore_step, avail)
        else:
            fetches = {}
        for rank in fetches:  # its step arrives in its new rank's memory: restore that
            r.from_rank.pop(rank, None)
        self.launch(r, tier=tier, fetches=fetches)

    def open_generation(self) -> None:
        """Generation + 1: fence the old one (its fetches, rendezvous, replication round)."""
        self.c.view.generation += 1
        self.c.set_phase(JobPhase.RECONFIGURING)
        self.reconf = None
        self.asks.drop()  # asked for a generation that will not be planned any more
        self.c.sources.cancel_install()
        for req in [
            q for q, (_, gen) in self.c.sources.waiting_fetch.items() if gen < self.c.view.generation
        ]:
            del self.c.sources.waiting_fetch[req]  # a late answer is ignored (its generation is over)
            self.c.io.done(req)
        self.c.replication.reset()
        for reply, msg in self.c.kv.new_generation(self.c.view.generation):
            try:
                reply(msg)
            except ControlError:
                pass
        self.c.view.done_ranks.clear()

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Log the planned generation ``r`` and start it: reconfigure every connected member."""
        self.reconf = r
        self.c.events.emit(
            ev.NewGeneration(
                generation=r.generation,
                restore_step=r.restore_step,
                tier=tier,
                members={str(k): v for k, v in sorted(self.c.view.members.items())},
                nodes={str(k): self.c.view.rank_node.get(k) for k in sorted(self.c.view.members)},
                replacements={str(k): v for k, v in r.replacements.items()},
                cause=[f.rank for f in r.failures],
                fetches={str(k): v for k, v in fetches.items()},
                replans=r.replans,
                **extra,
            )
        )
        for rank, sid in self.c.view.members.items():
            if self.c.view.workers[sid].chan is None:  # still starting (e.g. launched by a re-plan)
                r.waiting_launch.add(rank)
        r.timeout_s = self.c.config.rebuild_timeout_s
        self._execute(r, r.start(time.time()))

    def report(self, ev: RecoveryEvent) -> None:
        """What a rank reported (or a clock tick), for the generation being set up."""
        r = self.reconf
        if r is not None:
            self._execute(r, r.on_event(ev))

    def _execute(self, r: Reconfiguration, actions: list[Action]) -> None:
        """Carry out what the generation's machine (:class:`Reconfiguration`) decided."""
        for a in actions:
            if isinstance(a, Reconfigure):
                self._reconfigure(r, a.rank)
            elif isinstance(a, StageEnded):
                self.c.events.emit(ev.Stage(generation=r.generation, stage=a.stage.value, seconds=a.seconds))
            elif isinstance(a, Rebuild):
                for sid in self.c.view.members.values():
                    self.c.io.send(self.c.view.workers[sid], {"t": "rebuild", "gen": r.generation})
            elif isinstance(a, Resumed):
                self.c.set_phase(JobPhase.RUNNING)
                now_m = time.monotonic()
                for member in self.c.view.members.values():
                    self.c.view.workers[member].last_progress = now_m
            elif isinstance(a, KillLaggards):
                for rank in a.ranks:
                    laggard = self.c.view.members.get(rank)
                    if laggard is not None and laggard in self.c.view.workers:
                        self.c.view.workers[laggard].killed_for_hang = a.why
                        self.c.io.kill(laggard)
            elif isinstance(a, Finished):
                self._finished(r, a)

    def _reconfigure(self, r: Reconfiguration, rank: int) -> None:
        sid = self.c.view.members.get(rank)
        w = self.c.view.workers.get(sid) if sid is not None else None
        if w is None or w.chan is None:
            return
        w.stepped, w.coll, w.idle_s, w.fault_report = False, False, None, None
        w.told_to_raise_at, w.rescue, w.told_gen = None, None, r.generation
        self.c.io.send(
            w,
            {
                "t": "reconfigure",
                "gen": r.generation,
                "rank": rank,
                "world_size": self.c.view.world_size,
                "env": rank_env(self.c.view, w.spawn_id, rank),  # torchrun's (coordinator/torch_env.py)
                "restore_step": r.restore_step,
                "recovery": bool(r.failures),
                # the failed ranks, numbered as in the generation the survivors are leaving: a
                # survivor keeps the mesh groups none of them was in (nonstop/train/settle.py)
                **({"lost": sorted({f.rank for f in r.failures})} if r.failures else {}),
                **self.c.resize.shards_of(rank),
                **({"from_rank": r.from_rank[rank]} if rank in r.from_rank else {}),
                **({"fresh": True} if rank in r.fresh else {}),
                **({"live": True} if r.live else {}),
                **({"reshard": self.c.resize.reshard_for(r.reshard, rank)} if r.reshard is not None else {}),
            },
        )

    def _finished(self, r: Reconfiguration, a: Finished) -> None:
        """The generation is set up: reports, what waited on it, spares, the job's end."""
        self.reconf = None
        self.c.swaps.on_generation_done(r.generation)
        median = self.c.detector.median_step_s
        for rec in a.reports:
            gap = rec.get("survivor_gap_s")
            rec["survivor_gap_steps"] = gap / median if gap is not None and median else None
        self.c.view.reports.extend(a.reports)
        for rec in a.reports:
            self.c.events.emit(ev.from_fields("recovery", rec))  # the report record, keyed as logged
        self.c.agents.replenish_spares()
        if self.c.view.all_done() and self.c.view.phase is JobPhase.RUNNING:
            self.c.finish()

    def boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration:
        """The generation just opened, starting at boundary ``step`` that every rank paused after
        (a migration's swap, a grow): nothing rolls back, paused ranks keep their live state."""
        r = Reconfiguration(
            generation=self.c.view.generation,
            world_size=self.c.view.world_size,
            failures=[],
            restore_step=step,
            replans=0,
            replacements=replacements,
            fresh=fresh or set(),
            live=True,
        )
        r.marks["detect"] = r.marks["plan"] = time.time()
        self.c.view.rewind(step)
        return r
