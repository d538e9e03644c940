"""Events of the job's life, its nodes and peers, and its processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from nonstop.events.base import ABSENT, OPTIONAL, Event

__all__ = [
    "Client",
    "Connect",
    "CoordinatorLeads",
    "CoordinatorResumed",
    "Exit",
    "Finish",
    "JobDone",
    "JobEnd",
    "JobFailed",
    "JobStart",
    "NodeDisconnected",
    "NodeJoin",
    "NodeLost",
    "NodeReconnected",
    "NodeReleased",
    "NodesJoined",
    "ProcessExited",
    "ProtocolError",
    "Refused",
    "Resume",
    "SpareTakesOver",
    "Spawn",
    "Spawned",
]


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
class NodeLeaseLapsed(Event):
    """Store mode: a node's lease in the control store ended (a store stall, or the node cut off
    from the store) while the coordinator still heard the node: it is kept, and lost only if it
    also stops being heard (its agent registers a new lease meanwhile)."""

    kind: ClassVar[str] = "node_lease_lapsed"
    node: str | None
    heard_s_ago: float


@dataclass(frozen=True, kw_only=True)
class NodeLeaseRenewed(Event):
    """Store mode: a node whose lease had lapsed registered a new one."""

    kind: ClassVar[str] = "node_lease_renewed"
    node: str | None
    lapsed_s: float


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
    node: str | None = field(default=None, metadata=OPTIONAL)
    reason: str


@dataclass(frozen=True, kw_only=True)
class ProtocolError(Event):
    """An authenticated peer sent a message built wrong; only that peer failed (a worker's
    ``spawn_id``/``rank``, an agent's ``node``, or neither for a client)."""

    kind: ClassVar[str] = "protocol_error"
    peer: str | None
    message: str | None
    error: str
    node: str | None = field(default=None, metadata=OPTIONAL)
    spawn_id: int | None = field(default=None, metadata=OPTIONAL)
    rank: int | None = field(default=None, metadata=OPTIONAL)


# -- processes ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Spawn(Event):
    kind: ClassVar[str] = "spawn"
    spawn_id: int | None
    role: str = field(metadata={ABSENT: "worker"})
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
class ProcessExited(Event):
    """Process ``spawn_id`` (a ``role``, playing ``rank``) ended with ``returncode``; ``how``: what
    ended it."""

    kind: ClassVar[str] = "exit"
    spawn_id: int | None
    role: str
    rank: int | None
    returncode: int | None
    how: str
    node: str | None


Exit = ProcessExited  # its first name, kept for code that imports it


@dataclass(frozen=True, kw_only=True)
class SpareTakesOver(Event):
    """A hot spare plays ``rank`` (the cold process ``cold_spawn_id`` started for it lost the race)."""

    kind: ClassVar[str] = "spare_takes_over"
    rank: int | None
    spawn_id: int | None
    cold_spawn_id: int | None
