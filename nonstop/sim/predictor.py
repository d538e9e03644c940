"""Short-horizon spot-availability prediction, and when to act on it.

Parcae (NSDI'24) forecasts spot availability with ARIMA over 60 s intervals and re-plans the job
before capacity disappears. Here: an ARIMA(p, 1, 0) with drift — an AR(p) on the first difference
of the 60 s availability series, fitted by least squares (numpy only) — forecasts the number of
available nodes ``horizon`` intervals ahead. The decision rule: when the forecast minimum over the
horizon is at least ``threshold`` nodes below what the job holds now, shrink or migrate
proactively (a planned reconfiguration: one live-migration pause) instead of waiting to be
preempted (an unplanned node loss).

:func:`evaluate` replays a trace: the model is refitted on a sliding window of past data only
(no look-ahead), and every drop in availability counts as anticipated if an alarm was raised in
the ``horizon`` intervals before it. It reports forecast error against the naive last-value
forecast, alarm recall/precision, and the GPU-seconds a job would save given the cost of an
unplanned loss and of a proactive move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from nonstop.sim.api import require
from nonstop.sim.traces import Availability

__all__ = ["ARForecaster", "Evaluation", "evaluate", "fit_ar"]

FloatArray = npt.NDArray[np.float64]


def fit_ar(y: FloatArray, p: int) -> FloatArray:
    """Least-squares AR(p) with intercept on ``y``: returns ``[c, a1..ap]`` for
    ``y[t] = c + a1 y[t-1] + ... + ap y[t-p]``. A tiny ridge keeps a constant series solvable."""
    require(p >= 1, f"AR order must be >= 1; got {p}")
    require(len(y) > 2 * p + 1, f"need more than {2 * p + 1} points to fit AR({p}); got {len(y)}")
    rows = len(y) - p
    x = np.ones((rows, p + 1))
    for i in range(1, p + 1):
        x[:, i] = y[p - i : len(y) - i]
    target = y[p:]
    ridge = 1e-6 * np.eye(p + 1)
    ridge[0, 0] = 0.0
    coef = np.linalg.solve(x.T @ x + ridge, x.T @ target)
    return np.asarray(coef, dtype=np.float64)


@dataclass(frozen=True, kw_only=True)
class ARForecaster:
    """ARIMA(p,1,0) with drift on availability counts; see the module docstring."""

    p: int = 3
    window: int = 720  # intervals of history to fit on (12 h of 60 s)

    def forecast(self, history: FloatArray, steps: int) -> FloatArray:
        """Levels for the next ``steps`` intervals given ``history`` (oldest first)."""
        hist = history[-self.window :]
        d = np.diff(hist)
        if len(d) <= 2 * self.p + 1 or not np.any(d):
            return np.full(steps, hist[-1])
        coef = fit_ar(d, self.p)
        lags = list(d[-self.p :][::-1])  # most recent first
        level = float(hist[-1])
        out = np.empty(steps)
        for k in range(steps):
            nxt = float(coef[0] + np.dot(coef[1:], lags))
            lags = [nxt, *lags[:-1]]
            level = max(0.0, level + nxt)
            out[k] = level
        return out


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    trace: str
    intervals: int
    horizon: int
    threshold: float
    mae_ar: float
    mae_naive: float
    drops: int
    anticipated: int
    alarms: int
    false_alarms: int
    saved_gpu_s_per_day: float

    @property
    def recall(self) -> float:
        return self.anticipated / self.drops if self.drops else 0.0

    @property
    def precision(self) -> float:
        return (self.alarms - self.false_alarms) / self.alarms if self.alarms else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace,
            "intervals": self.intervals,
            "horizon_intervals": self.horizon,
            "threshold_nodes": self.threshold,
            "mae_ar": self.mae_ar,
            "mae_naive": self.mae_naive,
            "drops": self.drops,
            "anticipated": self.anticipated,
            "recall": self.recall,
            "alarms": self.alarms,
            "false_alarms": self.false_alarms,
            "precision": self.precision,
            "saved_gpu_s_per_day": self.saved_gpu_s_per_day,
        }


def evaluate(
    series: Availability,
    *,
    model: ARForecaster | None = None,
    horizon: int = 5,
    threshold: float = 0.5,
    warmup: int = 60,
    unplanned_cost_gpu_s: float = 1.0,
    proactive_cost_gpu_s: float = 0.1,
) -> Evaluation:
    """Replay ``series`` (no look-ahead). Costs are per node lost / per proactive move."""
    model = model or ARForecaster()
    y = series.counts
    require(len(y) > warmup + horizon + 1, f"trace {series.name!r} is too short to evaluate")
    require(horizon >= 1 and threshold > 0, "horizon must be >= 1 interval and threshold > 0 nodes")
    err_ar: list[float] = []
    err_naive: list[float] = []
    alarm = np.zeros(len(y), dtype=bool)
    for t in range(warmup, len(y) - 1):
        fc = model.forecast(y[: t + 1], horizon)
        end = min(t + horizon, len(y) - 1)
        if end > t:
            err_ar.append(abs(fc[end - t - 1] - y[end]))
            err_naive.append(abs(y[t] - y[end]))
        alarm[t] = bool(y[t] - fc.min() >= threshold)
    drops_at = [t for t in range(warmup + 1, len(y)) if y[t] < y[t - 1]]
    lost_nodes = {t: float(y[t - 1] - y[t]) for t in drops_at}
    anticipated = [t for t in drops_at if alarm[max(warmup, t - horizon) : t].any()]
    useful = np.zeros(len(y), dtype=bool)
    for t in drops_at:
        useful[max(warmup, t - horizon) : t] = True
    alarms = int(alarm.sum())
    false_alarms = int((alarm & ~useful).sum())
    days = len(y) * series.interval_s / 86_400.0
    saved = sum(lost_nodes[t] for t in anticipated) * (unplanned_cost_gpu_s - proactive_cost_gpu_s)
    saved -= false_alarms * proactive_cost_gpu_s
    return Evaluation(
        trace=series.name,
        intervals=len(y),
        horizon=horizon,
        threshold=threshold,
        mae_ar=float(np.mean(err_ar)),
        mae_naive=float(np.mean(err_naive)),
        drops=len(drops_at),
        anticipated=len(anticipated),
        alarms=alarms,
        false_alarms=false_alarms,
        saved_gpu_s_per_day=saved / days,
    )
