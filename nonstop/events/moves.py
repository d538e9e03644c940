"""Events of elastic resizes (waits for a spare, shrinks, grows) and of live migrations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nonstop.events.base import ABSENT, OPTIONAL, Event, as_int

__all__ = [
    "Catchup",
    "ElasticWait",
    "Grow",
    "GrowAborted",
    "GrowDone",
    "GrowPause",
    "GrowStart",
    "MigrationAborted",
    "MigrationDone",
    "MigrationPause",
    "MigrationRefused",
    "MigrationRequested",
    "MigrationStart",
    "OperationResumed",
    "PreemptNotice",
    "Shrink",
]


# -- elastic resizes ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ElasticWait(Event):
    """No process can play ``ranks``: the job waits up to ``wait_s`` for a spare."""

    kind: ClassVar[str] = "elastic_wait"
    ranks: list[int]
    wait_s: float | None


@dataclass(frozen=True, kw_only=True)
class Shrink(Event):
    """The job goes on with fewer ranks: ``dropped`` (old numbers), ``renumbered`` old -> new,
    ``shards``: new rank -> the data shards it plays (keys as JSON text); ``shrink_first``: by
    choice (policy/survivors.py), spares join later by a grow."""

    kind: ClassVar[str] = "shrink"
    world_size: int | None
    old_world_size: int | None
    dropped: list[int]
    renumbered: dict[str, int]
    shards: dict[str, list[int]]
    reason: str
    shrink_first: bool = False  # spares could take the ranks: they join later by a grow

    @property
    def renumbered_ranks(self) -> dict[int, int]:
        return {o: n for k, n in self.renumbered.items() if (o := as_int(k)) is not None}


@dataclass(frozen=True, kw_only=True)
class GrowStart(Event):
    """Idle spares (``joiners``: spawn id -> node) prepare to join as new ranks."""

    kind: ClassVar[str] = "grow_start"
    world_size: int | None
    new_world_size: int | None
    prepare_step: int | None
    joiners: dict[str, str]

    @property
    def joiners_by_spawn_id(self) -> dict[int, str]:
        return {s: n for k, n in self.joiners.items() if (s := as_int(k)) is not None}


@dataclass(frozen=True, kw_only=True)
class GrowPause(Event):
    kind: ClassVar[str] = "grow_pause"
    boundary: int | None
    prepare_s: float | None


@dataclass(frozen=True, kw_only=True)
class Grow(Event):
    """The grow's swap: a generation with the joiners as ranks ``old_world_size..``."""

    kind: ClassVar[str] = "grow"
    world_size: int | None
    old_world_size: int | None
    boundary: int | None
    shards: dict[str, list[int]]


@dataclass(frozen=True, kw_only=True)
class GrowDone(Event):
    kind: ClassVar[str] = "grow_done"
    world_size: int | None
    boundary: int | None
    seconds: float | None
    # the longest gap of a rank across the boundary (S -> S+1) and over the median step
    max_step_gap_s: float | None = field(default=None, metadata=OPTIONAL)
    pause_ratio: float | None = field(default=None, metadata=OPTIONAL)
    # a failure ended the grow's generation before its first step: the grow took effect, its
    # pause was not measured (why)
    interrupted: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class GrowAborted(Event):
    kind: ClassVar[str] = "grow_aborted"
    boundary: int | None
    error: str


# -- live migrations ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class MigrationRequested(Event):
    kind: ClassVar[str] = "migration_requested"
    rank: int | None
    target: str | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class MigrationRefused(Event):
    kind: ClassVar[str] = "migration_refused"
    rank: int | None
    target: str | None
    reason: str | None


@dataclass(frozen=True, kw_only=True)
class PreemptNotice(Event):
    kind: ClassVar[str] = "preempt_notice"
    node: str | None
    grace_s: float | None
    ranks: list[int]


@dataclass(frozen=True, kw_only=True)
class MigrationStart(Event):
    """``rank`` moves from node ``source`` to ``target``: ``joiner`` (spawn id) restores ``step``."""

    kind: ClassVar[str] = "migration_start"
    rank: int | None
    source: str | None
    target: str | None
    joiner: int | None
    step: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class Catchup(Event):
    """A catch-up fetch of a migration: the target holds ``step``, fetched as a ``delta`` or whole."""

    kind: ClassVar[str] = "catchup"
    rank: int | None
    step: int | None
    ok: bool = field(metadata={ABSENT: True})
    delta: bool
    raw_bytes: int | None
    wire_bytes: int | None
    seconds: float | None
    capped: bool
    error: str | None


@dataclass(frozen=True, kw_only=True)
class MigrationPause(Event):
    kind: ClassVar[str] = "migration_pause"
    rank: int | None
    boundary: int | None


@dataclass(frozen=True, kw_only=True)
class MigrationDone(Event):
    """``stages``: seconds between the migration's marks, named by the later one.
    ``interrupted``: a failure of another rank ended the swap's generation before its first
    step -- the rank had moved (the joiner held it, the leaver had retired), the pause was not
    measured."""

    kind: ClassVar[str] = "migration_done"
    rank: int | None
    source: str | None
    target: str | None
    boundary: int | None
    stages: dict[str, float]
    max_step_gap_s: float | None
    median_step_s: float | None
    pause_ratio: float | None
    reason: str
    catchup_rounds: int | None
    swap_delta: bool | None
    interrupted: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class OperationResumed(Event):
    """A restarted coordinator found a migration or grow its predecessor had already swapped:
    the resync generation finishes it."""

    kind: ClassVar[str] = "operation_resumed"
    operation: str
    generation: int | None


@dataclass(frozen=True, kw_only=True)
class MigrationAborted(Event):
    kind: ClassVar[str] = "migration_aborted"
    rank: int | None
    phase: str | None
    error: str
