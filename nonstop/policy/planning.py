"""Recovery planning as one pure function: what the next generation does about missing ranks.

:func:`plan_generation` takes what the coordinator knows -- which ranks still have a process,
where the missing ones ran, what every live node's memory holds (the inventory), the idle hot
spares, the live nodes and their load, the elastic policy and how long the job has waited -- and
returns a :class:`Plan`:

* ``REPLACE``: every missing rank gets a process (a spare, else a cold one); every rank restores
  ``restore_step`` from memory (None: a fresh start, nothing to restore);
* ``SHRINK``: no process can be had for some ranks and the elastic policy says go on without
  them, or the survivors go on first by choice (``shrink_first``, :mod:`.survivors`: spares
  join later by a grow): the ranks that stay are renumbered (``new_of``) and ``restore_step``
  is the newest step every one of them holds; a sharded job drops the whole replica groups of those ranks
  (``ElasticPolicy.unit``), live ranks of them included, which the coordinator retires;
* ``FROM_DURABLE``: memory holds no step common to every rank: restore from the durable tier
  (the coordinator tries its checkpoints newest first; ``shrink`` is set too when it shrank);
* ``WAIT``: the elastic policy waits ``wait_s`` for a spare before deciding again;
* ``FAIL``: nothing can play the job any more (``reason``).

It is built from the existing pure policies (``committed_step``, ``choose_replacements``,
``ElasticPolicy``, ``renumber``); the coordinator carries a plan out, and the simulator can ask
the same function.

Before a plan, a generation may wait: for the live nodes' inventories (a restore is needed), or
(a ``WAIT`` plan) for a spare. :class:`Pending` is that wait as a pure machine: an inventory
answer, a lost node, a spare coming idle or a clock tick in (time from the event), and out
:class:`PlanNow` (with what the nodes answered) or :class:`Replan` (the elastic wait is over).
It holds the failures the plan is for, so a failure meanwhile merges into it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import TypeAlias

from nonstop.policy.decisions import Placement, choose_replacements, committed_step
from nonstop.policy.elastic import ElasticAction, ElasticPolicy, renumber
from nonstop.policy.reconfiguration import Failure
from nonstop.policy.rescue import Inventory, Report, Rescue, with_rescue

__all__ = [
    "Answered",
    "Inventory",
    "NodeGone",
    "Pending",
    "Plan",
    "PlanAction",
    "PlanNow",
    "Replan",
    "Reported",
    "Shrink",
    "SpareIdle",
    "Waited",
    "dropped_with",
    "may_shrink",
    "plan_generation",
]


class PlanAction(enum.StrEnum):
    REPLACE = "replace"
    SHRINK = "shrink"
    FROM_DURABLE = "from_durable"
    WAIT = "wait"
    FAIL = "fail"


@dataclass(frozen=True, kw_only=True)
class Shrink:
    """Ranks dropped, and old rank -> new rank of every rank that stays (in its old order)."""

    dropped: tuple[int, ...]
    new_of: Mapping[int, int]

    @property
    def world_size(self) -> int:
        return len(self.new_of)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The decision for the next generation; ranks are numbered as in that generation."""

    action: PlanAction
    placements: Mapping[int, Placement] = field(default_factory=dict)
    restore_step: int | None = None
    inventory: Inventory = field(default_factory=dict)  # renumbered when shrunk
    shrink: Shrink | None = None
    # a shrunk sharded job without replicas: every rank that stays cuts its new shards out of
    # every old rank's ``restore_step`` (``inventory`` then keeps the old numbering)
    reshard: bool = False
    # the survivors go on without the missing ranks although spares could take them (they join
    # by a grow): policy/survivors.py
    shrink_first: bool = False
    # missing rank -> the survivor whose rescued ``restore_step`` it restores (policy/rescue.py)
    donors: Mapping[int, int] = field(default_factory=dict)
    wait_s: float = 0.0
    unplaced: tuple[int, ...] = ()
    reason: str = ""


def plan_generation(
    *,
    world_size: int,
    present: Set[int],
    last_node: Mapping[int, str | None],
    inventory: Inventory | None,
    idle_spares: Mapping[int, str],
    live_nodes: Sequence[str],
    load: Mapping[str, int],
    elastic: ElasticPolicy,
    waited_s: float,
    recovering: bool,
    reshard: bool = False,
    shrink_first: bool = False,
    avoid: Mapping[int, str] | None = None,
    rescue: Rescue | None = None,
) -> Plan:
    """Plan generation + 1 (pure, deterministic).

    ``present``: ranks whose process lives on; ``last_node``: where each missing rank ran;
    ``inventory``: None when no restore is needed (a fresh start); ``recovering``: failures
    caused this generation (then a step every rank holds is required: memory, else durable);
    ``reshard``: a shrink reshards (a sharded job without replicas), so the restore step must be
    one every old rank holds somewhere, the dropped ones' replicas included; ``shrink_first``:
    shrink without the missing ranks even where spares could take them, at once (no elastic
    wait), unless that would go below the minimum world size (then they are replaced);
    ``avoid``: missing rank -> the node its failure's grade says to leave (``replace_elsewhere``),
    placed elsewhere where a spare or room allows (:func:`~nonstop.policy.decisions.choose_replacements`);
    ``rescue``: the step the present ranks rescued (:mod:`.rescue`), held beside ``inventory``.
    """
    if not live_nodes:
        return Plan(
            action=PlanAction.FAIL, reason="every node is lost or quarantined; nothing left to run on"
        )
    avail: Inventory = inventory or {}
    missing = [r for r in range(world_size) if r not in present]
    donors: dict[int, int] = {}
    if rescue is not None and inventory is not None:
        avail, donors = with_rescue(inventory, rescue, missing, donors=True)
    restore_step = None if inventory is None else committed_step(_steps(avail), world_size)
    placements = choose_replacements(
        failed={r: last_node.get(r) for r in missing},
        spares=idle_spares,
        data_nodes={
            r: [n for n, _ in avail.get(r, {}).get(restore_step, [])] if restore_step is not None else []
            for r in missing
        },
        live_nodes=live_nodes,
        load=load,
        cold_elsewhere=not elastic.enabled,
        avoid={r: n for r, n in (avoid or {}).items() if r in missing},
    )
    first = shrink_first and bool(missing) and may_shrink(elastic, world_size, missing)
    if first:
        placements, waited_s = {}, math.inf
    unplaced = tuple(r for r in missing if r not in placements)
    shrink: Shrink | None = None
    resharded = False
    why = ""
    if unplaced:
        # a sharded job drops whole replica groups (elastic.unit ranks): their other ranks go too
        dropped = dropped_with(elastic, world_size, unplaced)
        decision = elastic.on_unplaced(world_size=world_size, unplaced=len(dropped), waited_s=waited_s)
        if decision.action is ElasticAction.WAIT:
            return Plan(
                action=PlanAction.WAIT, wait_s=decision.wait_s, unplaced=unplaced, reason=decision.reason
            )
        if decision.action is ElasticAction.FAIL:
            return Plan(action=PlanAction.FAIL, unplaced=unplaced, reason=decision.reason)
        why = "the survivors go on first; spares join by a grow" if first else decision.reason
        new_of = renumber([r for r in range(world_size) if r not in dropped])
        shrink = Shrink(dropped=dropped, new_of=new_of)
        placements = {new_of[r]: p for r, p in placements.items() if r in new_of}
        resharded = reshard  # every old rank's shards are cut anew: the old numbering's step, held anywhere
        if rescue is not None and inventory is not None:  # renumbered: no rank takes a donor's state
            avail, donors = with_rescue(inventory, rescue, missing, donors=False)
        if not resharded:
            avail = {new_of[r]: st for r, st in avail.items() if r in new_of}
            if avail:
                # the newest step every rank that stays holds: a data-parallel rank's snapshot has
                # every shard's gradient up to its step, so the dropped ranks are not needed
                restore_step = committed_step(_steps(avail), shrink.world_size)
    if (recovering or resharded) and restore_step is None:
        return Plan(
            action=PlanAction.FROM_DURABLE,
            placements=placements,
            shrink=shrink,
            reshard=resharded,
            unplaced=unplaced,
            reason=("no step is snapshotted for every rank in memory"),
        )
    return Plan(
        action=PlanAction.SHRINK if shrink is not None else PlanAction.REPLACE,
        placements=placements,
        restore_step=restore_step,
        inventory=avail,
        shrink=shrink,
        reshard=resharded,
        shrink_first=first,
        donors=donors if rescue is not None and restore_step == rescue.step else {},
        unplaced=unplaced,
        reason=why,
    )


def dropped_with(elastic: ElasticPolicy, world_size: int, ranks: Sequence[int]) -> tuple[int, ...]:
    """The ranks a shrink without ``ranks`` drops: their whole units (replica groups)."""
    units = {u // elastic.unit for u in ranks}
    return tuple(r for r in range(world_size) if r // elastic.unit in units)


def may_shrink(elastic: ElasticPolicy, world_size: int, missing: Sequence[int]) -> bool:
    """Whether the policy lets the job go on without ``missing`` (their units) at once."""
    decision = elastic.on_unplaced(
        world_size=world_size, unplaced=len(dropped_with(elastic, world_size, missing)), waited_s=math.inf
    )
    return decision.action is ElasticAction.SHRINK


def _steps(avail: Inventory) -> dict[int, list[int]]:
    return {r: list(steps) for r, steps in avail.items()}


# -- the wait before a plan (pure) ------------------------------------------------------------------
@dataclass(frozen=True)
class Answered:
    """Node ``node`` said what its memory holds: rank -> steps, of its own ranks (``local``)
    and of the replicas it keeps for peers (``replicas``)."""

    node: str
    local: Mapping[int, Sequence[int]]
    replicas: Mapping[int, Sequence[int]]
    t: float


@dataclass(frozen=True)
class NodeGone:
    """Node ``node`` was lost: its answer will not come (one it gave is void)."""

    node: str
    t: float


@dataclass(frozen=True)
class Reported:
    """Present rank ``rank`` reported its fault: the step it rescued (None: none), its digest
    (:mod:`.rescue`); or it is no longer present (``step`` None)."""

    rank: int
    step: int | None
    digest: str | None
    t: float


@dataclass(frozen=True)
class SpareIdle:
    """A hot spare is idle (a WAIT for one is over)."""

    t: float


@dataclass(frozen=True)
class Waited:
    """Time passed."""

    t: float


PendingEvent: TypeAlias = Answered | NodeGone | Reported | SpareIdle | Waited


@dataclass(frozen=True)
class PlanNow:
    """Plan with ``inventory`` (None: the nodes were not asked; no restore is needed) and the
    present ranks' rescue reports (rank -> (step or None, digest); :mod:`.rescue`)."""

    inventory: Inventory | None
    rescues: Mapping[int, Report] = field(default_factory=dict)


@dataclass(frozen=True)
class Replan:
    """The elastic wait is over: plan generation + 1 for the same failures (``replans`` + 1)."""


@dataclass(kw_only=True)
class Pending:
    """A generation not planned yet, and what it waits for (see the module docstring).

    ``asked``: the nodes whose inventories are awaited until ``deadline`` (then the plan goes
    with the answers in); ``replan_at``: an elastic WAIT, until then or until a spare is idle.
    ``installing``: a durable install runs for it (the install's own machine answers).
    ``rescuing``: the present ranks whose fault reports (their rescues) are awaited too, until
    ``rescue_deadline`` (the job's ``--rescue-wait`` after the ask; :mod:`.rescue`)."""

    failures: list[Failure]
    replans: int = 0
    replacements: dict[int, str] = field(default_factory=dict)
    asked: set[str] = field(default_factory=set)
    answers: dict[str, Answered] = field(default_factory=dict)
    deadline: float = 0.0
    replan_at: float | None = None
    installing: bool = False
    rescue: bool = True  # the survivors may report rescues: they were training when it failed
    rescuing: set[int] = field(default_factory=set)
    rescues: dict[int, Report] = field(default_factory=dict)
    rescue_deadline: float = 0.0

    @property
    def inventory_wait(self) -> bool:
        return bool(self.asked) or bool(self.answers)

    def ask(
        self,
        nodes: Set[str],
        *,
        deadline: float,
        rescuing: Set[int] = frozenset(),
        rescue_deadline: float = 0.0,
    ) -> list[PlanNow]:
        """Wait for ``nodes``' inventories until ``deadline`` (no node: plan at once, with none),
        and for the fault reports of ``rescuing`` until ``rescue_deadline``."""
        self.asked, self.answers, self.deadline = set(nodes), {}, deadline
        self.rescuing, self.rescues, self.rescue_deadline = set(rescuing), {}, rescue_deadline
        return [] if self.asked else [PlanNow(None)]

    def wait_for_spare(self, until: float) -> None:
        self.asked, self.answers, self.replan_at = set(), {}, until

    def on_event(self, ev: PendingEvent) -> list[PlanNow | Replan]:
        if isinstance(ev, Answered) and ev.node in self.asked:
            self.asked.discard(ev.node)
            self.answers[ev.node] = ev
        elif isinstance(ev, NodeGone):
            self.asked.discard(ev.node)
            self.answers.pop(ev.node, None)
        elif isinstance(ev, Reported) and ev.rank in self.rescuing:
            self.rescuing.discard(ev.rank)
            self.rescues[ev.rank] = (ev.step, ev.digest)
        elif isinstance(ev, SpareIdle | Waited) and self.replan_at is not None:
            if isinstance(ev, SpareIdle) or ev.t >= self.replan_at:
                self.replan_at = None
                return [Replan()]
            return []
        if not self.inventory_wait:
            return []
        if self.asked and ev.t < self.deadline:
            return []
        if self.rescuing and ev.t < self.rescue_deadline:
            return []
        rescues, self.rescuing, self.rescues = self.rescues, set(), {}
        return [PlanNow(self._inventory(), rescues)]

    def _inventory(self) -> Inventory:
        """rank -> step -> [(node, "local" | "replica")] from the answers in (node order)."""
        avail: dict[int, dict[int, list[tuple[str, str]]]] = {}
        for node in sorted(self.answers):
            a = self.answers[node]
            for kind, held in (("local", a.local), ("replica", a.replicas)):
                for rank, steps in held.items():
                    for step in steps:
                        avail.setdefault(rank, {}).setdefault(step, []).append((node, kind))
        self.asked, self.answers = set(), {}
        return avail
