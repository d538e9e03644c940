"""The worker channel: a worker process (:mod:`nonstop.train.link`, the ``Session``) <->
the coordinator (:mod:`nonstop.coordinator.workers`).

Worker -> coordinator (decoded by :func:`decode_worker` at the coordinator's edge): heartbeats,
step reports, ``ready`` / ``restored`` / ``done`` / ``paused`` / ``fault`` as its generation
moves, the ``injected`` and ``health`` notes of its faults, ``migrate`` and ``subscribe``
requests, and rendezvous ``kv`` requests (:mod:`nonstop.protocol.rendezvous`, passed on raw).
The handshake's hello (:class:`WorkerHelloMsg`, no ``t``) says which process connects, and a
worker reconnecting to a restarted coordinator (store mode) says where it is
(:class:`ResumeMsg`).

Coordinator -> worker (:mod:`.worker_orders`, re-exported here: decoded by :func:`decode_order`
at the worker's reader thread): the orders of its generation, its swaps and the job's end, and
``event`` lines. The worker encodes every message of the first direction with ``encode()``, the
coordinator every one of the second.

A malformed worker message raises :class:`~nonstop.protocol.base.WireError` at the coordinator:
that worker's connection is closed (its rank recovered). A malformed order raises it in the
worker's training loop, where the order is taken (:class:`~nonstop.train.link.CoordinatorLink`);
a ``leave`` or an ``event`` it cannot read is ignored, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nonstop.policy.rescue import Report
from nonstop.protocol.base import (
    HealthMsg,
    Json,
    MigrateMsg,
    RawMsg,
    WireError,
    as_int,
    as_num,
    opt_bool,
    opt_int,
    opt_num,
    opt_str,
)
from nonstop.protocol.worker_orders import (
    AbortMsg,
    CadenceMsg,
    ContinueMsg,
    EventMsg,
    FinishMsg,
    LeaveMsg,
    PauseMsg,
    RaiseMsg,
    RebuildMsg,
    ReconfigureMsg,
    WorkerOrder,
    decode_order,
)
from nonstop.reshardplan import TensorLayout, decode_layouts, encode_layouts

__all__ = [
    "AbortMsg",
    "CadenceMsg",
    "ContinueMsg",
    "DoneMsg",
    "EventMsg",
    "FaultMsg",
    "FinishMsg",
    "HealthMsg",
    "HeartbeatMsg",
    "InjectedMsg",
    "LeaveMsg",
    "MigrateMsg",
    "PauseMsg",
    "PausedMsg",
    "RaiseMsg",
    "ReadyMsg",
    "RebuildMsg",
    "ReconfigureMsg",
    "RestoredMsg",
    "ResumeMsg",
    "StepMsg",
    "SubscribeMsg",
    "WorkerHelloMsg",
    "WorkerMessage",
    "WorkerOrder",
    "decode_order",
    "decode_worker",
]

AT_MAX = 200  # characters of a heartbeat's "at" kept


# -- the handshake --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ResumeMsg:
    """Where a worker reconnecting to a restarted coordinator is (its hello's ``resume``): the
    generation it plays, the steps it took, whether it is done, and the snapshot interval it
    runs (the newest it heard; the tuner takes it up). A ``cadence`` that is not a valid
    interval is ignored (None), as before."""

    gen: int = -1
    step: int = 0
    done: bool = False
    cadence: CadenceMsg | None = None

    def encode(self) -> Json:
        cadence = None if self.cadence is None else {"every": self.cadence.every, "since": self.cadence.since}
        return {"gen": self.gen, "step": self.step, "done": self.done, "cadence": cadence}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ResumeMsg:
        said = m.get("cadence")
        cadence = None
        if isinstance(said, dict):
            every, since = said.get("every"), said.get("since")
            if type(every) is int and type(since) is int and every >= 1 and since >= 0:
                cadence = CadenceMsg(every=every, since=since)
        return cls(
            gen=as_int(m, "gen", -1), step=as_int(m, "step", 0), done=opt_bool(m, "done"), cadence=cadence
        )


@dataclass(frozen=True, kw_only=True)
class WorkerHelloMsg:
    """The handshake's hello (no ``t``) of process ``spawn_id`` in ``role`` (worker / spare);
    ``resume``: a reconnect to a restarted coordinator, where it is."""

    role: str
    spawn_id: int
    pid: int | None = None
    resume: ResumeMsg | None = None

    def encode(self) -> Json:
        out: Json = {"role": self.role, "spawn_id": self.spawn_id, "pid": self.pid}
        if self.resume is not None:
            out["resume"] = self.resume.encode()
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> WorkerHelloMsg:
        """The coordinator's reading: a hello without a spawn id names none (-1, refused)."""
        resume = m.get("resume")
        if resume is not None and not isinstance(resume, dict):
            raise WireError(f"a worker's hello: resume must be an object, not {resume!r}")
        return cls(
            role=str(m.get("role")),
            spawn_id=as_int(m, "spawn_id", -1),
            pid=opt_int(m, "pid"),
            resume=None if resume is None else ResumeMsg.decode(resume),
        )


# -- worker -> coordinator ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HeartbeatMsg:
    T: ClassVar[str] = "hb"
    coll: bool  # a gradient allreduce is pending on this rank
    step: int | None = None  # the steps it took (the coordinator goes by its step reports)
    # seconds the rank has been out of any collective without completing a step, by its own
    # clock: since the later of its last step (or entering training) and the last moment it was
    # seen in a collective. A rank is judged stuck in its own code only on its own word that it
    # has been so for that long (None: an older worker that does not say)
    idle_s: float | None = None
    # its training thread used the CPU since the previous heartbeat: slow, not stuck -- the
    # detector gives such a rank longer (policy/decisions.py); None: it cannot tell (absent on
    # the wire, read as not moving)
    moving: bool | None = None
    at: str | None = None  # where its training thread is, while out of a collective (diagnosis)

    def encode(self) -> Json:
        out: Json = {"t": self.T, "coll": self.coll, "step": self.step, "idle": self.idle_s}
        if self.moving is not None:
            out["moving"] = self.moving
        if self.at is not None:
            out["at"] = self.at
        return out


@dataclass(frozen=True, kw_only=True)
class InjectedMsg:
    """A fault injected on this process fired (for timing the detection)."""

    T: ClassVar[str] = "injected"
    ts: float
    rank: int | None
    step: int | None
    kind: str | None
    index: int | None = None  # which of the job's --fail specs

    def encode(self) -> Json:
        return {
            "t": self.T,
            "index": self.index,
            "kind": self.kind,
            "rank": self.rank,
            "step": self.step,
            "ts": self.ts,
        }


@dataclass(frozen=True, kw_only=True)
class RestoredMsg:
    T: ClassVar[str] = "restored"
    gen: int
    step: int | None = None  # the step it restored
    restore_s: float | None = None  # how long that took

    def encode(self) -> Json:
        return {"t": self.T, "gen": self.gen, "step": self.step, "restore_s": self.restore_s}


@dataclass(frozen=True, kw_only=True)
class ReadyMsg:
    T: ClassVar[str] = "ready"
    gen: int
    rebuild_s: float = 0.0
    groups: tuple[int, int, float] | None = None  # a sharded job's mesh groups: kept, built, seconds
    layouts: tuple[TensorLayout, ...] | None = None  # a sharded job's rank 0: its DTensors' layouts

    def encode(self) -> Json:
        out: Json = {"t": self.T, "gen": self.gen, "rebuild_s": self.rebuild_s}
        if self.groups is not None:
            out["groups"] = list(self.groups)
        if self.layouts is not None:
            out["layouts"] = encode_layouts(self.layouts)
        return out


@dataclass(frozen=True, kw_only=True)
class StepMsg:
    """Step ``step`` completed. ``again``: only a snapshot, of a step reported before (its short
    form on the wire: ``gen``, ``step``, ``step_s`` 0 and ``again``)."""

    T: ClassVar[str] = "step"
    gen: int
    step: int
    step_s: float
    snap_s: float = 0.0  # the loop's stall on this step's snapshot (train/reports.py)
    nbytes: int = 0  # the snapshot's bytes
    wait_s: float = 0.0  # of step_s, waiting in the gradient allreduce (issue 21: fail-slow)
    of: int | None = None  # the run's number of steps, when the worker says (issue 21)
    loss: float | None = None  # the step's loss, when the script gave one (not read: a record)
    # False: --snapshot-every skipped this step's snapshot; it is progress, not a committed step
    snapped: bool = True
    again: bool = False  # a step reported before, now snapshotted after all (a late swap boundary)
    # --snapshot-budget, once a generation (policy/cadence.py): the digest of what the rank holds
    # outside the replicated tensors after this step; alike ranks may stand in for each other
    rest: str | None = None

    def encode(self) -> Json:
        if self.again:
            return {"t": self.T, "gen": self.gen, "step": self.step, "step_s": self.step_s, "again": True}
        out: Json = {
            "t": self.T,
            "gen": self.gen,
            "step": self.step,
            "step_s": self.step_s,
            "wait_s": self.wait_s,
            "snap_s": self.snap_s,
            "of": self.of,
            "bytes": self.nbytes,
            "loss": self.loss,
        }
        if not self.snapped:
            out["snapped"] = False
        if self.rest is not None:
            out["rest"] = self.rest
        return out


@dataclass(frozen=True, kw_only=True)
class DoneMsg:
    T: ClassVar[str] = "done"
    gen: int
    step: int

    def encode(self) -> Json:
        return {"t": self.T, "gen": self.gen, "step": self.step}


@dataclass(frozen=True, kw_only=True)
class PausedMsg:
    T: ClassVar[str] = "paused"
    gen: int
    step: int

    def encode(self) -> Json:
        return {"t": self.T, "gen": self.gen, "step": self.step}


@dataclass(frozen=True, kw_only=True)
class FaultMsg:
    T: ClassVar[str] = "fault"
    gen: int
    error: str
    step: int | None = None  # the steps the rank had completed
    usage: bool = False  # the script's mistake (a UsageError): the job fails, exit 2
    # --snapshot-every K > 1: the step after which the survivor wrote a rescue snapshot
    # (train/rescue.py; None: it could not), and its head's digest; absent when K = 1
    rescue: Report | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "gen": self.gen, "step": self.step, "error": self.error}
        if self.rescue is not None:
            rescued, rest = self.rescue
            out["rescued"] = rescued
            if rescued is not None:
                out["rest"] = rest
        if self.usage:
            out["usage"] = True
        return out


@dataclass(frozen=True, kw_only=True)
class SubscribeMsg:
    """Send this process the job's events of ``kinds`` (None: all): ``Session.on_event``."""

    T: ClassVar[str] = "subscribe"
    kinds: tuple[str, ...] | None

    def encode(self) -> Json:
        return {"t": self.T, "kinds": None if self.kinds is None else list(self.kinds)}


WorkerMessage = (
    HeartbeatMsg
    | InjectedMsg
    | RestoredMsg
    | ReadyMsg
    | StepMsg
    | DoneMsg
    | PausedMsg
    | FaultMsg
    | MigrateMsg
    | RawMsg
    | SubscribeMsg
    | HealthMsg
)


def _lenient_int(v: Any) -> int | None:
    """A field the coordinator only records: an integer, else None (never a protocol error)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _lenient_num(v: Any) -> float | None:
    """A field the coordinator only records: a number, else None (never a protocol error)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def decode_worker(m: Mapping[str, Any]) -> WorkerMessage | None:
    """A worker's message, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    gen = as_int(m, "gen", -1)
    if t == "hb":
        at = opt_str(m, "at")
        moving = m.get("moving")
        return HeartbeatMsg(
            coll=bool(m.get("coll")),
            step=_lenient_int(m.get("step")),
            idle_s=opt_num(m, "idle"),
            moving=None if moving is None else moving is True,
            at=None if at is None else at[:AT_MAX],
        )
    if t == "health":
        return HealthMsg.decode(m)
    if t == "injected":
        return InjectedMsg(
            ts=as_num(m, "ts"),
            rank=opt_int(m, "rank"),
            step=opt_int(m, "step"),
            kind=opt_str(m, "kind"),
            index=_lenient_int(m.get("index")),
        )
    if t == "restored":
        return RestoredMsg(
            gen=gen, step=_lenient_int(m.get("step")), restore_s=_lenient_num(m.get("restore_s"))
        )
    if t == "ready":
        groups = m.get("groups")
        return ReadyMsg(
            gen=gen,
            rebuild_s=as_num(m, "rebuild_s", 0.0),
            groups=(int(groups[0]), int(groups[1]), float(groups[2]))
            if isinstance(groups, list) and len(groups) == 3
            else None,
            layouts=decode_layouts(m["layouts"]) if "layouts" in m else None,
        )
    if t == "step":
        return StepMsg(
            gen=gen,
            step=as_int(m, "step"),
            step_s=as_num(m, "step_s"),
            snap_s=as_num(m, "snap_s", 0.0),
            nbytes=as_int(m, "bytes", 0),
            wait_s=as_num(m, "wait_s", 0.0),
            of=opt_int(m, "of"),
            loss=_lenient_num(m.get("loss")),
            snapped=m.get("snapped") is not False,
            again=m.get("again") is True,
            rest=(opt_str(m, "rest") or "")[:64] or None,
        )
    if t == "done":
        return DoneMsg(gen=gen, step=as_int(m, "step"))
    if t == "paused":
        return PausedMsg(gen=gen, step=as_int(m, "step"))
    if t == "fault":
        rest = opt_str(m, "rest")
        rescue = (opt_int(m, "rescued"), rest[:64] if rest else None) if "rescued" in m else None
        return FaultMsg(
            gen=gen,
            error=str(m.get("error", "")),
            step=_lenient_int(m.get("step")),
            usage=m.get("usage") is True,
            rescue=rescue,
        )
    if t == "migrate":
        return MigrateMsg.decode(m)
    if t == "kv":
        return RawMsg(gen=gen, msg=m)
    if t == "subscribe":
        kinds = m.get("kinds")
        if kinds is not None and not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
            raise WireError(
                f"'subscribe' message: kinds must be a list of event kinds or null, not {kinds!r}"
            )
        return SubscribeMsg(kinds=None if kinds is None else tuple(kinds))
    return None
