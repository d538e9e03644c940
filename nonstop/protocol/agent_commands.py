"""The agent channel, coordinator -> agent (:mod:`.agent` has the whole conversation): the answer
to a hello (:func:`decode_welcome`), then commands (:func:`decode_command`) -- the lease's
acknowledgement, the process commands the agent's loop carries out (spawn, kill, release,
finish, fenced) and the data-path commands (:data:`DATA_COMMANDS`) that move snapshot bytes on
threads of their own (:class:`nonstop.agent.data_path.NodeWork`).

The coordinator encodes each (:mod:`nonstop.coordinator`); a request (:data:`AgentRequestMsg`)
gets its id from :meth:`Executor.request <nonstop.coordinator.executor.Executor.request>`
(``with_id``), encoded last.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nonstop.protocol.base import (
    Json,
    WireError,
    as_int,
    as_num,
    kind_of,
    need,
    opt_bool,
    opt_int,
    opt_str,
)

__all__ = [
    "DATA_COMMANDS",
    "AgentCommand",
    "AgentRequestMsg",
    "CommittedMsg",
    "FencedMsg",
    "FetchRequestMsg",
    "ForgetMsg",
    "InstallDurableMsg",
    "InventoryRequestMsg",
    "KillMsg",
    "LeaseOkMsg",
    "NodeFinishMsg",
    "NodeRefusedMsg",
    "NodeWelcomeMsg",
    "PersistRanksMsg",
    "ReleaseMsg",
    "ReplicateMsg",
    "SpawnMsg",
    "decode_command",
    "decode_welcome",
    "request_id",
]

UNSET = -1  # a request's id before Executor.request gives it one


def _str_map(m: Mapping[str, Any], key: str) -> dict[str, str] | None:
    """Field ``key``: an object, its keys and values as text (None when absent)."""
    v = m.get(key)
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise WireError(f"{m.get('t')!r} message: {key} must be an object, not {v!r}")
    return {str(k): str(x) for k, x in v.items()}


def _ints(m: Mapping[str, Any], key: str) -> tuple[int, ...]:
    """Field ``key``: a list of integers (present)."""
    v = need(m, key)
    try:
        if isinstance(v, list) and not any(isinstance(x, bool) for x in v):
            return tuple(int(x) for x in v)
    except (TypeError, ValueError):
        pass
    raise WireError(f"{m.get('t')!r} message: {key} must be a list of integers, not {v!r}")


# -- the answer to a hello ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NodeWelcomeMsg:
    """The node joined job ``job_id``: its lease's TTL, the snapshot slots per rank, the replicas
    it keeps, the workers' environment, the control store's URL (store mode; None: none) and how
    long it waits for a restarted coordinator. ``resumed``: a reconnect, which carries only
    ``job_id`` and ``lease_ttl_s`` (the node already has the rest)."""

    T: ClassVar[str] = "welcome"
    job_id: str
    lease_ttl_s: float
    resumed: bool = False
    num_slots: int = 2
    replicas: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    store: str | None = None
    reconnect_s: float = 30.0

    def encode(self) -> Json:
        if self.resumed:
            return {"t": self.T, "job_id": self.job_id, "resumed": True, "lease_ttl_s": self.lease_ttl_s}
        return {
            "t": self.T,
            "job_id": self.job_id,
            "lease_ttl_s": self.lease_ttl_s,
            "num_slots": self.num_slots,
            "replicas": self.replicas,
            "env": dict(self.env),
            "store": self.store,
            "reconnect_s": self.reconnect_s,
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> NodeWelcomeMsg:
        return cls(
            job_id=str(need(m, "job_id")),
            lease_ttl_s=as_num(m, "lease_ttl_s"),
            resumed=opt_bool(m, "resumed"),
            num_slots=as_int(m, "num_slots", 2),
            replicas=as_int(m, "replicas", 0),
            env=_str_map(m, "env") or {},
            store=opt_str(m, "store") or None,
            reconnect_s=as_num(m, "reconnect_s", 30.0),
        )


@dataclass(frozen=True, kw_only=True)
class NodeRefusedMsg:
    """The coordinator will not take this node (already in the job, quarantined, another
    ``--nproc-per-node``, the job ending): why."""

    T: ClassVar[str] = "refused"
    error: str | None

    def encode(self) -> Json:
        return {"t": self.T, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> NodeRefusedMsg:
        return cls(error=opt_str(m, "error"))


def decode_welcome(m: Mapping[str, Any]) -> NodeWelcomeMsg | NodeRefusedMsg:
    """The coordinator's answer to a hello: welcomed, or refused (any other kind reads as a
    refusal with the ``error`` it carries, as before)."""
    if kind_of(m) == NodeWelcomeMsg.T:
        return NodeWelcomeMsg.decode(m)
    return NodeRefusedMsg.decode(m)


# -- commands the agent's loop carries out ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LeaseOkMsg:
    """Lease renewal ``seq`` arrived (the agent measures its fencing from when it sent it). The
    coordinator echoes the renewal's ``seq`` as it came; the agent needs a number (a WireError)."""

    T: ClassVar[str] = "lease_ok"
    seq: int | None

    def encode(self) -> Json:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> LeaseOkMsg:
        return cls(seq=as_int(m, "seq"))


@dataclass(frozen=True, kw_only=True)
class SpawnMsg:
    """Start process ``spawn_id`` as a ``role`` (worker / spare); a worker plays ``rank``, with
    torchrun's ``env`` (both absent on the wire for a spare). Answered by ``spawned``."""

    T: ClassVar[str] = "spawn"
    spawn_id: int
    role: str
    rank: int | None = None
    env: Mapping[str, str] | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "spawn_id": self.spawn_id, "role": self.role}
        if self.rank is not None:
            out["rank"] = self.rank
        if self.env is not None:
            out["env"] = dict(self.env)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> SpawnMsg:
        return cls(
            spawn_id=as_int(m, "spawn_id"),
            role=str(need(m, "role")),
            rank=opt_int(m, "rank"),
            env=_str_map(m, "env"),
        )


@dataclass(frozen=True, kw_only=True)
class KillMsg:
    """Send process ``spawn_id`` signal ``sig``; ``unless_moving``: SIGKILL it only if it is
    stuck, and say what was seen either way (``judged``: agent/silence.py)."""

    T: ClassVar[str] = "kill"
    spawn_id: int
    sig: int = int(signal.SIGKILL)
    unless_moving: bool = False

    def encode(self) -> Json:
        out: Json = {"t": self.T, "spawn_id": self.spawn_id, "sig": self.sig}
        if self.unless_moving:
            out["unless_moving"] = True
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> KillMsg:
        return cls(
            spawn_id=as_int(m, "spawn_id"),
            sig=as_int(m, "sig", int(signal.SIGKILL)),
            unless_moving=opt_bool(m, "unless_moving"),
        )


@dataclass(frozen=True, kw_only=True)
class ReleaseMsg:
    """The node is drained (a preemption): stop every process, exit 0."""

    T: ClassVar[str] = "release"

    def encode(self) -> Json:
        return {"t": self.T}


@dataclass(frozen=True, kw_only=True)
class NodeFinishMsg:
    """The job ended (``failed``: as failed): wait for the processes, exit 0 (or 1)."""

    T: ClassVar[str] = "finish"
    failed: bool

    def encode(self) -> Json:
        return {"t": self.T, "failed": self.failed}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> NodeFinishMsg:
        return cls(failed=opt_bool(m, "failed"))


@dataclass(frozen=True, kw_only=True)
class FencedMsg:
    """The coordinator quarantined this node: stop playing any rank (``error``: why)."""

    T: ClassVar[str] = "fenced"
    error: str

    def encode(self) -> Json:
        return {"t": self.T, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FencedMsg:
        return cls(error=str(m.get("error", "fenced by the coordinator")))


# -- data-path commands (agent/data_path.py) ----------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class InventoryRequestMsg:
    """Say what the node's memory holds: answered by ``inventory``."""

    T: ClassVar[str] = "inventory"
    id: int = UNSET

    def with_id(self, req: int) -> InventoryRequestMsg:
        return dataclasses.replace(self, id=req)

    def encode(self) -> Json:
        return {"t": self.T, "id": self.id}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> InventoryRequestMsg:
        return cls(id=as_int(m, "id"))


@dataclass(frozen=True, kw_only=True)
class ReplicateMsg:
    """Send step ``step`` of each of ``ranks`` (the node's own) to the data-plane addresses of
    its holders; each rank answered by a ``replicated``. Ranks as text on the wire."""

    T: ClassVar[str] = "replicate"
    step: int
    ranks: Mapping[int, tuple[str, ...]]

    def encode(self) -> Json:
        return {"t": self.T, "step": self.step, "ranks": {str(r): list(a) for r, a in self.ranks.items()}}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ReplicateMsg:
        ranks = need(m, "ranks")
        if not isinstance(ranks, Mapping):
            raise WireError(f"'replicate' message: ranks must be an object, not {ranks!r}")
        try:
            holders = {int(r): tuple(str(a) for a in addrs) for r, addrs in ranks.items()}
        except (TypeError, ValueError) as e:
            raise WireError(f"'replicate' message: ranks must map ranks to addresses ({e})") from None
        return cls(step=as_int(m, "step"), ranks=holders)


@dataclass(frozen=True, kw_only=True)
class FetchRequestMsg:
    """Copy ``rank``'s ``kind`` (local / replica) snapshot of ``step`` from the node whose data
    plane is at ``addr`` (this node's own: between its stores) into its slots of ``as_rank``
    (None: ``rank``) -- ``into`` its ``local`` slots or its ``replica`` ones (to reshard).
    ``track`` / ``base``: a catch-up (keep what came as the base of the next; the step of the
    kept base a delta may be against). Answered by ``fetched``; only what differs from the
    defaults is on the wire."""

    T: ClassVar[str] = "fetch"
    rank: int
    step: int
    addr: str
    kind: str
    as_rank: int | None = None
    base: int | None = None
    track: bool = False
    into: str = "local"
    id: int = UNSET

    @property
    def dest(self) -> int:
        """The rank whose slots the snapshot goes into."""
        return self.rank if self.as_rank is None else self.as_rank

    def with_id(self, req: int) -> FetchRequestMsg:
        return dataclasses.replace(self, id=req)

    def encode(self) -> Json:
        out: Json = {"t": self.T, "rank": self.rank, "step": self.step, "addr": self.addr, "kind": self.kind}
        if self.as_rank is not None:
            out["as_rank"] = self.as_rank
        if self.base is not None:
            out["base"] = self.base
        if self.track:
            out["track"] = True
        if self.into != "local":
            out["into"] = self.into
        out["id"] = self.id
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FetchRequestMsg:
        return cls(
            rank=as_int(m, "rank"),
            step=as_int(m, "step"),
            addr=str(need(m, "addr")),
            kind=str(need(m, "kind")),
            as_rank=opt_int(m, "as_rank"),
            base=opt_int(m, "base"),
            track=opt_bool(m, "track"),
            into=str(m.get("into", "local")),
            id=as_int(m, "id"),
        )


@dataclass(frozen=True, kw_only=True)
class InstallDurableMsg:
    """Load step ``step`` of ``ranks`` from the durable tier at ``url`` into the node's memory;
    ``sources``: rank -> the checkpoint's rank it restores (a resize; ``from`` on the wire, absent
    when empty). Answered by ``installed``."""

    T: ClassVar[str] = "install_durable"
    url: str
    step: int
    ranks: tuple[int, ...]
    sources: Mapping[int, int] = field(default_factory=dict)
    id: int = UNSET

    def with_id(self, req: int) -> InstallDurableMsg:
        return dataclasses.replace(self, id=req)

    def encode(self) -> Json:
        out: Json = {"t": self.T, "url": self.url, "step": self.step, "ranks": list(self.ranks)}
        if self.sources:
            out["from"] = {str(r): s for r, s in self.sources.items()}
        out["id"] = self.id
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> InstallDurableMsg:
        sources = m.get("from", {})
        try:
            from_ = {int(k): int(v) for k, v in dict(sources).items()}
        except (TypeError, ValueError) as e:
            raise WireError(f"'install_durable' message: from must map ranks to ranks ({e})") from None
        return cls(
            url=str(need(m, "url")),
            step=as_int(m, "step"),
            ranks=_ints(m, "ranks"),
            sources=from_,
            id=as_int(m, "id"),
        )


@dataclass(frozen=True, kw_only=True)
class CommittedMsg:
    """The committed step (None: none yet): hold it in memory, release older holds."""

    T: ClassVar[str] = "committed"
    step: int | None

    def encode(self) -> Json:
        return {"t": self.T, "step": self.step}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> CommittedMsg:
        return cls(step=opt_int(m, "step"))


@dataclass(frozen=True, kw_only=True)
class ForgetMsg:
    """Drop what the replicator keeps of ``rank`` (its delta bases)."""

    T: ClassVar[str] = "forget"
    rank: int

    def encode(self) -> Json:
        return {"t": self.T, "rank": self.rank}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ForgetMsg:
        return cls(rank=as_int(m, "rank"))


@dataclass(frozen=True, kw_only=True)
class PersistRanksMsg:
    """Round ``id`` of a persist (:mod:`nonstop.coordinator.persistence`): write step ``step`` of
    ``ranks`` into the checkpoint of ``world_size`` ranks at ``url``, with the codec's ``lossy``
    and ``lossy_bits``. Answered by ``persisted``."""

    T: ClassVar[str] = "persist"
    id: int
    step: int
    url: str
    world_size: int
    ranks: tuple[int, ...]
    lossy: bool = False
    lossy_bits: int = 8

    def encode(self) -> Json:
        return {
            "t": self.T,
            "id": self.id,
            "step": self.step,
            "url": self.url,
            "world_size": self.world_size,
            "ranks": list(self.ranks),
            "lossy": self.lossy,
            "lossy_bits": self.lossy_bits,
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> PersistRanksMsg:
        return cls(
            id=as_int(m, "id"),
            step=as_int(m, "step"),
            url=str(need(m, "url")),
            world_size=as_int(m, "world_size"),
            ranks=_ints(m, "ranks"),
            lossy=opt_bool(m, "lossy"),
            lossy_bits=as_int(m, "lossy_bits", 8),
        )


AgentRequestMsg = InventoryRequestMsg | FetchRequestMsg | InstallDurableMsg
"""The commands answered by a request id."""

AgentCommand = (
    LeaseOkMsg
    | SpawnMsg
    | KillMsg
    | ReleaseMsg
    | NodeFinishMsg
    | FencedMsg
    | InventoryRequestMsg
    | ReplicateMsg
    | FetchRequestMsg
    | InstallDurableMsg
    | CommittedMsg
    | ForgetMsg
    | PersistRanksMsg
)

_DATA: dict[str, Callable[[Mapping[str, Any]], AgentCommand]] = {
    cls.T: cls.decode
    for cls in (
        InventoryRequestMsg,
        ReplicateMsg,
        InstallDurableMsg,
        ForgetMsg,
        CommittedMsg,
        FetchRequestMsg,
        PersistRanksMsg,
    )
}
DATA_COMMANDS = frozenset(_DATA)
"""The kinds of the data-path commands (:class:`nonstop.agent.data_path.NodeWork`)."""

_DECODERS: dict[str, Callable[[Mapping[str, Any]], AgentCommand]] = {
    **{cls.T: cls.decode for cls in (LeaseOkMsg, SpawnMsg, KillMsg, NodeFinishMsg, FencedMsg)},
    ReleaseMsg.T: lambda m: ReleaseMsg(),
    **_DATA,
}


def decode_command(m: Mapping[str, Any]) -> AgentCommand | None:
    """A coordinator's command, typed; None for a kind the agent does not know."""
    decode = _DECODERS.get(kind_of(m))
    return None if decode is None else decode(m)


def request_id(m: Mapping[str, Any]) -> int | None:
    """The id of a request as sent, None when it has none (or not an integer): what the failure
    answer to a request that could not be decoded names."""
    v = m.get("id") if isinstance(m, Mapping) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None
