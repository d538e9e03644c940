"""The client channel: people's tools (``nonstop status``, ``persist``, ``migrate``, ``drain``;
:mod:`nonstop.launch.job_client`) <-> the coordinator (:mod:`nonstop.coordinator.client_requests`).

Client -> coordinator, one request a connection: :class:`StatusRequestMsg`,
:class:`PersistRequestMsg`, :class:`~nonstop.protocol.base.MigrateMsg` (``rank`` required) or
:class:`DrainMsg`; decoded by :func:`decode_client`. Coordinator -> client: the answers
:class:`StatusMsg` (to a status request), :class:`PersistedMsg` (when the durable tier holds the
step, or why not), :class:`AcceptedMsg` then one :class:`MigratedMsg` per rank moved (a migrate or
drain), and :class:`ErrorMsg` (an unknown or malformed request; the coordinator then closes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nonstop.protocol.base import Json, MigrateMsg, WireError, kind_of, need, opt_int, opt_str

__all__ = [
    "AcceptedMsg",
    "ClientAnswer",
    "ClientRequest",
    "DrainMsg",
    "ErrorMsg",
    "MigratedMsg",
    "PersistRequestMsg",
    "PersistedMsg",
    "StatusMsg",
    "StatusRequestMsg",
    "decode_client",
    "decode_client_answer",
]


# -- client -> coordinator ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StatusRequestMsg:
    """``nonstop status``: answered with one :class:`StatusMsg`."""

    T: ClassVar[str] = "status"

    def encode(self) -> Json:
        return {"t": self.T}


@dataclass(frozen=True, kw_only=True)
class PersistRequestMsg:
    """``nonstop persist``: answered with :class:`PersistedMsg` once the committed step is durable."""

    T: ClassVar[str] = "persist"

    def encode(self) -> Json:
        return {"t": self.T}


@dataclass(frozen=True, kw_only=True)
class DrainMsg:
    """``nonstop drain``: move every rank off ``node`` (answered as a migration)."""

    T: ClassVar[str] = "drain"
    node: str

    def encode(self) -> Json:
        return {"t": self.T, "node": self.node}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> DrainMsg:
        node = need(m, "node")
        if not isinstance(node, str | int) or isinstance(node, bool):
            raise WireError(f"'drain' request: node must be a name, not {node!r}")
        return cls(node=str(node))


ClientRequest = StatusRequestMsg | PersistRequestMsg | MigrateMsg | DrainMsg


def decode_client(m: Mapping[str, Any]) -> ClientRequest | None:
    """A client's request, typed; None for a kind the coordinator does not know."""
    t = kind_of(m)
    if t == "status":
        return StatusRequestMsg()
    if t == "persist":
        return PersistRequestMsg()
    if t == "migrate":
        return MigrateMsg.decode_client(m)
    if t == "drain":
        return DrainMsg.decode(m)
    return None


# -- coordinator -> client ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StatusMsg:
    """The job's status (``ClientRequests.status``: a JSON object whose keys are documented there
    and in docs/operations.md), flat beside ``t``."""

    T: ClassVar[str] = "status"
    status: Mapping[str, Any]

    def encode(self) -> Json:
        return {"t": self.T, **self.status}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> StatusMsg:
        return cls(status={k: v for k, v in m.items() if k != "t"})


@dataclass(frozen=True, kw_only=True)
class PersistedMsg:
    """A persist request's answer: ``error`` (None: it worked), and when a step is durable its
    ``step``, ``url`` and ``stored_bytes`` (absent on the wire otherwise)."""

    T: ClassVar[str] = "persisted"
    error: str | None
    step: int | None = None
    url: str | None = None
    stored_bytes: int | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "error": self.error}
        if self.step is not None:
            out.update(step=self.step, url=self.url, stored_bytes=self.stored_bytes)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> PersistedMsg:
        return cls(
            error=opt_str(m, "error"),
            step=opt_int(m, "step"),
            url=opt_str(m, "url"),
            stored_bytes=opt_int(m, "stored_bytes"),
        )


@dataclass(frozen=True, kw_only=True)
class AcceptedMsg:
    """A migrate or drain request accepted: ``ranks`` will each be answered by a :class:`MigratedMsg`."""

    T: ClassVar[str] = "accepted"
    ranks: tuple[int, ...]

    def encode(self) -> Json:
        return {"t": self.T, "ranks": list(self.ranks)}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> AcceptedMsg:
        ranks = need(m, "ranks")
        if not isinstance(ranks, list):
            raise WireError(f"'accepted' message: ranks must be a list, not {ranks!r}")
        try:
            return cls(ranks=tuple(int(r) for r in ranks))
        except (TypeError, ValueError) as e:
            raise WireError(f"'accepted' message: ranks must be integers ({e})") from None


@dataclass(frozen=True, kw_only=True)
class MigratedMsg:
    """One rank's move ended (``ok``) or was refused (``error``); ``rank`` None: the request itself
    was refused (no such node). ``info``: the swap's report (``source``, ``target``, ``boundary``,
    ``pause_ratio``, ...: policy/boundary_swap.py), flat beside the fields on the wire."""

    T: ClassVar[str] = "migrated"
    rank: int | None
    ok: bool
    error: str | None
    info: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> Json:
        head: Json = {"t": self.T} if self.rank is None else {"t": self.T, "rank": self.rank}
        return {**head, "ok": self.ok, "error": self.error, **self.info}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> MigratedMsg:
        return cls(
            rank=opt_int(m, "rank"),
            ok=bool(m.get("ok")),
            error=opt_str(m, "error"),
            info={k: v for k, v in m.items() if k not in ("t", "rank", "ok", "error")},
        )

    @property
    def source(self) -> Any:
        return self.info.get("source")

    @property
    def target(self) -> Any:
        return self.info.get("target")

    @property
    def boundary(self) -> Any:
        return self.info.get("boundary")

    @property
    def pause_ratio(self) -> float | None:
        v = self.info.get("pause_ratio")
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True, kw_only=True)
class ErrorMsg:
    """The coordinator could not take a request (unknown kind, malformed): why."""

    T: ClassVar[str] = "error"
    error: str

    def encode(self) -> Json:
        return {"t": self.T, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ErrorMsg:
        return cls(error=str(m.get("error", "")))


ClientAnswer = StatusMsg | PersistedMsg | AcceptedMsg | MigratedMsg | ErrorMsg


def decode_client_answer(m: Mapping[str, Any]) -> ClientAnswer | None:
    """The coordinator's answer, typed; None for a kind this client does not know."""
    t = kind_of(m)
    for cls in (StatusMsg, PersistedMsg, AcceptedMsg, MigratedMsg, ErrorMsg):
        if t == cls.T:
            return cls.decode(m)
    return None
