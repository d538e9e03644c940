"""The worker channel, coordinator -> worker (:mod:`.worker` has the whole conversation): the
orders a worker's link receives (:func:`decode_order`, on its reader thread) and its training
loop acts on between steps -- a generation's ``reconfigure`` and ``rebuild``, a failure's
``leave`` and ``raise``, a swap's ``pause`` / ``continue``, a new snapshot ``cadence``, the job's
``finish`` and ``abort`` -- and the ``event`` lines of a ``Session.on_event`` subscription.

The coordinator encodes each (:mod:`nonstop.coordinator`); the worker decodes each once, where
its reader takes it off the connection (:mod:`nonstop.train.link`). Rendezvous ``kv`` replies
travel on the same connection and are passed on raw (:mod:`.rendezvous` decodes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nonstop.protocol.base import (
    Json,
    RawMsg,
    WireError,
    as_int,
    kind_of,
    opt_bool,
    opt_int,
    opt_str,
)

__all__ = [
    "AbortMsg",
    "CadenceMsg",
    "ContinueMsg",
    "EventMsg",
    "FinishMsg",
    "LeaveMsg",
    "PauseMsg",
    "RaiseMsg",
    "RebuildMsg",
    "ReconfigureMsg",
    "WorkerOrder",
    "decode_order",
]


def _ints(m: Mapping[str, Any], key: str) -> tuple[int, ...] | None:
    """Field ``key``: a list of integers, or None when absent."""
    v = m.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise WireError(f"{m.get('t')!r} message: {key} must be a list of integers, not {v!r}")
    return tuple(v)


def _object(m: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    """Field ``key``: an object, or None when absent or null."""
    v = m.get(key)
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise WireError(f"{m.get('t')!r} message: {key} must be an object, not {v!r}")
    return v


# -- a generation ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ReconfigureMsg:
    """Play ``rank`` of ``world_size`` in generation ``gen``, with torchrun's ``env``
    (coordinator/torch_env.py): restore ``restore_step`` (None: a fresh start, step 0), then
    report ``restored`` and wait for ``rebuild``.

    ``recovery``: a failure's (``lost``: the failed ranks, numbered as in the generation the
    survivors leave: a survivor keeps the mesh groups none of them was in, train/settle.py).
    ``prepare``: a swap's joiner, which restores and warms up while the job trains (no member
    until the swap). The data shards it plays, the job's and the gradient mean's divisor (the
    worker assumes ``(rank,)``, ``world_size`` and ``num_shards`` when absent). ``from_rank``: the
    rank number whose slots on its node hold the restore step (absent: its own); ``fresh``: its
    slots start over after the restore; ``live``: a boundary swap, whose ranks paused after
    ``restore_step`` keep their live state; ``reshard``: what a sharded job's rank reshards from
    (train/restore.py ``read_to_reshard``: ``step``, ``world``, ``memory`` or ``url``)."""

    T: ClassVar[str] = "reconfigure"
    gen: int
    rank: int
    world_size: int
    env: Mapping[str, str] = field(default_factory=dict)
    restore_step: int | None = None
    recovery: bool = False
    lost: tuple[int, ...] | None = None
    prepare: bool = False
    shards: tuple[int, ...] | None = None
    num_shards: int | None = None
    divisor: int | None = None
    from_rank: int | None = None
    fresh: bool = False
    live: bool = False
    reshard: Mapping[str, Any] | None = None

    def encode(self) -> Json:
        out: Json = {
            "t": self.T,
            "gen": self.gen,
            "rank": self.rank,
            "world_size": self.world_size,
            "env": dict(self.env),
            "restore_step": self.restore_step,
            "recovery": self.recovery,
        }
        if self.lost is not None:
            out["lost"] = list(self.lost)
        if self.prepare:
            out["prepare"] = True
        if self.shards is not None:
            out["shards"] = list(self.shards)
        if self.num_shards is not None:
            out["num_shards"] = self.num_shards
        if self.divisor is not None:
            out["divisor"] = self.divisor
        if self.from_rank is not None:
            out["from_rank"] = self.from_rank
        if self.fresh:
            out["fresh"] = True
        if self.live:
            out["live"] = True
        if self.reshard is not None:
            out["reshard"] = dict(self.reshard)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ReconfigureMsg:
        env = _object(m, "env") or {}
        reshard = _object(m, "reshard")
        if reshard is not None:
            as_int(reshard, "step")  # (what every reshard names: the step it restores)
        return cls(
            gen=as_int(m, "gen"),
            rank=as_int(m, "rank"),
            world_size=as_int(m, "world_size"),
            env={str(k): str(v) for k, v in env.items()},
            restore_step=opt_int(m, "restore_step"),
            recovery=opt_bool(m, "recovery"),
            lost=_ints(m, "lost"),
            prepare=opt_bool(m, "prepare"),
            shards=_ints(m, "shards"),
            num_shards=opt_int(m, "num_shards"),
            divisor=opt_int(m, "divisor"),
            from_rank=opt_int(m, "from_rank"),
            fresh=opt_bool(m, "fresh"),
            live=opt_bool(m, "live"),
            reshard=reshard,
        )


@dataclass(frozen=True, kw_only=True)
class RebuildMsg:
    """Every rank of generation ``gen`` has restored: join its process group, report ``ready``."""

    T: ClassVar[str] = "rebuild"
    gen: int

    def encode(self) -> Json:
        return {"t": self.T, "gen": self.gen}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RebuildMsg:
        return cls(gen=as_int(m, "gen"))


# -- a failure -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LeaveMsg:
    """The coordinator plans generation ``gen`` after the failure of ``lost`` (numbered as in the
    generation the survivors leave): leave the step now and report what was rescued
    (train/rescue.py). A worker that cannot read one ignores it (as before)."""

    T: ClassVar[str] = "leave"
    gen: int
    recovery: bool = True
    lost: tuple[int, ...] | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "gen": self.gen, "recovery": self.recovery}
        if self.lost is not None:
            out["lost"] = list(self.lost)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> LeaveMsg:
        return cls(gen=as_int(m, "gen"), recovery=opt_bool(m, "recovery"), lost=_ints(m, "lost"))


@dataclass(frozen=True, kw_only=True)
class RaiseMsg:
    """The answer to a fault no recovery can fix: re-raise it (the worker exits)."""

    T: ClassVar[str] = "raise"

    def encode(self) -> Json:
        return {"t": self.T}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RaiseMsg:
        return cls()


# -- a live swap -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PauseMsg:
    """Stop after step ``at`` (its snapshot complete) and wait for the swap."""

    T: ClassVar[str] = "pause"
    at: int

    def encode(self) -> Json:
        return {"t": self.T, "at": self.at}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> PauseMsg:
        return cls(at=as_int(m, "at"))


@dataclass(frozen=True, kw_only=True)
class ContinueMsg:
    """The swap was given up (or a restarted coordinator found it aborted): train on."""

    T: ClassVar[str] = "continue"

    def encode(self) -> Json:
        return {"t": self.T}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ContinueMsg:
        return cls()


@dataclass(frozen=True, kw_only=True)
class CadenceMsg:
    """Snapshot every ``every``-th step from step ``since`` on (``--snapshot-budget``:
    policy/cadence.py). Also the form of the interval a reconnecting worker's resume point says
    (:class:`~nonstop.protocol.worker.ResumeMsg`, without ``t``)."""

    T: ClassVar[str] = "cadence"
    every: int
    since: int

    def encode(self) -> Json:
        return {"t": self.T, "every": self.every, "since": self.since}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> CadenceMsg:
        return cls(every=as_int(m, "every"), since=as_int(m, "since"))


# -- the job's end ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FinishMsg:
    """The job finished (every rank done): the loop returns its result; a spare exits 0."""

    T: ClassVar[str] = "finish"

    def encode(self) -> Json:
        return {"t": self.T}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FinishMsg:
        return cls()


@dataclass(frozen=True, kw_only=True)
class AbortMsg:
    """The job failed with ``error`` (its line; None: the worker says its own default)."""

    T: ClassVar[str] = "abort"
    error: str | None

    def encode(self) -> Json:
        return {"t": self.T, "error": self.error}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> AbortMsg:
        return cls(error=opt_str(m, "error"))


# -- Session.on_event ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EventMsg:
    """One of the job's events, as its line in ``events.jsonl`` (``nonstop.events.decode`` reads
    it). A worker that cannot read one drops it (as before)."""

    T: ClassVar[str] = "event"
    event: Mapping[str, Any]

    def encode(self) -> Json:
        return {"t": self.T, "event": dict(self.event)}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> EventMsg:
        line = m.get("event")
        if not isinstance(line, dict):
            raise WireError(f"'event' message: event must be an object, not {line!r}")
        return cls(event=line)


WorkerOrder = (
    ReconfigureMsg
    | RebuildMsg
    | LeaveMsg
    | RaiseMsg
    | PauseMsg
    | ContinueMsg
    | CadenceMsg
    | FinishMsg
    | AbortMsg
    | EventMsg
    | RawMsg
)

_ORDERS: dict[str, Any] = {
    c.T: c
    for c in (
        ReconfigureMsg,
        RebuildMsg,
        LeaveMsg,
        RaiseMsg,
        PauseMsg,
        ContinueMsg,
        CadenceMsg,
        FinishMsg,
        AbortMsg,
        EventMsg,
    )
}


def decode_order(m: Mapping[str, Any]) -> WorkerOrder | None:
    """What the coordinator sent a worker, typed: a rendezvous ``kv`` reply as a
    :class:`~nonstop.protocol.base.RawMsg` (its store decodes it); None for a kind the worker
    does not know (ignored, as before). A malformed one raises
    :class:`~nonstop.protocol.base.WireError`."""
    t = kind_of(m)
    if t == "kv":
        return RawMsg(gen=-1, msg=m)
    cls = _ORDERS.get(t) if isinstance(t, str) else None
    if cls is None:
        return None
    out: WorkerOrder = cls.decode(m)
    return out
