"""Fault injection: one API used by the demo, the tests and the benchmarks.

A fault spec is ``KIND:key=value,...``:

* ``kill:rank=R,step=S``            SIGKILL the worker playing rank R when it starts step S
* ``hang:rank=R,step=S``            SIGSTOP it (it stops sending heartbeats; the agent kills it)
* ``stall:rank=R,step=S``           its training loop sleeps forever while its heartbeat thread
                                    goes on (caught by the no-progress rule, not by heartbeats)
* ``spin:rank=R,step=S``            it wedges with the GIL held, burning CPU (a C call that never
                                    returns: a runaway regular expression): its heartbeat goes
                                    silent but the process moves, so its agent excuses it as
                                    starved once (``agent/silence.py``) and it is killed at the
                                    longer limit, ``JOB_STALL_FACTOR`` x the heartbeat timeout
* ``exit:rank=R,step=S,code=C``     the worker exits with status C
* ``wipe:rank=R,step=S``            like ``kill``, and rank R's snapshot memory is deleted first
                                    (a host lost with its memory: recovery needs the durable tier)
* ``node:node=I,step=S``           node I is lost: when a worker on it starts step S, its node
                                    agent and every process of the node are SIGKILLed (the node's
                                    memory, with the replicas it held, is gone with them)
* ``slow:rank=R,step=S,seconds=X``  a straggler: the rank computes X seconds longer in step S
                                    (interruptibly, in 10 ms slices, like a real step)
* ``slowdown:rank=R,step=S,factor=F``  a fail-slow rank: from step S on, every step of the process
                                    playing rank R computes F x as long (it sleeps (F-1) x its own
                                    measured compute time of the previous step at the step's start,
                                    before the gradient allreduce). Persistent, but on the process:
                                    a process that takes the rank over later (migration, recovery)
                                    is not slow
* ``degrade:node=I,step=S``         when a worker on node I starts step S, node I's health verdict
                                    becomes ``degraded`` (as a health probe would say it)
* ``migrate:rank=R,step=S[,to=I]``  not a fault: when rank R starts step S it asks the coordinator
                                    to move it live to node I (default: the policy's choice);
                                    training goes on (``nonstop migrate`` from a script)
* ``preempt:node=I,step=S,grace=G`` not a fault either: when a worker on node I starts step S, node
                                    I gets a preemption notice with G seconds of grace (its notice
                                    file, ``<job_dir>/preempt-node-I``, appears); the node drains
* any of them with ``at=recovery``  fire instead the first time rank R is asked to
  restore to a step >= S during a recovery (a failure *during* recovery)
* any of them with ``at=prepare``   fire in the joiner of a live migration of rank R when it
  restores a step >= S (a joiner dying mid-migration)

Each fault fires once per job: the first worker to reach it creates a marker
file with ``O_EXCL`` in ``<job_dir>/faults/``; a replacement that redoes step S
finds the marker and carries on.

Faults can also be posted to a running job (``nonstop chaos`` does): :func:`post_fault` appends
one to ``<job_dir>/faults/inbox.jsonl``, which every worker's injector reads again when it grows
(one ``stat`` per check); a posted fault has the index ``INBOX_BASE + n`` (its marker
``fault-<index>``) and fires once like the others.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from nonstop.errors import UsageError

__all__ = ["FaultInjector", "FaultSpec", "fired_at", "parse_fault", "post_fault", "preempt_notice_path"]

KINDS = (
    "kill", "hang", "stall", "spin", "exit", "slow", "wipe",
    "node", "migrate", "preempt", "slowdown", "degrade",
)  # fmt: skip
NODE_KINDS = ("node", "preempt", "degrade")  # faults aimed at a node, not a rank
PHASES = ("step", "recovery", "prepare")
INBOX = "inbox.jsonl"  # faults posted to a running job, one JSON object a line
INBOX_BASE = 1_000_000  # the index of the first posted fault (markers: fault-<index>)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    kind: str
    rank: int
    step: int
    code: int = 1
    seconds: float = 0.0
    at: str = "step"
    node: int = -1  # for kind "node"
    to: int = -1  # for kind "migrate": the target node (-1: the coordinator chooses)
    grace: float = 30.0  # for kind "preempt": seconds of notice
    factor: float = 1.0  # for kind "slowdown": how many times longer each step computes

    def to_text(self) -> str:
        if self.kind == "node":
            return f"node:node={self.node},step={self.step}" + (f",at={self.at}" if self.at != "step" else "")
        if self.kind == "preempt":
            return f"preempt:node={self.node},step={self.step},grace={self.grace:g}"
        if self.kind == "degrade":
            return f"degrade:node={self.node},step={self.step}"
        extra = f",code={self.code}" if self.kind == "exit" else ""
        extra += f",seconds={self.seconds:g}" if self.kind == "slow" else ""
        extra += f",factor={self.factor:g}" if self.kind == "slowdown" else ""
        extra += f",to={self.to}" if self.kind == "migrate" and self.to >= 0 else ""
        at = f",at={self.at}" if self.at != "step" else ""
        return f"{self.kind}:rank={self.rank},step={self.step}{extra}{at}"


def parse_fault(text: str) -> FaultSpec:
    """Parse a fault spec; raise UsageError with the expected syntax if it is bad."""
    usage = (
        "expected kill:rank=R,step=S | hang:rank=R,step=S | spin:rank=R,step=S | exit:rank=R,step=S,code=C "
        "| node:node=I,step=S "
        "| migrate:rank=R,step=S[,to=I] | preempt:node=I,step=S,grace=G | slowdown:rank=R,step=S,factor=F "
        "| degrade:node=I,step=S (optionally ,at=recovery)"
    )
    kind, sep, rest = text.partition(":")
    if not sep or kind not in KINDS:
        raise UsageError(f"bad fault spec {text!r}: {usage}")
    fields: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key or key in fields:
            raise UsageError(f"bad fault spec {text!r}: {usage}")
        fields[key.strip()] = value.strip()
    who = "node" if kind in NODE_KINDS else "rank"
    allowed = {who, "step", "at"} | ({"code"} if kind == "exit" else set())
    allowed |= {"seconds"} if kind == "slow" else set()
    allowed |= {"to"} if kind == "migrate" else set()
    allowed |= {"grace"} if kind == "preempt" else set()
    allowed |= {"factor"} if kind == "slowdown" else set()
    unknown = set(fields) - allowed
    required = {who, "step"} | ({"seconds"} if kind == "slow" else set())
    required |= {"factor"} if kind == "slowdown" else set()
    if unknown or not required <= set(fields):
        raise UsageError(f"bad fault spec {text!r}: {usage}")
    try:
        rank, step = int(fields.get("rank", "0")), int(fields["step"])
        node = int(fields.get("node", "-1"))
        code = int(fields.get("code", "1"))
        seconds = float(fields.get("seconds", "0"))
        to = int(fields.get("to", "-1"))
        grace = float(fields.get("grace", "30"))
        factor = float(fields.get("factor", "1"))
    except ValueError:
        raise UsageError(
            f"bad fault spec {text!r}: rank, step and code must be integers, seconds a number"
        ) from None
    at = fields.get("at", "step")
    if (
        rank < 0
        or step < 0
        or (kind in NODE_KINDS and node < 0)
        or not 1 <= factor <= 100
        or not 0 <= grace <= 3600
        or at not in PHASES
        or not 0 <= code <= 255
        or not 0 <= seconds <= 3600
    ):
        raise UsageError(
            f"bad fault spec {text!r}: rank, node, step >= 0, code in 0..255, seconds in 0..3600, "
            "at=step|recovery|prepare, factor in 1..100"
        )
    return FaultSpec(
        kind=kind,
        rank=rank,
        step=step,
        code=code,
        seconds=seconds,
        at=at,
        node=node,
        to=to,
        grace=grace,
        factor=factor,
    )


def preempt_notice_path(job_dir: Path, node: str) -> Path:
    """The file whose appearance is node ``node``'s preemption notice (content: grace seconds)."""
    return job_dir / f"preempt-node-{node}"


def fired_at(marker_dir: Path, pid: int) -> float | None:
    """When the process ``pid`` fired an injected fault (from the markers), if it did."""
    for marker in marker_dir.glob("fault-*"):
        try:
            rec = json.loads(marker.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("pid") == pid:
            return float(rec["ts"])
    return None


def post_fault(marker_dir: Path, fault: FaultSpec) -> int:
    """Post ``fault`` to the running job whose markers live in ``marker_dir``; return its index.
    One process posts (the lines are numbered by their order); each line is one ``write`` of an
    ``O_APPEND`` file, so a reader sees whole lines or a partial last one it leaves for later."""
    marker_dir.mkdir(parents=True, exist_ok=True)
    path = marker_dir / INBOX
    try:
        n = path.read_bytes().count(b"\n")
    except FileNotFoundError:
        n = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    try:
        os.write(fd, (json.dumps(asdict(fault)) + "\n").encode())
    finally:
        os.close(fd)
    return INBOX_BASE + n


def faults_to_json(faults: list[FaultSpec]) -> str:
    return json.dumps([asdict(f) for f in faults])


class FaultInjector:
    """Worker-side: fires the faults meant for this rank at the right moment."""

    def __init__(self, faults: list[FaultSpec], marker_dir: Path) -> None:
        self.faults = list(enumerate(faults))
        self.marker_dir = marker_dir
        self._inbox_read = 0  # bytes of the inbox taken in so far
        self._inbox_count = 0  # whole lines taken in so far
        self._gone: set[int] = set()  # posted faults another process fired: not tried again

    @classmethod
    def from_json(cls, raw: str, marker_dir: Path) -> FaultInjector:
        return cls([FaultSpec(**d) for d in json.loads(raw)], marker_dir)

    def _read_inbox(self) -> None:
        """Take in the faults posted since the last look (whole lines only)."""
        path = self.marker_dir / INBOX
        try:
            if path.stat().st_size <= self._inbox_read:
                return
            with path.open("rb") as f:
                f.seek(self._inbox_read)
                new = f.read()
        except OSError:
            return
        whole = new[: new.rfind(b"\n") + 1]
        self._inbox_read += len(whole)
        for line in whole.splitlines():
            index = INBOX_BASE + self._inbox_count
            self._inbox_count += 1
            try:
                self.faults.append((index, FaultSpec(**json.loads(line))))
            except (ValueError, TypeError):
                continue  # not a fault: skipped, its index stays taken

    def due(self, *, rank: int, step: int, phase: str, node: int = -1) -> tuple[int, FaultSpec] | None:
        self._read_inbox()
        for index, f in self.faults:
            whose = f.node != node if f.kind in NODE_KINDS else f.rank != rank
            if index in self._gone or f.at != phase or whose:
                continue
            # a posted fault fires at the first step >= its step (the job may be past it already)
            at_step = step == f.step or (index >= INBOX_BASE and step >= f.step)
            if (phase == "step" and at_step) or (phase != "step" and step >= f.step):
                if self._claim(index):
                    return index, f
                if index >= INBOX_BASE:
                    self._gone.add(index)
        return None

    def _claim(self, index: int) -> bool:
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / f"fault-{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return False
        os.write(fd, json.dumps({"ts": time.time(), "pid": os.getpid()}).encode())
        os.close(fd)
        return True

    @staticmethod
    def fire(
        fault: FaultSpec, *, wipe: Callable[[], None] | None = None, agent_pid: int | None = None
    ) -> None:
        """Carry the fault out on this process. Returns only after ``slow`` (or a resumed hang).
        ``wipe`` deletes this rank's snapshot memory (for ``wipe``); ``agent_pid`` is the node
        agent to kill with the node (for ``node``; its other processes die with it)."""
        if fault.kind == "wipe" and wipe is not None:
            wipe()
        if fault.kind == "node" and agent_pid is not None:
            os.kill(agent_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind in ("kill", "wipe"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "slow":
            end = time.monotonic() + fault.seconds
            while time.monotonic() < end:
                time.sleep(0.01)
        elif fault.kind == "stall":
            while True:
                time.sleep(3600)
        elif fault.kind == "spin":
            while True:  # exponential backtracking: sre holds the GIL throughout
                re.match(r"(x+x+)+y", "x" * 64)
        else:
            os._exit(fault.code)
