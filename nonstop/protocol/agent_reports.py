"""The agent channel, agent -> coordinator (:mod:`.agent` has the whole conversation): the
hello, lease renewals, spawn and exit reports, silence verdicts, the answers to the coordinator's
requests (inventory, fetch, install, replicate, persist), preemption notices, lease
registrations, a fatal shortfall and health verdicts (:class:`~nonstop.protocol.base.HealthMsg`).

The node agent encodes each (:mod:`nonstop.agent`); the coordinator decodes them at its edge with
:func:`decode_agent`, except the hello (:meth:`AgentHelloMsg.decode`, from the channel's
handshake) and a persist round's answer, which :func:`decode_agent` passes on raw
(:class:`~nonstop.protocol.base.RawMsg`) for :mod:`nonstop.coordinator.persistence` to decode with
:meth:`RanksPersistedMsg.decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nonstop.protocol.base import (
    HealthMsg,
    Json,
    RawMsg,
    WireError,
    as_int,
    as_num,
    kind_of,
    opt_bool,
    opt_int,
    opt_num,
    opt_str,
    steps_by_rank,
)

__all__ = [
    "AgentHelloMsg",
    "AgentMessage",
    "ExitMsg",
    "FatalMsg",
    "FetchedBytes",
    "FetchedMsg",
    "InstalledMsg",
    "InventoryMsg",
    "JudgedMsg",
    "LeaseMsg",
    "LostMsg",
    "PreemptMsg",
    "RanksPersistedMsg",
    "RegisteredMsg",
    "ReplicatedMsg",
    "SpawnedMsg",
    "decode_agent",
]


@dataclass(frozen=True, kw_only=True)
class AgentHelloMsg:
    """What a node brings, in the channel handshake's hello (``role: agent``; no ``t``): its name,
    ``--nproc-per-node``, spares, failure domain, data-plane address, pid, whether it runs in the
    coordinator's process (node 0), its devices (``devices`` None: a CPU node) and their type.
    ``resume``: a reconnect (store mode) holding lease ``lease_id`` (0: none).

    The decode is lenient, as the coordinator always read a hello: a missing field is None (the
    coordinator then refuses the node or keeps what it knew), a mistyped one a WireError."""

    ROLE: ClassVar[str] = "agent"
    node: str
    nproc: int | None
    spares: int = 0
    domain: str | None = None
    data_addr: str | None = None
    pid: int | None = None
    in_process: bool = False
    devices: int | None = None
    device_type: str | None = None
    resume: bool = False
    lease_id: int | None = None

    def encode(self) -> Json:
        out: Json = {
            "role": self.ROLE,
            "node": self.node,
            "nproc": self.nproc,
            "spares": self.spares,
            "domain": self.domain,
            "data_addr": self.data_addr,
            "pid": self.pid,
            "in_process": self.in_process,
            "devices": self.devices,
            "device_type": self.device_type,
        }
        if self.resume:
            out.update(resume=True, lease_id=self.lease_id)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> AgentHelloMsg:
        return cls(
            node=opt_str(m, "node") or "",
            nproc=opt_int(m, "nproc"),
            spares=as_int(m, "spares", 0),
            domain=opt_str(m, "domain"),
            data_addr=opt_str(m, "data_addr"),
            pid=opt_int(m, "pid"),
            in_process=opt_bool(m, "in_process"),
            devices=opt_int(m, "devices"),
            device_type=opt_str(m, "device_type"),
            resume=m.get("resume") is not None,
            lease_id=opt_int(m, "lease_id"),
        )


@dataclass(frozen=True, kw_only=True)
class LeaseMsg:
    """A lease renewal (every TTL / 5), answered by :class:`~.agent_commands.LeaseOkMsg`."""

    T: ClassVar[str] = "lease"
    seq: int | None

    def encode(self) -> Json:
        return {"t": self.T, "seq": self.seq}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> LeaseMsg:
        return cls(seq=opt_int(m, "seq"))


@dataclass(frozen=True, kw_only=True)
class ExitMsg:
    """Process ``spawn_id`` ended with ``rc`` (``pid`` None: it never ran); ``fault_at``: when an
    injected fault killed it (faults.py), for timing the detection."""

    T: ClassVar[str] = "exit"
    spawn_id: int
    rc: int
    pid: int | None
    fault_at: float | None

    def encode(self) -> Json:
        return {
            "t": self.T,
            "spawn_id": self.spawn_id,
            "rc": self.rc,
            "pid": self.pid,
            "fault_at": self.fault_at,
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ExitMsg:
        return cls(
            spawn_id=as_int(m, "spawn_id"),
            rc=as_int(m, "rc"),
            pid=opt_int(m, "pid"),
            fault_at=opt_num(m, "fault_at"),
        )


@dataclass(frozen=True, kw_only=True)
class JudgedMsg:
    """The agent's verdict on a worker the coordinator found silent (``agent/silence.py``):
    ``hung`` (it kills it now) or not (it moves: starved, left alive); ``detail``: what it saw."""

    T: ClassVar[str] = "judged"
    spawn_id: int
    hung: bool
    detail: str

    def encode(self) -> Json:
        return {"t": self.T, "spawn_id": self.spawn_id, "hung": self.hung, "detail": self.detail}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> JudgedMsg:
        hung = bool(m.get("hung", True))  # (a verdict without its word kills, as before)
        return cls(spawn_id=as_int(m, "spawn_id"), hung=hung, detail=str(m.get("detail", "")))


@dataclass(frozen=True, kw_only=True)
class SpawnedMsg:
    """A spawn carried out (``device``: the node-local device index it holds, None on a CPU
    node), or refused (``error``, no ``device`` on the wire; its ``exit`` follows)."""

    T: ClassVar[str] = "spawned"
    spawn_id: int
    pid: int | None
    device: int | None = None
    error: str | None = None

    def encode(self) -> Json:
        if self.error is not None:
            return {"t": self.T, "spawn_id": self.spawn_id, "pid": self.pid, "error": self.error}
        return {"t": self.T, "spawn_id": self.spawn_id, "pid": self.pid, "device": self.device}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> SpawnedMsg:
        return cls(
            spawn_id=as_int(m, "spawn_id"),
            pid=opt_int(m, "pid"),
            device=opt_int(m, "device"),
            error=opt_str(m, "error"),
        )


@dataclass(frozen=True, kw_only=True)
class InventoryMsg:
    """What a node's memory holds: rank -> complete steps, of its own ranks and its replicas
    (ranks as text on the wire, in the order given)."""

    T: ClassVar[str] = "inventory"
    id: int
    local: Mapping[int, tuple[int, ...]]
    replicas: Mapping[int, tuple[int, ...]]

    def encode(self) -> Json:
        return {
            "t": self.T,
            "id": self.id,
            "local": {str(r): list(s) for r, s in self.local.items()},
            "replicas": {str(r): list(s) for r, s in self.replicas.items()},
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> InventoryMsg:
        return cls(id=as_int(m, "id"), local=steps_by_rank(m, "local"), replicas=steps_by_rank(m, "replicas"))


@dataclass(frozen=True, kw_only=True)
class InstalledMsg:
    """A durable install into a node's memory ended: ``ok`` (with the ``seconds`` it took) or
    not (``error``)."""

    T: ClassVar[str] = "installed"
    id: int
    ok: bool
    error: str | None = None
    seconds: float | None = None

    def encode(self) -> Json:
        if self.ok:
            return {"t": self.T, "id": self.id, "ok": True, "seconds": self.seconds}
        return {"t": self.T, "id": self.id, "ok": False, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> InstalledMsg:
        return cls(
            id=as_int(m, "id"), ok=bool(m.get("ok")), error=opt_str(m, "error"), seconds=opt_num(m, "seconds")
        )


@dataclass(frozen=True, kw_only=True)
class FetchedBytes:
    """What a fetch moved: the snapshot's bytes, those that crossed the network (0: a copy
    between the node's own stores), whether as a delta, and whether under the bandwidth cap
    (None: a copy between its own stores, no cap to speak of; not on the wire)."""

    raw_bytes: int
    wire_bytes: int
    delta: bool
    capped: bool | None = None


@dataclass(frozen=True, kw_only=True)
class FetchedMsg:
    """A fetch into a node's memory ended (``rank``: the rank fetched): ``ok`` with the
    ``seconds`` it took, or ``error``; ``moved``: what it moved, None when it failed before
    that (the sizes then read 0). On the wire the sizes sit flat beside the other fields."""

    T: ClassVar[str] = "fetched"
    id: int
    ok: bool
    rank: int | None = None
    error: str | None = None
    seconds: float | None = None
    moved: FetchedBytes | None = None

    @property
    def raw_bytes(self) -> int:
        return 0 if self.moved is None else self.moved.raw_bytes

    @property
    def wire_bytes(self) -> int:
        return 0 if self.moved is None else self.moved.wire_bytes

    @property
    def delta(self) -> bool:
        return self.moved is not None and self.moved.delta

    @property
    def capped(self) -> bool:
        return self.moved is not None and bool(self.moved.capped)

    def encode(self) -> Json:
        out: Json = {"t": self.T, "id": self.id, "rank": self.rank}
        if self.moved is not None:
            out.update(
                raw_bytes=self.moved.raw_bytes, wire_bytes=self.moved.wire_bytes, delta=self.moved.delta
            )
            if self.moved.capped is not None:
                out["capped"] = self.moved.capped
        if self.ok:
            out.update(ok=True, seconds=self.seconds)
        else:
            out.update(ok=False, error=self.error)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FetchedMsg:
        raw = opt_int(m, "raw_bytes")  # absent when the fetch failed before it moved anything
        moved = None
        if raw is not None:
            capped = m.get("capped")
            moved = FetchedBytes(
                raw_bytes=raw,
                wire_bytes=opt_int(m, "wire_bytes") or 0,
                delta=opt_bool(m, "delta"),
                capped=None if capped is None else bool(capped),
            )
        return cls(
            id=as_int(m, "id"),
            ok=opt_bool(m, "ok"),
            rank=opt_int(m, "rank"),
            error=opt_str(m, "error"),
            seconds=opt_num(m, "seconds"),
            moved=moved,
        )


@dataclass(frozen=True, kw_only=True)
class ReplicatedMsg:
    """One rank of a replication round sent to its holders: ``ok`` (``raw`` / ``wire`` bytes,
    the ``seconds`` it took, whether ``full`` rather than a delta) or not (``error``)."""

    T: ClassVar[str] = "replicated"
    step: int
    rank: int
    ok: bool
    error: str | None = None
    raw: int = 0
    wire: int = 0
    seconds: float | None = None
    full: bool = False

    def encode(self) -> Json:
        head: Json = {"t": self.T, "step": self.step, "rank": self.rank}
        if self.ok:
            return {
                **head,
                "ok": True,
                "raw": self.raw,
                "wire": self.wire,
                "seconds": self.seconds,
                "full": self.full,
            }
        return {**head, "ok": False, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ReplicatedMsg:
        return cls(
            step=as_int(m, "step"),
            rank=as_int(m, "rank"),
            ok=opt_bool(m, "ok"),
            error=opt_str(m, "error"),
            raw=as_int(m, "raw", 0),
            wire=as_int(m, "wire", 0),
            seconds=opt_num(m, "seconds"),
            full=opt_bool(m, "full"),
        )


@dataclass(frozen=True, kw_only=True)
class RanksPersistedMsg:
    """A node's part of a persist round (:mod:`nonstop.coordinator.persistence`) written: ``ok``
    with each rank's manifest ``records`` (checked by the checkpoint's writer on adoption), the
    ``raw`` and ``stored`` bytes, whether ``full`` (no delta) and the ``seconds`` it took; or
    not, with ``error`` (``id`` None: the command could not be read)."""

    T: ClassVar[str] = "persisted"
    id: int | None
    ok: bool
    error: str | None = None
    records: tuple[Any, ...] = ()
    raw: int = 0
    stored: int = 0
    full: bool = False
    seconds: float | None = None

    def encode(self) -> Json:
        if not self.ok:
            return {"t": self.T, "id": self.id, "ok": False, "error": self.error}
        return {
            "t": self.T,
            "id": self.id,
            "ok": True,
            "records": list(self.records),
            "raw": self.raw,
            "stored": self.stored,
            "full": self.full,
            "seconds": self.seconds,
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RanksPersistedMsg:
        records = m.get("records", [])
        if not isinstance(records, list):
            raise WireError(f"'persisted' message: records must be a list, not {records!r}")
        return cls(
            id=opt_int(m, "id"),
            ok=opt_bool(m, "ok"),
            error=opt_str(m, "error"),
            records=tuple(records),
            raw=as_int(m, "raw", 0),
            stored=as_int(m, "stored", 0),
            full=opt_bool(m, "full"),
            seconds=opt_num(m, "seconds"),
        )


@dataclass(frozen=True, kw_only=True)
class LostMsg:
    """The answer to a request whose node was lost before it answered (made by the coordinator,
    never on the wire)."""

    id: int
    error: str


@dataclass(frozen=True, kw_only=True)
class PreemptMsg:
    """A preemption notice (SIGTERM or the notice file): drain this node within ``grace_s``."""

    T: ClassVar[str] = "preempt"
    grace_s: float

    def encode(self) -> Json:
        return {"t": self.T, "grace_s": self.grace_s}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> PreemptMsg:
        return cls(grace_s=as_num(m, "grace_s", 0.0))


@dataclass(frozen=True, kw_only=True)
class RegisteredMsg:
    """Store mode: the node holds its liveness key with lease ``lease_id`` (agent/lease.py)."""

    T: ClassVar[str] = "registered"
    lease_id: int

    def encode(self) -> Json:
        return {"t": self.T, "lease_id": self.lease_id}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RegisteredMsg:
        return cls(lease_id=as_int(m, "lease_id"))


@dataclass(frozen=True, kw_only=True)
class FatalMsg:
    """The node cannot play its part (its memory tier is too small: snapshot/space.py): the job
    fails with ``error``, one line saying what to do."""

    T: ClassVar[str] = "fatal"
    error: str

    def encode(self) -> Json:
        return {"t": self.T, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FatalMsg:
        return cls(error=str(m.get("error") or "a node cannot play its part"))


AgentMessage = (
    LeaseMsg
    | ExitMsg
    | JudgedMsg
    | SpawnedMsg
    | InventoryMsg
    | InstalledMsg
    | FetchedMsg
    | ReplicatedMsg
    | PreemptMsg
    | RegisteredMsg
    | FatalMsg
    | RawMsg
    | HealthMsg  # issue 21: the agent's probe verdict (agent/probes.py)
)

_DECODERS: dict[str, Callable[[Mapping[str, Any]], AgentMessage]] = {
    cls.T: cls.decode
    for cls in (
        LeaseMsg,
        ExitMsg,
        JudgedMsg,
        SpawnedMsg,
        InventoryMsg,
        InstalledMsg,
        FetchedMsg,
        ReplicatedMsg,
        PreemptMsg,
        RegisteredMsg,
        FatalMsg,
        HealthMsg,
    )
}


def decode_agent(m: Mapping[str, Any]) -> AgentMessage | None:
    """A node agent's message, typed; None for a kind the coordinator does not know. A persist
    round's answer comes back raw (the module docstring)."""
    t = kind_of(m)
    if t == RanksPersistedMsg.T:
        return RawMsg(gen=-1, msg=m)
    decode = _DECODERS.get(t)
    return None if decode is None else decode(m)
