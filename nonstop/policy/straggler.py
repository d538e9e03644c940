"""Fail-slow detection: a rank alive and heartbeating but persistently slower than its peers.

A synchronous job runs at the pace of its slowest rank: one rank 2-3x slower (thermal
throttling, a degraded link, a noisy neighbour) drags every step while every health check
passes. What the runtime sees of it: each rank's step report carries ``step_s`` and ``wait_s``
(the part of the step spent waiting in the gradient allreduce, :mod:`nonstop.train.ddp`), so a
rank's own **compute time** is ``step_s - wait_s``. The straggler computes long and waits little;
its peers compute as usual and wait for it. The step time alone cannot tell them apart (every
rank's step is as long as the slowest's); the compute time can.

The rule (:class:`StragglerTracker`, pure: no I/O, no clock, so the simulator can replay it):

* per step that every member reported, a rank is *slow* when its compute time is more than
  ``factor`` x the **median of the other ranks'** compute times of that step (and more than
  ``min_excess_s`` above it: a 1 ms step that took 2 ms is noise, not a fault);
* a rank is **flagged** when it was slow in at least ``k`` of the last ``window`` complete steps.

Hence: a whole-job slowdown (every rank slower together: a shared link, a busy machine) is not
flagged -- each rank is compared with its peers of the same step; a one-off slow step (a GC
pause, a page-cache miss) is not flagged -- it needs ``k`` of ``window``; noisy timings (+-30%
jitter on a loaded machine) are not flagged -- a single step's ratio may cross 1.5x, ``k`` of
``window`` of them do not; a hang is not flagged -- a hung rank reports no step, so no step is
complete, and the hang rule (:func:`~nonstop.policy.decisions.find_hung_ranks`) owns it. A job of
one rank has no peers: nothing is ever flagged. A rank's history is forgotten when another
process starts playing it (a recovery, a migration): the new process is judged afresh.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from nonstop.errors import UsageError

__all__ = ["DEGRADED_ACTIONS", "STRAGGLER_MODES", "StragglerConfig", "StragglerTracker", "StragglerVerdict"]

STRAGGLER_MODES = ("off", "warn", "migrate")
DEGRADED_ACTIONS = ("warn", "drain")


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """``mode``: ``off`` (no detection), ``warn`` (detect and report: the default), ``migrate``
    (detect, and move the rank live when :func:`~nonstop.policy.proactive.decide_migration`
    says it pays). ``factor``: slower than this x the other ranks' median is slow. ``window`` /
    ``k``: flagged when slow in ``k`` of the last ``window`` steps (``k`` 0: 3/4 of the window).
    ``min_excess_s``: a slow step is also this many seconds above the median.
    ``migration_cost_s``: what a live migration is assumed to cost (seconds of the whole job's
    time) before one was measured (BENCHMARKS.md "Live migration pause": about 1-2 steps of
    pause; conservatively 10 s here, covering the joiner's preparation competing for CPU).
    ``on_degraded``: what a node's ``degraded`` (or ``failing``) health verdict does: ``warn``
    (logged, graded) or ``drain`` (its ranks move live to nodes with an idle spare, and the node is
    released: the preemption notice's path)."""

    mode: str = "warn"
    factor: float = 1.5
    window: int = 8
    k: int = 0
    min_excess_s: float = 0.002
    migration_cost_s: float = 10.0
    on_degraded: str = "warn"

    def __post_init__(self) -> None:
        if self.mode not in STRAGGLER_MODES:
            raise UsageError(f"--straggler must be one of {', '.join(STRAGGLER_MODES)} (got {self.mode!r})")
        if self.on_degraded not in DEGRADED_ACTIONS:
            raise UsageError(
                f"--on-degraded must be one of {', '.join(DEGRADED_ACTIONS)} (got {self.on_degraded!r})"
            )
        if self.factor <= 1:
            raise UsageError(f"--straggler-factor must be > 1 (got {self.factor})")
        if self.window < 2:
            raise UsageError(f"--straggler-window must be >= 2 steps (got {self.window})")
        if not 0 <= self.k <= self.window:
            raise UsageError(f"the straggler's k must be in 0..window (got {self.k})")
        if self.min_excess_s < 0 or self.migration_cost_s < 0:
            raise UsageError("straggler: min_excess_s and migration_cost_s must be >= 0")

    @property
    def needed(self) -> int:
        """Slow steps in the window that flag a rank."""
        return self.k if self.k > 0 else max(2, -(-3 * self.window // 4))


@dataclass(frozen=True, kw_only=True)
class StragglerVerdict:
    """A flagged rank: ``factor`` its median compute over the others' median, over the window's
    steps; ``steps`` of the last ``window`` steps were slow; ``step`` the newest step judged."""

    rank: int
    factor: float
    steps: int
    window: int
    step: int
    compute_s: float  # the rank's median compute time over the window
    peers_s: float  # the other ranks' median compute time over the window


class StragglerTracker:
    """Per-rank compute times of the recent steps, and the verdicts over them (see the module
    docstring). Feed it with :meth:`record` and ask :meth:`judge`; pure (no I/O, no clock)."""

    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._times: dict[int, dict[int, float]] = {}  # rank -> step -> compute seconds
        self._who: dict[int, int] = {}  # rank -> the process (spawn id) the times are of

    def record(self, rank: int, step: int, compute_s: float, *, who: int = 0) -> None:
        """Rank ``rank`` (played by process ``who``) computed ``compute_s`` seconds in ``step``.
        A redone step replaces the earlier time; a new process forgets the rank's history."""
        if self._who.get(rank) != who:
            self._who[rank] = who
            self._times[rank] = {}
        times = self._times.setdefault(rank, {})
        times[step] = max(0.0, compute_s)
        keep = 4 * self.config.window
        if len(times) > keep:
            for s in sorted(times)[: len(times) - keep]:
                del times[s]

    def forget(self, rank: int) -> None:
        self._times.pop(rank, None)
        self._who.pop(rank, None)

    def judge(self, members: Collection[int]) -> dict[int, StragglerVerdict]:
        """The ranks of ``members`` flagged now, over the last ``window`` steps that every one
        of them reported (fewer than ``window`` such steps: nothing is flagged)."""
        cfg = self.config
        ranks = sorted(members)
        if len(ranks) < 2:
            return {}
        common: set[int] | None = None
        for r in ranks:
            have = set(self._times.get(r, {}))
            common = have if common is None else common & have
        steps = sorted(common or ())[-cfg.window :]
        if len(steps) < cfg.window:
            return {}
        # per step, each rank's peers' median: O(W R log R), not O(W R^2)
        per_step = {s: _medians_of_others({r: self._times[r][s] for r in ranks}) for s in steps}
        out: dict[int, StragglerVerdict] = {}
        for r in ranks:
            slow = 0
            for s in steps:
                mine = self._times[r][s]
                peers = per_step[s][r]
                if mine > cfg.factor * peers and mine - peers > cfg.min_excess_s:
                    slow += 1
            if slow < cfg.needed:
                continue
            mine_med = statistics.median(self._times[r][s] for s in steps)
            peers_med = statistics.median(self._times[o][s] for s in steps for o in ranks if o != r)
            out[r] = StragglerVerdict(
                rank=r,
                factor=round(mine_med / peers_med, 3) if peers_med > 0 else float("inf"),
                steps=slow,
                window=cfg.window,
                step=steps[-1],
                compute_s=mine_med,
                peers_s=peers_med,
            )
        return out

    def snapshot(self) -> Mapping[int, Mapping[int, float]]:
        """The recorded compute times (rank -> step -> seconds), for tests and the simulator."""
        return self._times


def _medians_of_others(values: Mapping[int, float]) -> dict[int, float]:
    """For each key, the median of the *other* keys' values (at least two keys)."""
    order = sorted(values, key=lambda k: values[k])
    v = [values[k] for k in order]
    n = len(v) - 1  # the others' count

    def at(j: int, i: int) -> float:  # element j of v without element i
        return v[j] if j < i else v[j + 1]

    out: dict[int, float] = {}
    for i, key in enumerate(order):
        if n % 2:
            out[key] = at(n // 2, i)
        else:
            out[key] = (at(n // 2 - 1, i) + at(n // 2, i)) / 2
    return out
