"""The events of a job's log (``<job_dir>/events.jsonl``) as types: one frozen dataclass per kind.

The writers (coordinator, launcher, persisters) log these through :class:`~nonstop.runtime.eventlog.
EventLog`, and the readers (``nonstop timeline``) read them back through :func:`decode`, so a field
renamed on one side is a type error (or a ``TypeError`` when logged by name), not an empty row.

* Each class names its kind in ``kind`` (the line's ``"event"``); its fields are the line's other
  keys, with the JSON types the writers log. :data:`REGISTRY` maps a kind to its class.
* :meth:`Event.to_json` is the line (``{"ts": ..., "event": kind, **fields}``), exactly as the log
  held it before these types existed. A field marked optional that holds its default is left out,
  as the writers that do not pass it always did.
* :func:`decode` reads a line back, tolerantly: an unknown kind is an :class:`UnknownEvent` (the raw
  object kept); a missing field, or one of the wrong JSON type, decodes to its default (``None``
  for a field that admits it, else the type's empty value, unless the field names another); a key
  the class does not know is kept in ``extra``.
* The first line of a log written since the types exist is a :class:`LogHeader` (``"eventlog"``,
  with :data:`VERSION`); logs without it are read the same way.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "REGISTRY",
    "VERSION",
    "Event",
    "LogHeader",
    "UnknownEvent",
    "as_int",
    "as_str",
    "decode",
    "from_fields",
]

VERSION = 1  # of the log's format: LogHeader's version

_ABSENT = "absent"  # metadata: what decode gives for the field when a line lacks it
_OMIT = "omit"  # metadata: to_json leaves the field out while it holds its default


# a field only some writers pass: its default when not passed, and then not in the line
_OPTIONAL = {_OMIT: True}


REGISTRY: dict[str, type[Event]] = {}


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of the log. ``ts``: unix time it was logged (None until :class:`EventLog` stamps
    it); ``extra``: keys of a decoded line that this class does not know (a newer writer's)."""

    kind: ClassVar[str] = ""
    ts: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.kind:
            if cls.kind in REGISTRY:
                raise TypeError(f"two event classes for kind {cls.kind!r}")
            REGISTRY[cls.kind] = cls

    @property
    def event(self) -> str:
        """The line's ``"event"``: the kind."""
        return self.kind

    def fields(self) -> dict[str, Any]:
        """The line's keys but ``ts`` and ``event``, in declaration order (then ``extra``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("ts", "extra"):
                continue
            value = getattr(self, f.name)
            if f.metadata.get(_OMIT) and value == f.default:
                continue
            out[f.metadata.get("json", f.name)] = value
        out.update(self.extra)
        return out

    def to_json(self) -> dict[str, Any]:
        """The line as a JSON object."""
        head: dict[str, Any] = {} if self.ts is None else {"ts": self.ts}
        return {**head, "event": self.event, **self.fields()}


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A line of a kind no class is registered for: ``name`` and its other keys, as read."""

    name: str
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def event(self) -> str:
        return self.name

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.raw.items() if k not in ("ts", "event")}


# -- the log ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LogHeader(Event):
    """The first line of a log: its format's version."""

    kind: ClassVar[str] = "eventlog"
    version: int = VERSION


# -- the job ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class JobStart(Event):
    kind: ClassVar[str] = "job_start"
    job_id: str | None
    nnodes: int | None
    nproc: int | None
    spares: int | None
    control: str
    command: list[str]
    faults: list[str]


@dataclass(frozen=True, kw_only=True)
class Resume(Event):
    """The job starts from a durable checkpoint (``nonstop run --resume``)."""

    kind: ClassVar[str] = "resume"
    url: str | None
    step: int | None
    world_size: int | None
    checkpoint_world_size: int | None


@dataclass(frozen=True, kw_only=True)
class NodesJoined(Event):
    kind: ClassVar[str] = "nodes_joined"
    nodes: list[str]


@dataclass(frozen=True, kw_only=True)
class Finish(Event):
    """Every rank reported done: the job finishes at ``step``."""

    kind: ClassVar[str] = "finish"
    step: int | None
    generation: int | None


@dataclass(frozen=True, kw_only=True)
class JobDone(Event):
    kind: ClassVar[str] = "job_done"
    generation: int | None


@dataclass(frozen=True, kw_only=True)
class JobFailed(Event):
    kind: ClassVar[str] = "job_failed"
    error: str | None


@dataclass(frozen=True, kw_only=True)
class JobEnd(Event):
    kind: ClassVar[str] = "job_end"
    state: str | None
    seconds: float | None
    generation: int | None
    error: str | None
    replication: dict[str, Any]


# -- nodes and peers ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NodeJoin(Event):
    kind: ClassVar[str] = "node_join"
    node: str | None
    domain: str
    data: str
    rejoin: bool


@dataclass(frozen=True, kw_only=True)
class NodeLost(Event):
    kind: ClassVar[str] = "node_lost"
    node: str | None
    reason: str
    quarantined: bool


@dataclass(frozen=True, kw_only=True)
class NodeDisconnected(Event):
    kind: ClassVar[str] = "node_disconnected"
    node: str | None


@dataclass(frozen=True, kw_only=True)
class NodeReconnected(Event):
    kind: ClassVar[str] = "node_reconnected"
    node: str | None


@dataclass(frozen=True, kw_only=True)
class NodeReleased(Event):
    """A node whose ranks all moved away after a preemption notice."""

    kind: ClassVar[str] = "node_released"
    node: str | None


@dataclass(frozen=True, kw_only=True)
class CoordinatorLeads(Event):
    kind: ClassVar[str] = "coordinator_leads"
    address: str
    waited_s: float | None


@dataclass(frozen=True, kw_only=True)
class CoordinatorResumed(Event):
    kind: ClassVar[str] = "coordinator_resumed"
    address: str
    waited_s: float | None
    generation: int | None
    state: str
    nodes: list[str]
    lost: list[str]


@dataclass(frozen=True, kw_only=True)
class Client(Event):
    """A control client (``nonstop status``, ``nonstop migrate``) connected."""

    kind: ClassVar[str] = "client"
    peer: str | None


@dataclass(frozen=True, kw_only=True)
class Refused(Event):
    """A peer the control server or the coordinator turned away; ``node`` when it named one."""

    kind: ClassVar[str] = "refused"
    peer: str | None
    node: str | None = field(default=None, metadata=_OPTIONAL)
    reason: str


# -- processes ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Spawn(Event):
    kind: ClassVar[str] = "spawn"
    spawn_id: int | None
    role: str = field(metadata={_ABSENT: "worker"})
    rank: int | None
    node: str | None


@dataclass(frozen=True, kw_only=True)
class Spawned(Event):
    kind: ClassVar[str] = "spawned"
    spawn_id: int | None
    pid: int | None
    node: str | None


@dataclass(frozen=True, kw_only=True)
class Connect(Event):
    kind: ClassVar[str] = "connect"
    spawn_id: int | None
    role: str
    rank: int | None
    resumed: bool


@dataclass(frozen=True, kw_only=True)
class Exit(Event):
    kind: ClassVar[str] = "exit"
    spawn_id: int | None
    role: str
    rank: int | None
    returncode: int | None
    how: str
    node: str | None


@dataclass(frozen=True, kw_only=True)
class SpareTakesOver(Event):
    """A hot spare plays ``rank`` (the cold process ``cold_spawn_id`` started for it lost the race)."""

    kind: ClassVar[str] = "spare_takes_over"
    rank: int | None
    spawn_id: int | None
    cold_spawn_id: int | None


# -- failures and recoveries --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    rank: int | None
    step: int | None
    # the fault's kind (kill, hang...): a field named like the class's ClassVar, read as fault_kind
    fault_kind: str | None = field(metadata={"json": "kind"})
    spawn_id: int | None
    node: str | None


@dataclass(frozen=True, kw_only=True)
class FaultReport(Event):
    kind: ClassVar[str] = "fault_report"
    rank: int | None
    spawn_id: int | None
    error: str | None


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    kind: ClassVar[str] = "hang_detected"
    rank: int | None
    spawn_id: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class Failure(Event):
    kind: ClassVar[str] = "failure"
    failure_kind: str = field(metadata={"json": "kind", _ABSENT: "?"})
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
    migration: int | None = field(default=None, metadata=_OPTIONAL)
    grow: list[int] | None = field(default=None, metadata=_OPTIONAL)

    @property
    def members_by_rank(self) -> dict[int, int]:
        return {r: s for k, s in self.members.items() if (r := as_int(k)) is not None}

    @property
    def nodes_by_rank(self) -> dict[int, str]:
        return {r: n for k, n in self.nodes.items() if (r := as_int(k)) is not None and n is not None}


@dataclass(frozen=True, kw_only=True)
class Stage(Event):
    """A stage of ``generation``'s reconfiguration ended; it took ``seconds``."""

    kind: ClassVar[str] = "stage"
    generation: int | None
    stage: str
    seconds: float | None


@dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    """A failure recovered (runtime/recovery.py's report): seconds per stage, MTTR, lost steps."""

    kind: ClassVar[str] = "recovery"
    failure_kind: str = field(metadata={"json": "kind", _ABSENT: "?"})
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


@dataclass(frozen=True, kw_only=True)
class Fetched(Event):
    """A node's answer to a fetch of ``rank``'s snapshot (``early``: asked for before its generation)."""

    kind: ClassVar[str] = "fetched"
    node: str | None
    rank: int | None
    ok: bool | None
    seconds: float | None
    error: str | None
    early: bool = field(default=False, metadata=_OPTIONAL)


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
    nodes: list[str] | None = field(default=None, metadata=_OPTIONAL)


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
    errors: list[str]


@dataclass(frozen=True, kw_only=True)
class DurableUnavailable(Event):
    kind: ClassVar[str] = "durable_unavailable"
    error: str | None


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
    ``shards``: new rank -> the data shards it plays (keys as JSON text)."""

    kind: ClassVar[str] = "shrink"
    world_size: int | None
    old_world_size: int | None
    dropped: list[int]
    renumbered: dict[str, int]
    shards: dict[str, list[int]]
    reason: str

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
    ok: bool = field(metadata={_ABSENT: True})
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
    """``stages``: seconds between the migration's marks, named by the later one."""

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


@dataclass(frozen=True, kw_only=True)
class MigrationAborted(Event):
    kind: ClassVar[str] = "migration_aborted"
    rank: int | None
    phase: str | None
    error: str


# -- reading ------------------------------------------------------------------------------------------
def as_int(x: object) -> int | None:
    """An int from a JSON value: an int (not a bool) or its decimal text; else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.lstrip("-").isdigit():
        return int(x)
    return None


def as_str(x: object) -> str | None:
    """Text from a JSON scalar (a number as its text); None for null, a list or an object."""
    return str(x) if isinstance(x, str | int | float) else None


_NO = object()  # a value that does not convert


def _convert(value: object, tp: Any) -> Any:
    """``value`` as type ``tp`` (the field types used above), or ``_NO``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            return None if type(None) in args else _NO
        for arg in args:
            if arg is not type(None) and (got := _convert(value, arg)) is not _NO:
                return got
        return _NO
    if origin is list:
        if not isinstance(value, list):
            return _NO
        (item,) = typing.get_args(tp)
        return [got for v in value if (got := _convert(v, item)) is not _NO]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            return _NO
        _, item = typing.get_args(tp)
        return {str(k): got for k, v in value.items() if (got := _convert(v, item)) is not _NO}
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        got = as_int(value)
        return _NO if got is None else got
    if tp is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO
    if tp is str:
        text = as_str(value)
        return _NO if text is None else text
    raise TypeError(f"no decoding for field type {tp!r}")


def _empty(tp: Any) -> Any:
    """What a missing field of type ``tp`` decodes to, when it names nothing else."""
    origin = typing.get_origin(tp)
    if tp is Any or (origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)):
        return None
    if origin is list:
        return []
    if origin in (dict, Mapping):
        return {}
    return {bool: False, int: 0, float: 0.0, str: ""}[tp]


_SCHEMAS: dict[type[Event], list[tuple[str, str, Any, Any]]] = {}


def _schema(cls: type[Event]) -> list[tuple[str, str, Any, Any]]:
    """(attribute, JSON key, type, value when missing) of each of ``cls``'s line fields."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            if f.name in ("ts", "extra"):
                continue
            tp = hints[f.name]
            if _ABSENT in f.metadata:
                missing = f.metadata[_ABSENT]
            elif f.default is not dataclasses.MISSING:
                missing = f.default
            else:
                missing = _empty(tp)
            out.append((f.name, f.metadata.get("json", f.name), tp, missing))
        _SCHEMAS[cls] = out
    return _SCHEMAS[cls]


def decode(obj: Mapping[str, Any]) -> Event:
    """The typed event of one log line (see the module docstring: unknown kinds, missing fields)."""
    name = obj.get("event")
    ts = obj.get("ts")
    stamp = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        return UnknownEvent(ts=stamp, name=str(name), raw=dict(obj))
    values: dict[str, Any] = {}
    known = {"ts", "event"}
    for attr, key, tp, missing in _schema(cls):
        known.add(key)
        got = _convert(obj[key], tp) if key in obj else _NO
        values[attr] = missing if got is _NO else got
    extra = {k: v for k, v in obj.items() if k not in known}
    return cls(ts=stamp, extra=extra, **values)


def from_fields(kind: str, fields: Mapping[str, Any]) -> Event:
    """The event ``kind`` with the line fields ``fields`` as a writer names them; ``TypeError`` for an
    unknown kind or a field the kind does not have (or lacks), so a renamed field fails loudly."""
    cls = REGISTRY.get(kind)
    if cls is None:
        raise TypeError(f"unknown event kind {kind!r}: add its class to nonstop/runtime/events.py")
    args: dict[str, Any] = {}
    by_key = {key: attr for attr, key, _, _ in _schema(cls)}
    for key, value in fields.items():
        if key not in by_key:
            raise TypeError(f"event {kind!r} has no field {key!r} (it has: {', '.join(by_key)})")
        args[by_key[key]] = value
    return cls(**args)
