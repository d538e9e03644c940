"""What every channel's messages share: the decode error, the field readers, the kind registry.

A message is a JSON object whose ``t`` names its kind; each kind is one frozen dataclass (named
``...Msg``) in the module of its channel, with ``encode()`` (the dict the sender puts on the wire,
key for key as before, so the bytes did not change) and ``decode(m)`` (the receiver's typed view).
A received message that lacks a field, or has one of the wrong type, raises :class:`WireError` (a
``ValueError``); each receiver catches it where it reads its channel and fails that sender's
connection only (a worker's rank is recovered, an agent's node lost, a client answered with an
error, a data-plane peer's request refused), never the receiving process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "HealthMsg",
    "Json",
    "MigrateMsg",
    "RawMsg",
    "WireError",
    "as_int",
    "as_num",
    "kind_of",
    "need",
    "opt_bool",
    "opt_int",
    "opt_num",
    "opt_str",
    "role_of",
    "steps_by_rank",
]

Json = dict[str, Any]


class WireError(ValueError):
    """A message that breaks the protocol (a missing or mistyped field)."""


# -- field readers ------------------------------------------------------------------------------
def kind_of(m: Mapping[str, Any]) -> Any:
    """The message's kind (``t``), or None: never raises (a receiver's dispatch)."""
    return m.get("t") if isinstance(m, Mapping) else None


def role_of(hello: Mapping[str, Any]) -> Any:
    """Which kind of peer a handshake's hello says it is (``role``: client, agent, worker, spare),
    or None: never raises (the control server's first dispatch)."""
    return hello.get("role") if isinstance(hello, Mapping) else None


def need(m: Mapping[str, Any], key: str) -> Any:
    """Field ``key``, which must be present (any type)."""
    if key not in m:
        raise WireError(f"{m.get('t')!r} message without {key!r}")
    return m[key]


def as_int(m: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """Integer field ``key`` (``default`` when absent; without one it must be present)."""
    v = m.get(key, default) if default is not None else need(m, key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise WireError(f"{m.get('t')!r} message: {key} must be an integer, not {v!r}")
    return v


def opt_int(m: Mapping[str, Any], key: str) -> int | None:
    """Integer field ``key``, or None when absent or null."""
    v = m.get(key)
    return None if v is None else as_int(m, key)


def as_num(m: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """Number field ``key`` as a float (``default`` when absent; without one it must be present)."""
    v = m.get(key, default) if default is not None else need(m, key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise WireError(f"{m.get('t')!r} message: {key} must be a number, not {v!r}")
    return float(v)


def opt_num(m: Mapping[str, Any], key: str) -> float | None:
    """Number field ``key``, or None when absent or null."""
    v = m.get(key)
    return None if v is None else as_num(m, key)


def opt_str(m: Mapping[str, Any], key: str) -> str | None:
    """Field ``key`` as text (``str()`` of what came), or None when absent or null."""
    v = m.get(key)
    return None if v is None else str(v)


def opt_bool(m: Mapping[str, Any], key: str) -> bool:
    """Field ``key``'s truth (absent: False), as the receivers always read flags."""
    return bool(m.get(key))


def steps_by_rank(m: Mapping[str, Any], key: str) -> dict[int, tuple[int, ...]]:
    """Field ``key``: an object mapping ranks (as text) to step lists (absent: empty)."""
    v = m.get(key, {})
    if not isinstance(v, dict):
        raise WireError(f"{m.get('t')!r} message: {key} must be an object")
    try:
        return {int(r): tuple(int(s) for s in steps) for r, steps in v.items()}
    except (TypeError, ValueError) as e:
        raise WireError(f"{m.get('t')!r} message: {key} must map ranks to step lists ({e})") from None


# -- messages more than one channel carries ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HealthMsg:
    """A health verdict on the sender's node (issue 21), worker or agent -> coordinator:
    healthy / degraded / failing, from ``probe`` (a ``degrade`` fault sends one), with what it
    saw. A worker sends it when its ``degrade`` fault fires; an agent when its probes' verdict
    changes (agent/probe_thread.py)."""

    T: ClassVar[str] = "health"
    verdict: str
    probe: str | None = None
    detail: str | None = None

    def encode(self) -> Json:
        return {"t": self.T, "verdict": self.verdict, "probe": self.probe, "detail": self.detail}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> HealthMsg:
        verdict = m.get("verdict")
        if verdict not in ("healthy", "degraded", "failing"):
            raise WireError(
                f"'health' message: verdict must be healthy, degraded or failing, not {verdict!r}"
            )
        return cls(verdict=verdict, probe=opt_str(m, "probe"), detail=opt_str(m, "detail"))


@dataclass(frozen=True, kw_only=True)
class MigrateMsg:
    """Move ``rank`` to node ``to`` (None: the policy picks). Worker -> coordinator (its own rank,
    a ``migrate`` fault; ``gen`` its generation) or client -> coordinator (any rank; ``gen`` -1,
    not on the wire; ``rank`` required)."""

    T: ClassVar[str] = "migrate"
    gen: int
    rank: int | None
    to: str | None

    def encode(self) -> Json:
        if self.gen == -1:
            return {"t": self.T, "rank": self.rank, "to": self.to}
        return {"t": self.T, "gen": self.gen, "rank": self.rank, "to": self.to}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> MigrateMsg:
        """A worker's (``rank`` may be null)."""
        return cls(gen=as_int(m, "gen", -1), rank=opt_int(m, "rank"), to=opt_str(m, "to"))

    @classmethod
    def decode_client(cls, m: Mapping[str, Any]) -> MigrateMsg:
        """A client's: ``rank`` required, ``gen`` -1."""
        return cls(gen=-1, rank=as_int(m, "rank"), to=opt_str(m, "to"))


@dataclass(frozen=True, kw_only=True)
class RawMsg:
    """Not a kind: a message with its own validation downstream (rendezvous ``kv``, ``persisted``)."""

    gen: int
    msg: Mapping[str, Any] = field(default_factory=dict)
