"""Events of failures and their recovery (generations, stages, fetches) and of the storage tiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nonstop.events.base import ABSENT, JSON_KEY, OPTIONAL, Event, as_int

__all__ = [
    "DurableInstallFailed",
    "DurableUnavailable",
    "Failure",
    "FaultInjected",
    "FaultReport",
    "Fetched",
    "GroupsJoined",
    "HangDetected",
    "NewGeneration",
    "Persist",
    "PersistFailed",
    "Recovery",
    "ReplanDeferred",
    "Replicated",
    "ReplicationFailed",
    "RestoreFromDurable",
    "SilenceExcused",
    "Stage",
    "ReconfigurationStage",
]


# -- failures and recoveries --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    rank: int | None
    step: int | None
    # the fault's kind (kill, hang...): a field named like the class's ClassVar, read as fault_kind
    fault_kind: str | None = field(metadata={JSON_KEY: "kind"})
    spawn_id: int | None
    node: str | None


@dataclass(frozen=True, kw_only=True)
class FaultReport(Event):
    kind: ClassVar[str] = "fault_report"
    rank: int | None
    spawn_id: int | None
    error: str | None


@dataclass(frozen=True, kw_only=True)
class GroupsJoined(Event):
    """A sharded job's rank joined a generation's mesh: how many of its mesh groups it kept from
    the last generation and how many it built, the seconds that took (``mesh_s``: the default
    group excluded), and the seconds of its whole join (``rebuild_s``: the default group, the
    mesh, the model built on it and the restored state copied in)."""

    kind: ClassVar[str] = "groups_joined"
    gen: int
    rank: int
    kept: int
    built: int
    mesh_s: float
    rebuild_s: float


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    kind: ClassVar[str] = "hang_detected"
    rank: int | None
    spawn_id: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class SilenceExcused(Event):
    """A silent worker its node agent saw move (``agent/silence.py``): starved, not hung. It is
    left alive, and allowed ``JOB_STALL_FACTOR`` x the heartbeat timeout before it is killed."""

    kind: ClassVar[str] = "silence_excused"
    rank: int | None
    spawn_id: int
    reason: str
    detail: str


@dataclass(frozen=True, kw_only=True)
class Failure(Event):
    kind: ClassVar[str] = "failure"
    failure_kind: str = field(metadata={JSON_KEY: "kind", ABSENT: "?"})
    rank: int | None
    spawn_id: int | None
    detail: str
    step: int | None
    detect_s: float | None


@dataclass(frozen=True, kw_only=True)
class ReplanDeferred(Event):
    kind: ClassVar[str] = "replan_deferred"
    generation: int | None


@dataclass(frozen=True, kw_only=True)
class NewGeneration(Event):
    """A membership decided: who plays each rank (``members``: rank -> spawn id, ``nodes``: rank ->
    node, keys as JSON text), restored from ``restore_step`` of ``tier``, because ``cause`` failed.
    ``migration``: the rank a migration swaps; ``grow``: the ranks a grow adds."""

    kind: ClassVar[str] = "generation"
    generation: int | None
    restore_step: int | None
    tier: str | None
    members: dict[str, int]
    nodes: dict[str, str | None]
    replacements: dict[str, str]
    cause: list[int]
    fetches: dict[str, str]
    replans: int | None
    migration: int | None = field(default=None, metadata=OPTIONAL)
    grow: list[int] | None = field(default=None, metadata=OPTIONAL)

    @property
    def members_by_rank(self) -> dict[int, int]:
        return {r: s for k, s in self.members.items() if (r := as_int(k)) is not None}

    @property
    def nodes_by_rank(self) -> dict[int, str]:
        return {r: n for k, n in self.nodes.items() if (r := as_int(k)) is not None and n is not None}


@dataclass(frozen=True, kw_only=True)
class ReconfigurationStage(Event):
    """A stage of ``generation``'s reconfiguration ended; it took ``seconds``."""

    kind: ClassVar[str] = "stage"
    generation: int | None
    stage: str
    seconds: float | None


Stage = ReconfigurationStage  # its first name, kept for code that imports it (not the policy's Stage)


@dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    """A failure recovered (policy/reconfiguration.py's report): seconds per stage, MTTR, lost steps."""

    kind: ClassVar[str] = "recovery"
    failure_kind: str = field(metadata={JSON_KEY: "kind", ABSENT: "?"})
    rank: int | None
    step: int | None
    detail: str
    detect_s: float | None
    stages: dict[str, float]
    training_again_s: float | None
    mttr_s: float | None
    lost_steps: int | None
    restore_step: int | None
    replacement: str | None
    generation: int | None
    replans: int | None
    # the longest a surviving rank went between two completed steps, in seconds and over the
    # median step (None: no survivor, or a log older than the field)
    survivor_gap_s: float | None = field(default=None, metadata=OPTIONAL)
    survivor_gap_steps: float | None = field(default=None, metadata=OPTIONAL)
    # steps some rank completed past the restored one, trained again: the failed rank's step
    # in flight where the others finished it, and with --snapshot-every K up to K - 1 more
    redone_steps: int | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class Fetched(Event):
    """A node's answer to a fetch of ``rank``'s snapshot (``early``: asked for before its generation)."""

    kind: ClassVar[str] = "fetched"
    node: str | None
    rank: int | None
    ok: bool | None
    seconds: float | None
    error: str | None
    early: bool = field(default=False, metadata=OPTIONAL)


# -- the tiers ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Replicated(Event):
    kind: ClassVar[str] = "replicated"
    step: int | None
    seconds: float | None
    raw_bytes: int | None
    wire_bytes: int | None
    rounds: int | None


@dataclass(frozen=True, kw_only=True)
class ReplicationFailed(Event):
    kind: ClassVar[str] = "replication_failed"
    step: int | None
    node: str | None
    error: str | None
    failed_rounds: int | None


@dataclass(frozen=True, kw_only=True)
class Persist(Event):
    """A step made durable (``nodes``: the nodes of a cluster round, only it says)."""

    kind: ClassVar[str] = "persist"
    step: int | None
    raw_bytes: int | None
    stored_bytes: int | None
    seconds: float | None
    full: bool
    url: str | None
    nodes: list[str] | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class PersistFailed(Event):
    kind: ClassVar[str] = "persist_failed"
    error: str | None


@dataclass(frozen=True, kw_only=True)
class RestoreFromDurable(Event):
    kind: ClassVar[str] = "restore_from_durable"
    step: int | None
    url: str | None
    seconds: float | None


@dataclass(frozen=True, kw_only=True)
class DurableInstallFailed(Event):
    kind: ClassVar[str] = "durable_install_failed"
    step: int | None
    errors: list[str | None]  # a node's error, null when it gave none


@dataclass(frozen=True, kw_only=True)
class DurableUnavailable(Event):
    kind: ClassVar[str] = "durable_unavailable"
    error: str | None
