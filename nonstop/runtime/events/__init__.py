"""The events of a job's log (``<job_dir>/events.jsonl``) as types: one frozen dataclass per kind.

The kinds live by concept in :mod:`.job` (the job, nodes, peers, processes), :mod:`.recovery`
(failures, generations, stages, recoveries, fetches, the tiers) and :mod:`.moves` (elastic resizes,
live migrations); :mod:`.base` holds :class:`Event`, the registry and the decoding.

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

from nonstop.runtime.events.base import (
    REGISTRY,
    VERSION,
    Event,
    LogHeader,
    UnknownEvent,
    as_int,
    as_str,
    decode,
    from_fields,
)
from nonstop.runtime.events.health import (
    FailureGraded,
    HealthVerdict,
    ProactiveDecision,
    Straggler,
    StragglerCleared,
)
from nonstop.runtime.events.job import (
    Client,
    Connect,
    CoordinatorLeads,
    CoordinatorResumed,
    Exit,
    Finish,
    JobDone,
    JobEnd,
    JobFailed,
    JobStart,
    NodeDisconnected,
    NodeJoin,
    NodeLeaseLapsed,
    NodeLeaseRenewed,
    NodeLost,
    NodeReconnected,
    NodeReleased,
    NodesJoined,
    ProtocolError,
    Refused,
    Resume,
    SpareTakesOver,
    Spawn,
    Spawned,
)
from nonstop.runtime.events.memory import MemoryDegraded
from nonstop.runtime.events.moves import (
    Catchup,
    ElasticWait,
    Grow,
    GrowAborted,
    GrowDone,
    GrowPause,
    GrowStart,
    MigrationAborted,
    MigrationDone,
    MigrationPause,
    MigrationRefused,
    MigrationRequested,
    MigrationStart,
    OperationResumed,
    PreemptNotice,
    Shrink,
)
from nonstop.runtime.events.recovery import (
    DurableInstallFailed,
    DurableUnavailable,
    Failure,
    FaultInjected,
    FaultReport,
    Fetched,
    GroupsJoined,
    HangDetected,
    NewGeneration,
    Persist,
    PersistFailed,
    Recovery,
    ReplanDeferred,
    Replicated,
    ReplicationFailed,
    RestoreFromDurable,
    SilenceExcused,
    Stage,
)

__all__ = [
    "REGISTRY",
    "VERSION",
    "Catchup",
    "Client",
    "Connect",
    "CoordinatorLeads",
    "CoordinatorResumed",
    "DurableInstallFailed",
    "DurableUnavailable",
    "ElasticWait",
    "Event",
    "Exit",
    "Failure",
    "FailureGraded",
    "FaultInjected",
    "FaultReport",
    "GroupsJoined",
    "Fetched",
    "Finish",
    "Grow",
    "GrowAborted",
    "GrowDone",
    "GrowPause",
    "GrowStart",
    "HangDetected",
    "SilenceExcused",
    "HealthVerdict",
    "JobDone",
    "JobEnd",
    "JobFailed",
    "JobStart",
    "LogHeader",
    "MemoryDegraded",
    "MigrationAborted",
    "MigrationDone",
    "MigrationPause",
    "MigrationRefused",
    "MigrationRequested",
    "MigrationStart",
    "NewGeneration",
    "NodeDisconnected",
    "NodeJoin",
    "NodeLost",
    "NodeLeaseLapsed",
    "NodeLeaseRenewed",
    "NodeReconnected",
    "NodeReleased",
    "NodesJoined",
    "OperationResumed",
    "Persist",
    "PersistFailed",
    "PreemptNotice",
    "ProactiveDecision",
    "ProtocolError",
    "Recovery",
    "Refused",
    "ReplanDeferred",
    "Replicated",
    "ReplicationFailed",
    "RestoreFromDurable",
    "Resume",
    "Shrink",
    "SpareTakesOver",
    "Spawn",
    "Spawned",
    "Stage",
    "Straggler",
    "StragglerCleared",
    "UnknownEvent",
    "as_int",
    "as_str",
    "decode",
    "from_fields",
]
