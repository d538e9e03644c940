"""The timeline's data model: value types only, times in seconds since the job started.

What a job's event log says happened, as :func:`nonstop.timeline.loading.build_timeline` reads it:
rank intervals, failures, recoveries with their stages, generations, node spans and marks, the
storage tiers' marks, live migrations with their catch-up rounds, elastic resizes (shrink, grow)
and waits for a spare, events with no row of their own, and the :class:`Timeline` that holds them.
No I/O, no matplotlib.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAGE_ORDER",
    "CatchupMark",
    "ElasticResize",
    "ElasticWait",
    "FailureMark",
    "Generation",
    "Mark",
    "MigrationSpan",
    "NodeSpan",
    "OtherEvent",
    "RankInterval",
    "Recovery",
    "StageSpan",
    "Timeline",
    "prepare_then_swap",
]

# The stages of a recovery in the order they happen (policy/reconfiguration.py); a recovery record's
# stages that are not listed here (a future stage) follow in the record's own order.
STAGE_ORDER = ("detect", "replan", "plan", "launch", "restore", "rebuild", "resume")


@dataclass(frozen=True)
class RankInterval:
    """A period in which one process plays one rank.

    ``phase`` is ``"train"`` (the rank trains in ``generation``: from the moment the
    generation trains again, the end of its ``rebuild`` stage, until a failure or the end)
    or ``"start"`` (a process spawned for this rank is starting: spawn until it first
    trains). ``end_reason``: the failure kind when this rank's process failed,
    ``"recovery"`` when another rank's failure stopped training, ``"finish"``, ``"failed"``
    (the job failed), ``"end"`` (``job_end``), ``"log_end"`` (the log stops here),
    ``"trains"`` (a ``start`` interval that ended in training).
    """

    rank: int
    spawn_id: int | None
    node: str | None
    generation: int
    start: float
    end: float
    phase: str = "train"
    end_reason: str = "log_end"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FailureMark:
    """A failed rank. ``t`` is when the fault happened (injected or, when unknown, detected),
    ``detected`` when the coordinator declared it; ``step`` is the rank's last step."""

    t: float
    detected: float
    kind: str
    rank: int | None
    step: int | None
    spawn_id: int | None = None
    node: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class StageSpan:
    """One stage of a recovery (or of the job's start), from ``start`` to ``end`` seconds."""

    stage: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Recovery:
    """The recovery of one failure: one ``recovery`` event (``complete``), or one reconstructed
    from the failure and the ``stage`` events after it when the log ends before the recovery
    does (``complete`` False, ``end`` the log's end or the job's failure, ``mttr_s`` None).

    ``stages`` are laid end to end from ``start`` (the fault) in :data:`STAGE_ORDER`; for a
    complete recovery their seconds add up to ``mttr_s``. Several failures that one
    reconfiguration repaired share a ``generation`` (and, but for ``detect``, their stages).
    """

    generation: int | None
    kind: str
    rank: int | None
    step: int | None
    start: float
    end: float
    stages: tuple[StageSpan, ...]
    complete: bool = True
    mttr_s: float | None = None
    training_again_s: float | None = None
    lost_steps: int | None = None
    restore_step: int | None = None
    replacement: str | None = None
    tier: str | None = None
    detail: str = ""

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage (a stage listed twice is summed)."""
        out: dict[str, float] = {}
        for s in self.stages:
            out[s.stage] = out.get(s.stage, 0.0) + s.seconds
        return out


@dataclass(frozen=True)
class Generation:
    """A membership (``generation`` event): when it was decided (``t``), why (``cause``: the
    failed ranks), where it restored from, who plays each rank, its ``stage`` events, and when it
    started training (end of ``rebuild``; None if it never did)."""

    number: int
    t: float
    cause: tuple[int, ...] = ()
    tier: str | None = None
    restore_step: int | None = None
    members: Mapping[int, int] = field(default_factory=dict)
    nodes: Mapping[int, str] = field(default_factory=dict)
    stages: tuple[StageSpan, ...] = ()
    training_start: float | None = None


@dataclass(frozen=True)
class NodeSpan:
    """A node's agent ``up`` (joined, connected) or ``disconnected`` (its channel dropped and
    it has not reconnected or been declared lost yet) from ``start`` to ``end``."""

    node: str
    start: float
    end: float
    state: str = "up"
    end_reason: str = "log_end"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Mark:
    """A point event on the node, coordinator or tier rows.

    ``kind``: nodes ``join``, ``rejoin``, ``lost``, ``disconnected``, ``reconnected``;
    coordinator ``leads``, ``resumed``; tiers ``replicated``, ``replication_failed``,
    ``persist``, ``persist_failed``, ``restore_durable``, ``durable_failed``.
    """

    t: float
    kind: str
    node: str | None = None
    step: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class CatchupMark:
    """One catch-up fetch of a migration (a ``catchup`` event): at ``t`` the target node holds
    ``step`` of ``rank``, fetched as a ``delta`` against the step it held or whole, in ``seconds``;
    ``ok`` False: the fetch failed (``error``; the swap then fetches the whole step). ``capped``:
    the transfer ran under a bandwidth cap (no measure of an uncapped swap)."""

    t: float
    rank: int | None
    step: int | None
    ok: bool = True
    delta: bool = False
    raw_bytes: int | None = None
    wire_bytes: int | None = None
    seconds: float | None = None
    capped: bool = False
    error: str = ""

    @property
    def kind(self) -> str:
        """``"delta"``, ``"whole"`` or ``"failed"``."""
        return "failed" if not self.ok else "delta" if self.delta else "whole"


@dataclass(frozen=True)
class MigrationSpan:
    """A live migration of ``rank`` from node ``source`` to ``target`` (policy/migration.py), from
    ``migration_start`` (``start``) to ``migration_done`` or ``migration_aborted`` (``end``).

    ``outcome``: ``"done"``, ``"aborted"`` (``phase``: the phase it was aborted in, ``error``) or
    ``"unfinished"`` (neither came: ``end`` is the log's end, or the job's failure). Its
    :attr:`stages`: ``prepare`` from ``start`` to ``paused`` (``migration_pause``; the target
    fetches the step, the joiner restores it, the catch-up rounds run while the job trains),
    then ``swap`` from ``paused`` to ``end`` (every rank runs to ``boundary``; the new
    ``generation`` plays the joiner in the rank). ``catchups``: this rank's ``catchup`` events
    while it was open, in time order. ``catchup_rounds`` and ``swap_delta`` (the swap fetched the
    boundary as a delta) are ``migration_done``'s; None when it did not say.
    """

    rank: int | None
    start: float
    end: float
    source: str | None = None
    target: str | None = None
    reason: str = ""
    joiner: int | None = None
    prepare_step: int | None = None
    boundary: int | None = None
    paused: float | None = None
    generation: int | None = None
    outcome: str = "unfinished"
    phase: str | None = None
    catchups: tuple[CatchupMark, ...] = ()
    catchup_rounds: int | None = None
    swap_delta: bool | None = None
    pause_ratio: float | None = None
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def rounds(self) -> int:
        """Catch-up rounds: ``migration_done``'s count, else the ``catchup`` events seen."""
        return self.catchup_rounds if self.catchup_rounds is not None else len(self.catchups)

    @property
    def stages(self) -> tuple[StageSpan, ...]:
        """``prepare`` (to ``paused``, or to ``end`` when it never paused), then ``swap``."""
        return prepare_then_swap(self.start, self.paused, self.end)


@dataclass(frozen=True)
class ElasticWait:
    """Failed ``ranks`` (numbered as before any shrink) that no process could play: the job
    stopped and waited up to ``wait_s`` seconds for a spare (``elastic_wait``; several of them
    before one decision are one wait), from ``start`` to ``end``. ``outcome``: ``"shrink"`` (a
    ``shrink`` dropped them), ``"replaced"`` (a ``generation`` gave them processes), ``"failed"``
    (the job failed: ``end`` is its failure) or ``"unfinished"`` (``end``: the log's end)."""

    ranks: tuple[int, ...]
    start: float
    end: float
    wait_s: float | None = None
    outcome: str = "unfinished"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class ElasticResize:
    """A change of the world size from ``old_world_size`` to ``world_size`` (policy/elastic.py).

    ``kind`` ``"shrink"``: failed ranks had no spare; ``t`` is the ``shrink`` event, ``start`` the
    start of the :class:`ElasticWait` it ended (``t`` when there was none), ``end`` when the smaller
    ``generation`` trained again (end of its rebuild; ``outcome`` ``"unfinished"`` and the log's end,
    or the job's failure, when it never did). ``dropped``: old rank numbers; ``renumbered``: old ->
    new number of every rank that plays on under another number; ``reason``: why it shrank.

    ``kind`` ``"grow"``: idle spares joined as ranks ``old_world_size..world_size-1``. ``start`` is
    ``grow_start`` (the joiners fetch ``prepare_step`` and restore it while the job trains),
    ``paused`` ``grow_pause`` (every rank runs to ``boundary``), ``t`` the ``grow`` event (the new
    ``generation``), ``end`` ``grow_done`` (``outcome`` ``"done"``), ``grow_aborted`` (``"aborted"``,
    ``error``; ``t`` is then the abort) or the log's end (``"unfinished"``). ``joiners``: spawn id ->
    node. :attr:`seconds` is ``grow_done``'s own measure when it gave one.
    """

    kind: str
    t: float
    start: float
    end: float
    old_world_size: int | None = None
    world_size: int | None = None
    generation: int | None = None
    outcome: str = "done"
    reason: str = ""
    dropped: tuple[int, ...] = ()
    renumbered: Mapping[int, int] = field(default_factory=dict)
    paused: float | None = None
    prepare_step: int | None = None
    boundary: int | None = None
    joiners: Mapping[int, str] = field(default_factory=dict)
    error: str = ""
    took_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.took_s if self.took_s is not None else self.end - self.start

    @property
    def resized(self) -> bool:
        """Whether the world size changed: a shrink, or a grow that swapped its joiners in."""
        return self.kind == "shrink" or self.outcome == "done" or self.generation is not None

    @property
    def sizes(self) -> str:
        """``"3→2"`` (``?`` for a size the log does not give)."""

        def n(x: int | None) -> str:
            return "?" if x is None else str(x)

        return f"{n(self.old_world_size)}→{n(self.world_size)}"

    @property
    def label(self) -> str:
        """``"shrink 3→2"``, ``"grow 2→3"``, ``"grow 2→3 aborted"``."""
        return f"{self.kind} {self.sizes}" + (f" {self.outcome}" if self.outcome == "aborted" else "")

    @property
    def new_ranks(self) -> tuple[int, ...]:
        """A grow's joining ranks (none for a shrink, or when the sizes are unknown)."""
        if self.kind != "grow" or self.old_world_size is None or self.world_size is None:
            return ()
        return tuple(range(self.old_world_size, self.world_size))

    @property
    def stages(self) -> tuple[StageSpan, ...]:
        """A grow's ``prepare`` (to ``paused``, or to ``end`` when it never paused) and ``swap``;
        a shrink's ``wait`` (``start`` to ``t``, when it waited) and ``swap`` (``t`` to ``end``)."""
        if self.kind == "shrink":
            out = [StageSpan("wait", self.start, self.t)] if self.t > self.start else []
            return (*out, StageSpan("swap", self.t, max(self.end, self.t)))
        return prepare_then_swap(self.start, self.paused, self.end)


def prepare_then_swap(start: float, paused: float | None, end: float) -> tuple[StageSpan, ...]:
    """A migration's or a grow's stages: ``prepare`` from ``start`` to ``paused`` (to ``end`` when
    it never paused), then ``swap`` to ``end``."""
    if paused is None:
        return (StageSpan("prepare", start, max(end, start)),)
    paused = max(paused, start)
    return (StageSpan("prepare", start, paused), StageSpan("swap", paused, max(end, paused)))


@dataclass(frozen=True)
class OtherEvent:
    """An event the model has no row for (drawn as a tick on the "other events" row)."""

    t: float
    event: str
    rank: int | None = None
    stage: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timeline:
    """Everything :func:`render_timeline` and :func:`timeline_text` show, times in seconds since
    ``t0`` (unix time of the job's start). ``outcome`` is ``job_end``'s state (None: the log has
    no ``job_end``: the job is running or was killed); ``begin`` is the first event's time (0, or
    less for events logged before ``job_start``), ``end`` the last one's. A job dir reused by
    several jobs holds all their logs: the model is the last job's, ``earlier_jobs`` counts the
    others (a coordinator restarted within a job logs ``job_start`` again: same job).
    ``world_size`` is the first generation's; ``resizes`` (time order) change it."""

    job_id: str | None = None
    earlier_jobs: int = 0
    t0: float = 0.0
    begin: float = 0.0
    end: float = 0.0
    world_size: int = 0
    nodes: tuple[str, ...] = ()
    spares: int | None = None
    outcome: str | None = None
    error: str | None = None
    events: int = 0
    intervals: tuple[RankInterval, ...] = ()
    failures: tuple[FailureMark, ...] = ()
    recoveries: tuple[Recovery, ...] = ()
    generations: tuple[Generation, ...] = ()
    node_spans: tuple[NodeSpan, ...] = ()
    node_marks: tuple[Mark, ...] = ()
    coordinator_marks: tuple[Mark, ...] = ()
    tier_marks: tuple[Mark, ...] = ()
    migrations: tuple[MigrationSpan, ...] = ()
    resizes: tuple[ElasticResize, ...] = ()
    waits: tuple[ElasticWait, ...] = ()
    other: tuple[OtherEvent, ...] = ()
    training_start: float | None = None
    finished_at: float | None = None
    failed_at: float | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank seen (``0 .. world_size-1`` plus any other rank an event names)."""
        seen = set(range(self.world_size)) | {i.rank for i in self.intervals}
        seen |= {f.rank for f in self.failures if f.rank is not None}
        seen |= {m.rank for m in self.migrations if m.rank is not None}
        seen |= {r for z in self.resizes for r in z.new_ranks} | {r for w in self.waits for r in w.ranks}
        return tuple(sorted(seen))

    @property
    def lost_steps(self) -> int:
        """Steps recomputed after restores, summed over reconfigurations (not over failures:
        the failures one reconfiguration repaired share its lost steps)."""
        by_gen: dict[object, int] = {}
        for i, r in enumerate(self.recoveries):
            if r.lost_steps is not None:
                by_gen[r.generation if r.generation is not None else ("r", i)] = r.lost_steps
        return sum(by_gen.values())
