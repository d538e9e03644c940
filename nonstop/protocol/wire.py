"""Typed messages to the coordinator, decoded at the edge.

Peers send JSON objects (``t`` names the kind) over authenticated channels. The coordinator
decodes each one here, once, into a frozen dataclass; its logic reads typed fields, never
``msg["..."]``. A message that lacks a field or has one of the wrong type raises
:class:`WireError` (a ``ValueError``): the coordinator fails that sender only (a worker's rank is
recovered, an agent's node lost, a client answered with an error) and goes on.

Unknown kinds decode to ``None`` (a newer peer's message the coordinator ignores). Rendezvous
``kv`` requests and persist-round answers keep their own validation (:mod:`nonstop.control.rdzv`,
:mod:`nonstop.coordinator.persistence`) and pass through as :class:`Raw`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nonstop.policy.rescue import Report
from nonstop.reshardplan import TensorLayout, decode_layouts

__all__ = [
    "AgentMessage",
    "ClientRequest",
    "Done",
    "Drain",
    "Exit",
    "Fault",
    "Fatal",
    "Fetched",
    "Heartbeat",
    "Injected",
    "Installed",
    "Inventory",
    "Judged",
    "Lease",
    "Lost",
    "Migrate",
    "Paused",
    "PersistRequest",
    "Preempt",
    "Raw",
    "Ready",
    "Registered",
    "Replicated",
    "Restored",
    "Spawned",
    "StatusRequest",
    "Step",
    "Subscribe",
    "WireError",
    "WorkerMessage",
    "decode_agent",
    "decode_client",
    "decode_worker",
]


class WireError(ValueError):
    """A message that breaks the protocol (a missing or mistyped field)."""


# -- field readers ------------------------------------------------------------------------------
def _get(m: Mapping[str, Any], key: str) -> Any:
    if key not in m:
        raise WireError(f"{m.get('t')!r} message without {key!r}")
    return m[key]


def _int(m: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = m.get(key, default) if default is not None else _get(m, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(f"{m.get('t')!r} message: {key} must be an integer, not {v!r}")
    return v


def _opt_int(m: Mapping[str, Any], key: str) -> int | None:
    v = m.get(key)
    return None if v is None else _int(m, key)


def _num(m: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = m.get(key, default) if default is not None else _get(m, key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise WireError(f"{m.get('t')!r} message: {key} must be a number, not {v!r}")
    return float(v)


def _opt_num(m: Mapping[str, Any], key: str) -> float | None:
    v = m.get(key)
    return None if v is None else _num(m, key)


AT_MAX = 200  # characters of a heartbeat's "at" kept


def _opt_str(m: Mapping[str, Any], key: str) -> str | None:
    v = m.get(key)
    return None if v is None else str(v)


def _steps_by_rank(m: Mapping[str, Any], key: str) -> dict[int, tuple[int, ...]]:
    v = m.get(key, {})
    if not isinstance(v, dict):
        raise WireError(f"{m.get('t')!r} message: {key} must be an object")
    try:
        return {int(r): tuple(int(s) for s in steps) for r, steps in v.items()}
    except (TypeError, ValueError) as e:
        raise WireError(f"{m.get('t')!r} message: {key} must map ranks to step lists ({e})") from None


# -- worker -> coordinator ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    coll: bool  # a gradient allreduce is pending on this rank
    # seconds the rank has been out of any collective without completing a step, by its own
    # clock: since the later of its last step (or entering training) and the last moment it was
    # seen in a collective. A rank is judged stuck in its own code only on its own word that it
    # has been so for that long (None: an older worker that does not say)
    idle_s: float | None = None
    # its training thread used the CPU since the previous heartbeat: slow, not stuck -- the
    # detector gives such a rank longer (policy/decisions.py)
    moving: bool = False
    at: str | None = None  # where its training thread is, while out of a collective (diagnosis)


@dataclass(frozen=True, kw_only=True)
class Injected:
    """A fault injected on this process fired (for timing the detection)."""

    ts: float
    rank: int | None
    step: int | None
    kind: str | None


@dataclass(frozen=True, kw_only=True)
class Restored:
    gen: int


@dataclass(frozen=True, kw_only=True)
class Ready:
    gen: int
    rebuild_s: float = 0.0
    groups: tuple[int, int, float] | None = None  # a sharded job's mesh groups: kept, built, seconds
    layouts: tuple[TensorLayout, ...] | None = None  # a sharded job's rank 0: its DTensors' layouts


@dataclass(frozen=True, kw_only=True)
class Step:
    gen: int
    step: int
    step_s: float
    snap_s: float = 0.0  # the loop's stall on this step's snapshot (train/session.py)
    nbytes: int = 0  # the snapshot's bytes
    wait_s: float = 0.0  # of step_s, waiting in the gradient allreduce (issue 21: fail-slow)
    of: int | None = None  # the run's number of steps, when the worker says (issue 21)
    # False: --snapshot-every skipped this step's snapshot; it is progress, not a committed step
    snapped: bool = True
    again: bool = False  # a step reported before, now snapshotted after all (a late swap boundary)
    # --snapshot-budget, once a generation (policy/cadence.py): the digest of what the rank holds
    # outside the replicated tensors after this step; alike ranks may stand in for each other
    rest: str | None = None


@dataclass(frozen=True, kw_only=True)
class Done:
    gen: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Paused:
    gen: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Fault:
    gen: int
    error: str
    usage: bool = False  # the script's mistake (a UsageError): the job fails, exit 2
    # --snapshot-every K > 1: the step after which the survivor wrote a rescue snapshot
    # (train/rescue.py; None: it could not), and its head's digest; absent when K = 1
    rescue: Report | None = None


@dataclass(frozen=True, kw_only=True)
class Migrate:
    """Move ``rank`` (a worker's own request: its rank; a client's: any) to node ``to`` (None:
    the policy picks). ``gen`` is -1 from a client."""

    gen: int
    rank: int | None
    to: str | None


@dataclass(frozen=True, kw_only=True)
class Raw:
    """A message with its own validation downstream (rendezvous ``kv``, ``persisted``)."""

    gen: int
    msg: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class HealthReport:
    """A health verdict on the sender's node (issue 21): healthy / degraded / failing, from
    ``probe`` (a ``degrade`` fault sends one), with what it saw."""

    verdict: str
    probe: str | None = None
    detail: str | None = None


@dataclass(frozen=True, kw_only=True)
class Subscribe:
    """Send this process the job's events of ``kinds`` (None: all): ``Session.on_event``."""

    kinds: tuple[str, ...] | None


WorkerMessage = (
    Heartbeat
    | Injected
    | Restored
    | Ready
    | Step
    | Done
    | Paused
    | Fault
    | Migrate
    | Raw
    | Subscribe
    | HealthReport
)


def _health(m: Mapping[str, Any]) -> HealthReport:
    """A ``health`` message, from a worker (the ``degrade`` fault) or a node agent (its probes)."""
    verdict = m.get("verdict")
    if verdict not in ("healthy", "degraded", "failing"):
        raise WireError(f"'health' message: verdict must be healthy, degraded or failing, not {verdict!r}")
    return HealthReport(verdict=verdict, probe=_opt_str(m, "probe"), detail=_opt_str(m, "detail"))


def decode_worker(m: Mapping[str, Any]) -> WorkerMessage | None:
    """A worker's message, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    gen = _int(m, "gen", -1)
    if t == "hb":
        at = _opt_str(m, "at")
        return Heartbeat(
            coll=bool(m.get("coll")),
            idle_s=_opt_num(m, "idle"),
            moving=m.get("moving") is True,
            at=None if at is None else at[:AT_MAX],
        )
    if t == "health":
        return _health(m)
    if t == "injected":
        return Injected(
            ts=_num(m, "ts"), rank=_opt_int(m, "rank"), step=_opt_int(m, "step"), kind=_opt_str(m, "kind")
        )
    if t == "restored":
        return Restored(gen=gen)
    if t == "ready":
        groups = m.get("groups")
        return Ready(
            gen=gen,
            rebuild_s=_num(m, "rebuild_s", 0.0),
            groups=(int(groups[0]), int(groups[1]), float(groups[2]))
            if isinstance(groups, list) and len(groups) == 3
            else None,
            layouts=decode_layouts(m["layouts"]) if "layouts" in m else None,
        )
    if t == "step":
        return Step(
            gen=gen,
            step=_int(m, "step"),
            step_s=_num(m, "step_s"),
            snap_s=_num(m, "snap_s", 0.0),
            nbytes=_int(m, "bytes", 0),
            wait_s=_num(m, "wait_s", 0.0),
            of=_opt_int(m, "of"),
            snapped=m.get("snapped") is not False,
            again=m.get("again") is True,
            rest=(_opt_str(m, "rest") or "")[:64] or None,
        )
    if t == "done":
        return Done(gen=gen, step=_int(m, "step"))
    if t == "paused":
        return Paused(gen=gen, step=_int(m, "step"))
    if t == "fault":
        rest = _opt_str(m, "rest")
        rescue = (_opt_int(m, "rescued"), rest[:64] if rest else None) if "rescued" in m else None
        return Fault(gen=gen, error=str(m.get("error", "")), usage=m.get("usage") is True, rescue=rescue)
    if t == "migrate":
        return Migrate(gen=gen, rank=_opt_int(m, "rank"), to=_opt_str(m, "to"))
    if t == "kv":
        return Raw(gen=gen, msg=m)
    if t == "subscribe":
        kinds = m.get("kinds")
        if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
            raise WireError(
                f"'subscribe' message: kinds must be a list of event kinds or null, not {kinds!r}"
            )
        return Subscribe(kinds=None if kinds is None else tuple(kinds))
    return None


# -- agent -> coordinator -----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Lease:
    seq: int | None


@dataclass(frozen=True, kw_only=True)
class Exit:
    spawn_id: int
    rc: int
    pid: int | None
    fault_at: float | None


@dataclass(frozen=True, kw_only=True)
class Judged:
    """The agent's verdict on a worker the coordinator found silent (``agent/silence.py``):
    ``hung`` (it kills it now) or not (it moves: starved, left alive); ``detail``: what it saw."""

    spawn_id: int
    hung: bool
    detail: str


@dataclass(frozen=True, kw_only=True)
class Spawned:
    """A spawn carried out (``device``: the node-local device index it holds, None on a CPU
    node), or refused (``error``; its ``exit`` follows)."""

    spawn_id: int
    pid: int | None
    device: int | None = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Inventory:
    """What a node's memory holds: rank -> complete steps, of its own ranks and its replicas."""

    id: int
    local: Mapping[int, tuple[int, ...]]
    replicas: Mapping[int, tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class Installed:
    id: int
    ok: bool
    error: str | None


@dataclass(frozen=True, kw_only=True)
class Fetched:
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
class Replicated:
    step: int
    rank: int
    ok: bool
    error: str | None
    raw: int
    wire: int


@dataclass(frozen=True, kw_only=True)
class Lost:
    """The answer to a request whose node was lost before it answered (made by the coordinator)."""

    id: int
    error: str


@dataclass(frozen=True, kw_only=True)
class Preempt:
    grace_s: float


@dataclass(frozen=True, kw_only=True)
class Registered:
    lease_id: int


@dataclass(frozen=True, kw_only=True)
class Fatal:
    """The node cannot play its part (its memory tier is too small: snapshot/space.py): the job
    fails with ``error``, one line saying what to do."""

    error: str


AgentMessage = (
    Lease
    | Exit
    | Judged
    | Spawned
    | Inventory
    | Installed
    | Fetched
    | Replicated
    | Preempt
    | Registered
    | Fatal
    | Raw
    | HealthReport  # issue 21: the agent's probe verdict (agent/probes.py)
)


def decode_agent(m: Mapping[str, Any]) -> AgentMessage | None:
    """A node agent's message, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    if t == "lease":
        return Lease(seq=_opt_int(m, "seq"))
    if t == "exit":
        return Exit(
            spawn_id=_int(m, "spawn_id"),
            rc=_int(m, "rc"),
            pid=_opt_int(m, "pid"),
            fault_at=_opt_num(m, "fault_at"),
        )
    if t == "judged":
        hung = bool(m.get("hung", True))  # (a verdict without its word kills, as before)
        return Judged(spawn_id=_int(m, "spawn_id"), hung=hung, detail=str(m.get("detail", "")))
    if t == "spawned":
        return Spawned(
            spawn_id=_int(m, "spawn_id"),
            pid=_opt_int(m, "pid"),
            device=_opt_int(m, "device"),
            error=_opt_str(m, "error"),
        )
    if t == "inventory":
        return Inventory(
            id=_int(m, "id"), local=_steps_by_rank(m, "local"), replicas=_steps_by_rank(m, "replicas")
        )
    if t == "installed":
        return Installed(id=_int(m, "id"), ok=bool(m.get("ok")), error=_opt_str(m, "error"))
    if t == "fetched":
        return Fetched(
            id=_int(m, "id"),
            ok=bool(m.get("ok")),
            error=_opt_str(m, "error"),
            seconds=_opt_num(m, "seconds"),
            raw_bytes=_opt_int(m, "raw_bytes") or 0,  # absent or null when the fetch failed
            wire_bytes=_opt_int(m, "wire_bytes") or 0,
            delta=bool(m.get("delta")),
            capped=bool(m.get("capped")),
        )
    if t == "replicated":
        return Replicated(
            step=_int(m, "step"),
            rank=_int(m, "rank"),
            ok=bool(m.get("ok")),
            error=_opt_str(m, "error"),
            raw=_int(m, "raw", 0),
            wire=_int(m, "wire", 0),
        )
    if t == "preempt":
        return Preempt(grace_s=_num(m, "grace_s", 0.0))
    if t == "registered":
        return Registered(lease_id=_int(m, "lease_id"))
    if t == "fatal":
        return Fatal(error=str(m.get("error") or "a node cannot play its part"))
    if t == "health":  # issue 21: a verdict change of the agent's probes (agent/probes.py)
        return _health(m)
    if t == "persisted":
        return Raw(gen=-1, msg=m)
    return None


# -- clients (nonstop status / persist / migrate / drain) --------------------------------------
@dataclass(frozen=True, kw_only=True)
class StatusRequest:
    pass


@dataclass(frozen=True, kw_only=True)
class PersistRequest:
    pass


@dataclass(frozen=True, kw_only=True)
class Drain:
    node: str


ClientRequest = StatusRequest | PersistRequest | Migrate | Drain


def decode_client(m: Mapping[str, Any]) -> ClientRequest | None:
    """A client's request, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    if t == "status":
        return StatusRequest()
    if t == "persist":
        return PersistRequest()
    if t == "migrate":
        return Migrate(gen=-1, rank=_int(m, "rank"), to=_opt_str(m, "to"))
    if t == "drain":
        node = _get(m, "node")
        if not isinstance(node, str | int) or isinstance(node, bool):
            raise WireError(f"'drain' request: node must be a name, not {node!r}")
        return Drain(node=str(node))
    return None
