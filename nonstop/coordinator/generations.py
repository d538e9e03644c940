"""Generations: every membership change of a job -- its start, a recovery, a boundary swap --
is a new generation, planned here and set up by :mod:`nonstop.coordinator.generation_setup`.
This module is the executor of two pure pieces; it feeds them events (with the time) and
carries their actions out:

* **wait** (:class:`~nonstop.policy.planning.Pending`): the generation waits for the live
  nodes' inventories when a restore is needed (their answers are events; the survivors' rescue
  reports too, with ``--snapshot-every`` > 1: :mod:`nonstop.coordinator.plan_asks` asks them), or,
  after an elastic ``WAIT`` plan, for a spare; a failure meanwhile merges into it;
* **plan** (:func:`~nonstop.policy.planning.plan_generation`): who plays each missing rank,
  which step every rank restores (memory first, then the durable tier), a shrink or a wait;
* **the generation's record**: spares take ranks, cold processes start, nodes that lack a rank's
  restore step fetch it from a peer (:mod:`nonstop.coordinator.restore_sources`; a swap's boundary
  fetch may have been asked for earlier and is adopted); then its setup
  (:class:`~nonstop.policy.reconfiguration.Reconfiguration`: launch -> restore -> rebuild ->
  resume -> done) is handed to :class:`~nonstop.coordinator.generation_setup.GenerationSetup`;
* a failure during a generation's setup starts the next one, inheriting the failures.

Two objects, each with its own state: this module plans (:class:`Generations`: the wait, the
plan, and the generation's record built from it -- spares, cold processes, fetches) and
:class:`~nonstop.coordinator.generation_setup.GenerationSetup` carries a planned generation out
(launch, stages, timing, its end).

Collaborators: the view, the executor (spawns), the event log, the job's life (phase, committed
step, failing), the questions before a plan (:class:`~nonstop.coordinator.plan_asks.PlanAsks`), the
job's elastic policy and durable tier, and three peers (:mod:`nonstop.coordinator.peers`): the
setup (``Launcher``), the restore sources (``RestorePlans``: fetches, the durable tier, their
fencing) and the job's size (``ResizePlans``: shrink first or not, a shrink, a reshard's source).
What else a new generation fences (the replication round, the rendezvous) is given as ``fences``.

Threading: the coordinator's thread only. I/O goes through the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import Role
from nonstop.policy.phase import JobPhase
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
from nonstop.policy.reconfiguration import Failure, Reconfiguration, RecoveryEvent
from nonstop.policy.rescue import Report

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import Launcher, ResizePlans, RestorePlans
    from nonstop.coordinator.plan_asks import PlanAsks
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.policy.elastic import ElasticPolicy

__all__ = ["Generations"]


class Generations:
    """The generation being planned (``pending``) and the plan carried out into a generation's
    record, handed to its setup (see the module docstring). The rules of a new failure meeting a
    generation not set up yet live here (:meth:`recover`)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        asks: PlanAsks,
        setup: Launcher,
        sources: RestorePlans,
        sizes: ResizePlans,
        elastic: ElasticPolicy,
        durable_url: str | None,
        initial_step: int | None,
        exits_waiting: Callable[[set[int]], bool],
        fences: Sequence[Callable[[int], None]] = (),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``exits_waiting``: whether any of these spawn ids' exits is reported but not handled
        yet (:meth:`Failures.waiting <nonstop.coordinator.failures.Failures.waiting>`);
        ``initial_step``: a resumed durable checkpoint to install first; ``fences``: called with
        each new generation, in order, after this operation's own fencing (the replication round,
        the rendezvous's parked calls); ``durable_url``: named in the error when no tier holds a
        step."""
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.setup = setup
        self.sources = sources
        self.sizes = sizes
        self.elastic = elastic
        self.durable_url = durable_url
        self.fences = tuple(fences)
        self.exits_waiting = exits_waiting
        self.initial_step = initial_step  # resumed from the durable tier: install this first
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
        previous = self.reconf if self.view.phase is JobPhase.RECONFIGURING else None
        if previous is None:
            self.begin(failures)
        else:  # a failure during a recovery: re-plan, keeping what the interrupted plan did
            self.begin(
                previous.failures + failures, replans=previous.replans + 1, replacements=previous.replacements
            )

    # -- the setup, as the failures, the workers' protocol and the swaps reach it through here --
    @property
    def reconf(self) -> Reconfiguration | None:
        """The generation being set up (:attr:`GenerationSetup.reconf`)."""
        return self.setup.reconf

    def report(self, event: RecoveryEvent) -> None:
        """What a rank reported, for the generation being set up (:meth:`GenerationSetup.report`)."""
        self.setup.report(event)

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Start the planned generation ``r`` (:meth:`GenerationSetup.launch`)."""
        self.setup.launch(r, tier=tier, fetches=fetches, **extra)

    def in_training(self) -> bool:
        """The members train: the job runs, or the generation being set up has resumed."""
        return self.setup.in_training()

    def rebuilding(self) -> set[int]:
        """The ranks not yet ready in the rebuild stage of the generation being set up."""
        return self.setup.rebuilding()

    # -- planning ---------------------------------------------------------------------------------
    def reshard_first(self, source: dict[str, Any]) -> None:
        """The job resumes from a checkpoint of another size (``source``: its ``url``, ``step``
        and ``world``): the first generation's ranks reshard from it, nothing is installed."""
        self.reshard = source

    def replan_tick(self) -> None:
        """Re-plan a generation waiting for a spare (one appeared, or the wait is over)."""
        p = self.pending
        if p is None or p.replan_at is None:
            return
        now = self.clock.monotonic()
        ev = SpareIdle(now) if self.view.idle_spares() else Waited(now)
        if p.on_event(ev):  # [Replan]
            self.pending = None
            self.begin(p.failures, replans=p.replans + 1, replacements=p.replacements, rescue=p.rescue)

    def inventory_tick(self) -> None:
        """Feed the nodes' inventory answers (and lost nodes, and the time) to the pending plan;
        plan once it says so (every node answered, or ``planwait.PLAN_WAIT_S`` passed). Exits not handled
        yet are handled first: a second node lost while the nodes answered is planned together
        with the first (``on_failures`` merges them into the pending plan)."""
        p = self.pending
        if p is None or not p.inventory_wait:
            return
        members = set(self.view.members.values())
        if self.exits_waiting(members):
            if self._deferral_logged != self.view.generation:
                self._deferral_logged = self.view.generation
                self.events.emit(ev.ReplanDeferred(generation=self.view.generation))
            return
        out = self.asks.events(p, self.clock.monotonic())
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
            rescue = self.view.phase is JobPhase.RUNNING
        self.open_generation()
        self.pending = p = Pending(
            failures=failures, replans=replans, replacements=dict(replacements or {}), rescue=rescue
        )
        if failures or self.initial_step is not None or inventory_needed:
            out = self.asks.ask(p, self.clock.monotonic())
        else:
            out = [PlanNow(None)]
        for a in out:
            self._plan(a.inventory, a.rescues)

    def _plan(self, inventory: Inventory | None, rescues: Mapping[int, Report]) -> None:
        """Decide (pure ``plan_generation``) for the pending generation and carry it out."""
        p = self.pending
        assert p is not None
        failures, replans, replacements = p.failures, p.replans, p.replacements
        now = self.clock.wall()
        if self.reshard is not None and not failures:  # the first generation: every rank is present
            self.pending = None
            plan = Plan(action=PlanAction.REPLACE)
            step = int(self.reshard["step"])
            self._start(
                failures, replans, replacements, plan, {}, step, "durable", {}, now, reshard=self.reshard
            )
            return
        alive_nodes = self.view.alive_nodes()
        missing = [r for r in range(self.view.world_size) if r not in self.view.members]
        choice = self.sizes.survivor_choice(missing) if failures and missing else None
        plan = plan_generation(
            world_size=self.view.world_size,
            present=set(self.view.members),
            last_node=dict(self.view.rank_node),
            inventory=inventory,
            idle_spares=self.view.idle_spares(),
            live_nodes=alive_nodes,
            load=self.view.load(alive_nodes),
            elastic=self.elastic,
            waited_s=now - min((f.detected_at for f in failures), default=now),
            recovering=bool(failures),
            reshard=self.sizes.reshards,
            shrink_first=choice is not None and choice.shrink_first,
            avoid={f.rank: f.avoid_node for f in failures if f.avoid_node is not None},
            rescue=self.asks.rescue(rescues),
        )
        if plan.action is PlanAction.FAIL:
            self.pending = None
            self.life.fail(plan.reason)
            return
        if plan.action is PlanAction.WAIT:
            for sid in self.view.members.values():  # their fault reports are answered after the wait
                self.view.workers[sid].fault_report = None
                self.view.workers[sid].told_to_raise_at = None
            p.wait_for_spare(self.clock.monotonic() + plan.wait_s)
            self.events.emit(ev.ElasticWait(ranks=list(plan.unplaced), wait_s=plan.wait_s))
            return
        from_rank: dict[int, int] = {}
        old_world = self.view.world_size
        if plan.shrink is not None:
            why = choice.reason if plan.shrink_first and choice is not None else plan.reason
            from_rank = self.sizes.shrink(plan.shrink, why, shrink_first=plan.shrink_first)
        placements, avail, restore_step = plan.placements, plan.inventory, plan.restore_step
        from_rank.update(plan.donors)  # they restore a survivor's rescued step (policy/rescue.py)
        for rank, pl in placements.items():
            self.view.rank_node[rank] = pl.node
        if plan.reshard:  # every rank cuts its new shards out of all the old ranks'
            self.pending = None
            source = self.sizes.reshard_source(restore_step, old_world)
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
                    self.life.fail(
                        "no step is snapshotted for every rank in memory or in the durable tier "
                        f"({self.durable_url or 'none configured'}); "
                        "cannot recover this failure (persist more often with --persist-every)"
                    )
                elif any(pl.spare is not None and not self.view.live(pl.spare) for pl in placements.values()):
                    self.begin(
                        failures, replans=replans + 1, replacements=replacements
                    )  # a spare died meanwhile
                else:
                    self._start(failures, replans, replacements, plan, from_rank, step, "durable", {}, now)

            self.sources.restore_from_durable(installed)
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
            generation=self.view.generation,
            world_size=self.view.world_size,
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
            r.lost_steps = max(0, self.life.committed() - restore_step)
            # completed by some rank past the restored step, to be trained again: the failed
            # rank's step in flight where the others finished it, and with --snapshot-every K up
            # to K - 1 steps more that were never committed
            reached = max(map(self.view.reached, self.view.latest_step), default=restore_step)
            r.redone_steps = max(0, reached - restore_step)
        if restore_step is not None:
            self.view.rewind(restore_step)
        if failures:  # the survivors' gap runs from their last step before the failure
            for rank, sid in self.view.members.items():
                w = self.view.workers.get(sid)
                if rank not in placements and w is not None and w.live and w.last_step_wall:
                    r.survivors_since[rank] = w.last_step_wall
        for rank, p in sorted(placements.items()):
            r.replacements[rank] = p.source.value
            if p.spare is not None:
                w = self.view.workers[p.spare]
                w.rank, w.role = rank, Role.WORKER
                w.last_progress, w.stepped = self.clock.monotonic(), False
                self.view.members[rank] = p.spare
            else:
                self.io.spawn(p.node, Role.WORKER, rank)
                r.waiting_launch.add(rank)
        r.marks["plan"] = self.clock.wall()
        if reshard is not None and "memory" in reshard:
            assert restore_step is not None
            reshard["memory"] = self.sources.plan_reshard(r, restore_step, avail, int(reshard["world"]))
            fetches: dict[int, str] = {}
        elif tier == "memory" and restore_step is not None:
            fetches = self.sources.plan_fetches(r, restore_step, avail)
        else:
            fetches = {}
        for rank in fetches:  # its step arrives in its new rank's memory: restore that
            r.from_rank.pop(rank, None)
        self.setup.launch(r, tier=tier, fetches=fetches)

    def open_generation(self) -> None:
        """Generation + 1: fence the old one -- the setup abandoned, the plan's questions, the
        restore sources' fetches and install, then ``fences`` (its replication round,
        rendezvous) -- and forget which ranks reported their last step."""
        self.view.generation += 1
        self.life.set_phase(JobPhase.RECONFIGURING)
        self.setup.abandon()
        self.asks.drop()  # asked for a generation that will not be planned any more
        self.sources.new_generation(self.view.generation)
        for fence in self.fences:
            fence(self.view.generation)
        self.view.done_ranks.clear()

    def boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration:
        """The generation just opened, starting at boundary ``step`` that every rank paused after
        (a migration's swap, a grow): nothing rolls back, paused ranks keep their live state."""
        r = Reconfiguration(
            generation=self.view.generation,
            world_size=self.view.world_size,
            failures=[],
            restore_step=step,
            replans=0,
            replacements=replacements,
            fresh=fresh or set(),
            live=True,
        )
        r.marks["detect"] = r.marks["plan"] = self.clock.wall()
        self.view.rewind(step)
        return r
