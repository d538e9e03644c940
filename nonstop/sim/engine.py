"""The discrete-event engine: replay failures against a strategy and book every lost GPU-second.

Timeline model. The job is either **training** or **paused** (a whole-job recovery). Failures are
drawn up front (vectorised, :mod:`nonstop.sim.failures`) and replayed in time order; the engine's
loop is over failures only, so a run costs O(nodes + failures) time and memory, whatever the
horizon. For each failure the strategy answers a :class:`~nonstop.sim.api.Recovery`:

* its ``pause`` stages stop the whole job from the failure time on; a failure inside a pause cuts
  it short — the elapsed part is booked as ``replan`` and the new recovery starts (the runtime's
  generation change);
* ``lost_work_s`` is progress rolled back (redone later), booked on every job GPU;
* ``partial`` charges GPUs idle while the others train on (a torchft replica group healing).

Between failures the job trains; the strategy reports its steady overhead (checkpoint blocking,
snapshot stall) for each training interval. What training remains at the horizon counts as
useful. ETTR = 1 - booked GPU-seconds / (job GPUs x horizon).

Elastic jobs. A strategy that is also :class:`~nonstop.sim.api.Resizing` may train below its full
size after a failure (an elastic shrink): for each training interval it reports, besides the
overhead, the throughput it gave up (stage ``shrunk``), and it schedules its own events (growing
back when a node joins), which the engine replays in time order with the failures — deferred to
the end of a pause, booked like a recovery, counted in ``SimResult.resizes`` but not as failures.
The engine measures the wall time spent shrunk and the progress made meanwhile.

Fail-slow (:mod:`nonstop.sim.failslow`). When the failures carry fail-slow events, the engine
replays them in time order too: while slow ranks are active the job progresses at ``1 / factor``
of its rate (the slowest rank's factor), the strategy trains ``dt / factor`` of progress and the
rest is booked to the cause ``fail-slow`` (stage ``fail_slow``). A slowdown ends when its
duration is over, when a failure replaces its node, or when a :class:`~nonstop.sim.api.Proactive`
strategy moved its rank away (its answer to :meth:`~nonstop.sim.api.Proactive.on_slow`; the
move's pause is booked as ``proactive_migration``; one due during a recovery waits for its end).
A failure whose node gave a degraded signal first is offered to
:meth:`~nonstop.sim.api.Proactive.on_warning`; drained in time, it reaches the strategy as a
planned event and its pause is booked as ``proactive_migration``.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Protocol, TextIO

import numpy as np

from nonstop.sim.actions import RecoveryAction
from nonstop.sim.api import (
    FAIL_SLOW,
    STEADY,
    FailureEvents,
    JobSpec,
    Proactive,
    Recovery,
    Resizing,
    RunContext,
    SimResult,
    Strategy,
)

__all__ = ["EventSource", "Progress", "simulate"]


class EventSource(Protocol):
    """Anything that draws the failures of a run (a :class:`FailureModel`, a trace replay)."""

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents: ...


class Progress:
    """A one-line progress bar on a stream (stderr), redrawn at most every ``every_s`` seconds."""

    def __init__(self, total: int, *, label: str, stream: TextIO | None = None, every_s: float = 0.2):
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self._last = 0.0
        self._start = time.perf_counter()

    @staticmethod
    def wanted(flag: bool | None) -> bool:
        """``flag`` True/False forces it; None: only when stderr is a terminal."""
        if flag is not None:
            return flag
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"

    def update(self, done: int, note: str = "", *, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        elapsed = now - self._start
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {elapsed:5.1f}s {note}".ljust(79))
        self.stream.flush()

    def close(self) -> None:
        self.update(self.total, force=True)
        self.stream.write("\n")
        self.stream.flush()


class _Ledger:
    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self.gpu_s: dict[str, dict[str, float]] = {}

    def charge(self, cause: str, stage: str, seconds: float, gpus: int) -> None:
        if seconds <= 0:
            return
        by_stage = self.gpu_s.setdefault(cause, {})
        by_stage[stage] = by_stage.get(stage, 0.0) + seconds * gpus

    def charge_sequence(
        self, cause: str, start: float, stages: Iterable[tuple[str, float]], gpus: int, *, until: float
    ) -> None:
        """Stages back to back from ``start``, clipped at ``until``."""
        t = start
        for stage, seconds in stages:
            end = min(t + seconds, until)
            self.charge(cause, stage, end - t, gpus)
            t = end
            if t >= until:
                return


class _Timeline:
    """The job's state between events: accounted up to ``t``, paused until ``pause_end``, and the
    whole-job pause in progress (``pending``: cause, start, stages), booked once it is over."""

    def __init__(self, job: JobSpec, strategy: Strategy) -> None:
        self.horizon, self.gpus = job.horizon_s, job.num_gpus
        self.strategy = strategy
        self.resizing = strategy if isinstance(strategy, Resizing) else None
        self.ledger = _Ledger(self.horizon)
        self.t = 0.0
        self.pause_end = 0.0
        self.pending: tuple[str, float, list[tuple[str, float]]] | None = None
        self.shrunk_s = 0.0  # wall seconds trained below full size
        self.shrunk_work_s = 0.0  # progress made meanwhile
        self.slow: dict[int, tuple[int, float]] = {}  # active slowdowns: id -> (node, factor)

    def train_until(self, now: float) -> None:
        """Unless the job is paused at ``now``: book the pause that ended and the training since."""
        if now < self.pause_end:
            return
        if self.pending is not None:
            self.ledger.charge_sequence(*self.pending, self.gpus, until=self.horizon)
            self.pending = None
        dt = now - max(self.t, self.pause_end)
        if dt > 0:
            self._train(dt)
            self.t = now

    def _train(self, dt: float) -> None:
        """``dt`` wall seconds of training at the slowest active rank's pace: the strategy trains
        ``dt / factor``, the rest is lost to the slow rank."""
        factor = max((f for _, f in self.slow.values()), default=1.0)
        eff = dt / factor
        self.ledger.charge(FAIL_SLOW, "fail_slow", dt - eff, self.gpus)
        if self.resizing is None:
            self.ledger.charge(STEADY, "overhead", self.strategy.advance(eff), self.gpus)
            return
        tr = self.resizing.train(eff)
        self.ledger.charge(STEADY, "overhead", tr.overhead_s, self.gpus)
        self.ledger.charge(tr.cause, "shrunk", tr.shrunk_s, self.gpus)
        if tr.shrunk:
            self.shrunk_s += eff
            self.shrunk_work_s += eff - tr.overhead_s - tr.shrunk_s

    def book(self, cause: str, now: float, rec: Recovery) -> None:
        """A recovery (or a strategy's own event) starting at ``now``."""
        gpus = self.gpus
        self.ledger.charge(cause, "lost_work", rec.lost_work_s, gpus)
        p0 = now + rec.pause_s + rec.partial_delay_s
        for c in rec.partial:
            self.ledger.charge_sequence(cause, p0, [(c.stage, c.seconds)], c.gpus, until=self.horizon)
            p0 += c.seconds
        if rec.pause:
            if self.pending is not None:  # a failure inside a recovery: the elapsed part was in vain
                self.ledger.charge(self.pending[0], "replan", now - self.pending[1], gpus)
            self.pending = (cause, now, rec.pause)
            self.pause_end = now + rec.pause_s
        self.t = now

    def fire_events(self, until: float, resizes: Counter[str]) -> None:
        """The strategy's own events due before ``until`` (each when the job is not paused)."""
        if self.resizing is None:
            return
        while (due := self.resizing.next_event()) is not None:
            at = max(due, self.pause_end)
            if at >= until:
                return
            self.train_until(at)
            cause, rec = self.resizing.on_event(now=at)
            if rec.resize is not None:
                resizes[rec.resize] += 1
            self.book(cause, at, rec)

    def finish(self) -> None:
        if self.pending is not None:
            self.ledger.charge_sequence(*self.pending, self.gpus, until=self.horizon)
            self.pending = None
        tail = self.horizon - max(self.t, self.pause_end)
        if tail > 0:
            self._train(tail)


def simulate(
    job: JobSpec,
    source: EventSource,
    strategy: Strategy,
    *,
    seed: int = 0,
    progress: bool | None = False,
) -> SimResult:
    """Run ``strategy`` through the failures ``source`` draws for ``job``.

    Deterministic for a given ``seed``: failures come from one random stream and the strategy's
    own draws from another, so two strategies run with one seed see the same failures. A
    :class:`~nonstop.sim.api.Resizing` strategy's own events (elastic grows) are replayed in time
    order with the failures.
    """
    started = time.perf_counter()
    events = source.sample(job, np.random.default_rng([seed, 1]))
    strategy.begin(RunContext(job=job, rng=np.random.default_rng([seed, 2])))
    horizon, gpus = job.horizon_s, job.num_gpus
    line = _Timeline(job, strategy)
    bar = Progress(len(events), label=f"simulate {strategy.name}") if Progress.wanted(progress) else None

    times, nodes, cause_idx, lemon = events.time, events.node, events.cause, events.lemon
    causes = events.causes
    proactive = strategy if isinstance(strategy, Proactive) else None
    slow = _SlowReplay(events, line, proactive)
    replaced: set[int] = set()  # positions whose original machine was replaced (lemon thinning)
    counts: Counter[str] = Counter()
    actions: Counter[str] = Counter()
    tiers: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    resizes: Counter[str] = Counter()

    i, n = 0, len(times)
    while True:
        t_fail = float(times[i]) if i < n else math.inf
        now = min(t_fail, slow.next_due())
        if now >= horizon:
            break
        line.fire_events(now, resizes)
        if now < t_fail:  # a slowdown starts or ends first
            slow.fire(now)
            continue
        i += 1
        node = int(nodes[i - 1])
        if lemon[i - 1] and node in replaced:
            continue
        cause = causes[int(cause_idx[i - 1])]
        recovering = now < line.pause_end
        line.train_until(now)
        lead = float(events.lead_s[i - 1]) if events.lead_s is not None else 0.0
        drained = (
            proactive is not None
            and lead > 0
            and not cause.planned
            and proactive.on_warning(now=now, node=node, cause=cause, lead_s=lead)
        )
        told = replace(cause, planned=True) if drained else cause
        rec: Recovery = strategy.on_failure(now=now, node=node, cause=told, recovering=recovering)
        if drained:  # moved live before it broke: one planned swap
            rec.pause = [("proactive_migration", rec.pause_s)]
            slow.proactive["degraded"] += 1
        counts[cause.name] += 1
        if rec.action is not None:
            actions[rec.action.value] += 1
            if rec.action in (RecoveryAction.REPLACE_NODE, RecoveryAction.QUARANTINE, RecoveryAction.MIGRATE):
                replaced.add(node)
                slow.node_replaced(node)
        if rec.tier is not None:
            tiers[rec.tier.value] += 1
        if rec.resize is not None:
            resizes[rec.resize] += 1
        sources[rec.replacement] += 1
        line.book(cause.name, now, rec)
        if bar is not None:
            bar.update(i, f"t={now / 86400:.1f}d failures={sum(counts.values())}")

    line.fire_events(horizon, resizes)
    line.finish()
    if bar is not None:
        bar.close()

    ledger = line.ledger
    lost = sum(sum(v.values()) for v in ledger.gpu_s.values())
    return SimResult(
        strategy=strategy.name,
        job=job,
        seed=seed,
        ettr=1.0 - lost / (gpus * horizon),
        lost_gpu_s=ledger.gpu_s,
        failures=sum(counts.values()),
        failures_by_cause=dict(counts),
        actions=dict(actions),
        tiers=dict(tiers),
        replacements=dict(sources),
        spare_gpus=int(getattr(strategy, "spare_gpus", 0)),
        wall_s=time.perf_counter() - started,
        params=strategy.describe(),
        shrunk_s=line.shrunk_s,
        shrunk_work_s=line.shrunk_work_s,
        resizes=dict(resizes),
        slowdowns=slow.started,
        proactive=dict(slow.proactive),
    )


class _SlowReplay:
    """The run's fail-slow events replayed against the timeline: starts in time order, and each
    active slowdown's end (its duration over, or the proactive move that ends it) from a heap."""

    def __init__(self, events: FailureEvents, line: _Timeline, proactive: Proactive | None) -> None:
        self.events = events.slow
        self.line = line
        self.strategy = proactive
        self.next = 0  # the next start
        self.ends: list[tuple[float, int]] = []  # (when, slowdown id): its end
        self.pause_s: dict[int, float] = {}  # slowdown id -> the pause of the move that ends it
        self.started = 0
        self.proactive: Counter[str] = Counter()

    def next_due(self) -> float:
        ev = self.events
        start = float(ev.time[self.next]) if ev is not None and self.next < len(ev) else math.inf
        return min(start, self.ends[0][0] if self.ends else math.inf)

    def fire(self, now: float) -> None:
        """The start or end due at ``now`` (ends first)."""
        line = self.line
        if self.ends and self.ends[0][0] <= now:
            _, sid = heapq.heappop(self.ends)
            if sid not in line.slow:
                return  # its node was replaced first
            if sid in self.pause_s and now < line.pause_end:  # a move waits for the recovery's end
                heapq.heappush(self.ends, (line.pause_end, sid))
                return
            line.train_until(now)
            del line.slow[sid]
            pause = self.pause_s.pop(sid, None)
            if pause is not None:
                line.book(FAIL_SLOW, now, Recovery(pause=[("proactive_migration", pause)]))
                self.proactive["straggler"] += 1
            return
        ev = self.events
        assert ev is not None
        sid = self.next
        self.next += 1
        node, factor, duration = int(ev.node[sid]), float(ev.factor[sid]), float(ev.duration_s[sid])
        line.train_until(now)
        line.slow[sid] = (node, factor)
        self.started += 1
        end = now + duration
        if self.strategy is not None:
            resp = self.strategy.on_slow(now=now, node=node, factor=factor, duration_s=duration)
            if resp.migrate and resp.detect_after_s is not None and resp.detect_after_s < duration:
                end = min(end, now + resp.detect_after_s + resp.prepare_s)
                self.pause_s[sid] = resp.pause_s
        heapq.heappush(self.ends, (end, sid))

    def node_replaced(self, node: int) -> None:
        """A new machine plays ``node``: its slow GPUs are gone (their moves with them)."""
        for sid in [k for k, (nd, _) in self.line.slow.items() if nd == node]:
            del self.line.slow[sid]
            self.pause_s.pop(sid, None)
