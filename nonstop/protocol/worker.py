"""The worker channel: a worker process (:mod:`nonstop.train.link`, the ``Session``) <->
the coordinator (:mod:`nonstop.coordinator.workers`).

Worker -> coordinator (decoded by :func:`decode_worker` at the coordinator's edge): heartbeats,
step reports, ``ready`` / ``restored`` / ``done`` / ``paused`` / ``fault`` as its generation
moves, the ``injected`` and ``health`` notes of its faults, ``migrate`` and ``subscribe``
requests, and rendezvous ``kv`` requests (:mod:`nonstop.protocol.rendezvous`, passed on raw).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nonstop.policy.rescue import Report
from nonstop.protocol.base import (
    HealthMsg,
    MigrateMsg,
    RawMsg,
    WireError,
    as_int,
    as_num,
    opt_int,
    opt_num,
    opt_str,
)
from nonstop.reshardplan import TensorLayout, decode_layouts

AT_MAX = 200  # characters of a heartbeat's "at" kept


# -- worker -> coordinator ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HeartbeatMsg:
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
class InjectedMsg:
    """A fault injected on this process fired (for timing the detection)."""

    ts: float
    rank: int | None
    step: int | None
    kind: str | None


@dataclass(frozen=True, kw_only=True)
class RestoredMsg:
    gen: int


@dataclass(frozen=True, kw_only=True)
class ReadyMsg:
    gen: int
    rebuild_s: float = 0.0
    groups: tuple[int, int, float] | None = None  # a sharded job's mesh groups: kept, built, seconds
    layouts: tuple[TensorLayout, ...] | None = None  # a sharded job's rank 0: its DTensors' layouts


@dataclass(frozen=True, kw_only=True)
class StepMsg:
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
class DoneMsg:
    gen: int
    step: int


@dataclass(frozen=True, kw_only=True)
class PausedMsg:
    gen: int
    step: int


@dataclass(frozen=True, kw_only=True)
class FaultMsg:
    gen: int
    error: str
    usage: bool = False  # the script's mistake (a UsageError): the job fails, exit 2
    # --snapshot-every K > 1: the step after which the survivor wrote a rescue snapshot
    # (train/rescue.py; None: it could not), and its head's digest; absent when K = 1
    rescue: Report | None = None


@dataclass(frozen=True, kw_only=True)
class SubscribeMsg:
    """Send this process the job's events of ``kinds`` (None: all): ``Session.on_event``."""

    kinds: tuple[str, ...] | None


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


def decode_worker(m: Mapping[str, Any]) -> WorkerMessage | None:
    """A worker's message, typed; None for a kind the coordinator does not know."""
    t = m.get("t")
    gen = as_int(m, "gen", -1)
    if t == "hb":
        at = opt_str(m, "at")
        return HeartbeatMsg(
            coll=bool(m.get("coll")),
            idle_s=opt_num(m, "idle"),
            moving=m.get("moving") is True,
            at=None if at is None else at[:AT_MAX],
        )
    if t == "health":
        return HealthMsg.decode(m)
    if t == "injected":
        return InjectedMsg(
            ts=as_num(m, "ts"), rank=opt_int(m, "rank"), step=opt_int(m, "step"), kind=opt_str(m, "kind")
        )
    if t == "restored":
        return RestoredMsg(gen=gen)
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
        return FaultMsg(gen=gen, error=str(m.get("error", "")), usage=m.get("usage") is True, rescue=rescue)
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
