"""The agent channel: a node agent (:mod:`nonstop.agent.node`) <-> the coordinator
(:mod:`nonstop.coordinator.node_agents`).

Agent -> coordinator (decoded by :func:`decode_agent` at the coordinator's edge): lease renewals,
spawn and exit reports, silence verdicts, inventories, install / fetch / replicate answers,
preemption notices, its lease registration, a fatal shortfall, health verdicts and persist-round
answers (``persisted``, passed on raw to :mod:`nonstop.coordinator.persistence`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nonstop.protocol.base import (
    HealthMsg,
    RawMsg,
    as_int,
    as_num,
    opt_int,
    opt_num,
    opt_str,
    steps_by_rank,
)


# -- agent -> coordinator -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LeaseMsg:
    seq: int | None


@dataclass(frozen=True, kw_only=True)
class ExitMsg:
    spawn_id: int
    rc: int
    pid: int | None
    fault_at: float | None


@dataclass(frozen=True, kw_only=True)
class JudgedMsg:
    """The agent's verdict on a worker the coordinator found silent (``agent/silence.py``):
    ``hung`` (it kills it now) or not (it moves: starved, left alive); ``detail``: what it saw."""

    spawn_id: int
    hung: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class SpawnedMsg:
    """A spawn carried out (``device``: the node-local device index it holds, None on a CPU
    node), or refused (``error``; its ``exit`` follows)."""

    spawn_id: int
    pid: int | None
    device: int | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class InventoryMsg:
    """What a node's memory holds: rank -> complete steps, of its own ranks and its replicas."""

    id: int
    local: Mapping[int, tuple[int, ...]]
    replicas: Mapping[int, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class InstalledMsg:
    id: int
    ok: bool
    error: str | None


@dataclass(frozen=True, kw_only=True)
class FetchedMsg:
    """A fetch into a node's memory ended; what it moved and how long it took."""

    id: int
    ok: bool
    error: str | None
    seconds: float | None
    raw_bytes: int
    wire_bytes: int
    delta: bool
    capped: bool


@dataclass(frozen=True, kw_only=True)
class ReplicatedMsg:
    step: int
    rank: int
    ok: bool
    error: str | None
    raw: int
    wire: int


@dataclass(frozen=True, kw_only=True)
class LostMsg:
    """The answer to a request whose node was lost before it answered (made by the coordinator)."""

    id: int
    error: str


@dataclass(frozen=True, kw_only=True)
class PreemptMsg:
    grace_s: float


@dataclass(frozen=True, kw_only=True)
class RegisteredMsg:
    lease_id: int


@dataclass(frozen=True, kw_only=True)
class FatalMsg:
    """The node cannot play its part (its memory tier is too small: snapshot/space.py): the job
    fails with ``error``, one line saying what to do."""

    error: str


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


def decode_agent(m: Mapping[str, Any]) -> AgentMessage | None:
    """A node agent's message, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    if t == "lease":
        return LeaseMsg(seq=opt_int(m, "seq"))
    if t == "exit":
        return ExitMsg(
            spawn_id=as_int(m, "spawn_id"),
            rc=as_int(m, "rc"),
            pid=opt_int(m, "pid"),
            fault_at=opt_num(m, "fault_at"),
        )
    if t == "judged":
        hung = bool(m.get("hung", True))  # (a verdict without its word kills, as before)
        return JudgedMsg(spawn_id=as_int(m, "spawn_id"), hung=hung, detail=str(m.get("detail", "")))
    if t == "spawned":
        return SpawnedMsg(
            spawn_id=as_int(m, "spawn_id"),
            pid=opt_int(m, "pid"),
            device=opt_int(m, "device"),
            error=opt_str(m, "error"),
        )
    if t == "inventory":
        return InventoryMsg(
            id=as_int(m, "id"), local=steps_by_rank(m, "local"), replicas=steps_by_rank(m, "replicas")
        )
    if t == "installed":
        return InstalledMsg(id=as_int(m, "id"), ok=bool(m.get("ok")), error=opt_str(m, "error"))
    if t == "fetched":
        return FetchedMsg(
            id=as_int(m, "id"),
            ok=bool(m.get("ok")),
            error=opt_str(m, "error"),
            seconds=opt_num(m, "seconds"),
            raw_bytes=opt_int(m, "raw_bytes") or 0,  # absent or null when the fetch failed
            wire_bytes=opt_int(m, "wire_bytes") or 0,
            delta=bool(m.get("delta")),
            capped=bool(m.get("capped")),
        )
    if t == "replicated":
        return ReplicatedMsg(
            step=as_int(m, "step"),
            rank=as_int(m, "rank"),
            ok=bool(m.get("ok")),
            error=opt_str(m, "error"),
            raw=as_int(m, "raw", 0),
            wire=as_int(m, "wire", 0),
        )
    if t == "preempt":
        return PreemptMsg(grace_s=as_num(m, "grace_s", 0.0))
    if t == "registered":
        return RegisteredMsg(lease_id=as_int(m, "lease_id"))
    if t == "fatal":
        return FatalMsg(error=str(m.get("error") or "a node cannot play its part"))
    if t == "health":  # issue 21: a verdict change of the agent's probes (agent/probes.py)
        return HealthMsg.decode(m)
    if t == "persisted":
        return RawMsg(gen=-1, msg=m)
    return None
