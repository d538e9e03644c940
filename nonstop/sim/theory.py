"""Closed forms the simulator is validated against (and the advisor starts from).

Notation: checkpoint interval ``tau`` (seconds of work between checkpoints), blocking checkpoint
cost ``c``, restart cost ``r`` (downtime per failure, itself interruptible), job failure rate
``lam`` (per second; exponential inter-failure times), ``m = 1/lam`` the job's MTBF.

* :func:`exact_ettr` — the renewal formula for exponential failures (Daly 2006, eq. 1): a segment
  of ``tau`` work + ``c`` checkpoint takes on average ``e^(lam r) (e^(lam (tau + c)) - 1) / lam``
  wall seconds, failures during restarts included; ETTR = tau / that.
* :func:`optimal_interval` — the exact maximiser of :func:`exact_ettr`: with x = lam tau it solves
  ``(1 - x) e^x = e^(-lam c)`` (Newton's method; the Lambert-W form of Daly's paper).
* :func:`young_interval` ``sqrt(2 c m)`` (Young 1974) and :func:`daly_interval`, Daly's
  higher-order estimate ``sqrt(2 c m) [1 + sqrt(c / 2m) / 3 + (c / 2m) / 9] - c`` for c < 2m.
* :func:`meta_ettr` — Meta's first-order estimate (Kokolis et al., arXiv:2410.21680):
  ``E[ETTR] ~ [1 - N r_f (u0 + dt / 2)] / (1 + w_cp / dt)`` for N nodes failing at r_f each,
  restart overhead u0, checkpoint interval dt and checkpoint write w_cp. It linearises the loss,
  so it is accurate when N r_f (u0 + dt) << 1 and undershoots the exact value above that.
"""

from __future__ import annotations

import math

from nonstop.sim.api import DAY_S, require

__all__ = [
    "daly_interval",
    "exact_ettr",
    "meta_ettr",
    "optimal_interval",
    "young_interval",
]


def exact_ettr(*, tau: float, ckpt_s: float, restart_s: float, rate_per_s: float) -> float:
    require(tau > 0 and ckpt_s >= 0 and restart_s >= 0 and rate_per_s >= 0, "exact_ettr: bad arguments")
    if rate_per_s == 0:
        return tau / (tau + ckpt_s)
    lam = rate_per_s
    wall = math.exp(lam * restart_s) * math.expm1(lam * (tau + ckpt_s)) / lam
    return tau / wall


def optimal_interval(*, ckpt_s: float, rate_per_s: float) -> float:
    """The interval maximising :func:`exact_ettr` (independent of the restart cost)."""
    require(ckpt_s > 0 and rate_per_s > 0, "optimal_interval needs a checkpoint cost and a failure rate > 0")
    target = math.exp(-rate_per_s * ckpt_s)
    x = min(math.sqrt(2 * rate_per_s * ckpt_s), 0.999)  # Young's value as the starting point
    for _ in range(100):
        f = (1 - x) * math.exp(x) - target
        df = -x * math.exp(x)
        step = f / df
        x = min(max(x - step, 1e-15), 1 - 1e-15)
        if abs(step) < 1e-14 * max(x, 1e-300):
            break
    return x / rate_per_s


def young_interval(*, ckpt_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * ckpt_s * mtbf_s)


def daly_interval(*, ckpt_s: float, mtbf_s: float) -> float:
    if ckpt_s >= 2 * mtbf_s:
        return mtbf_s
    q = ckpt_s / (2 * mtbf_s)
    return math.sqrt(2 * ckpt_s * mtbf_s) * (1 + math.sqrt(q) / 3 + q / 9) - ckpt_s


def meta_ettr(
    *, num_nodes: int, rate_per_node_day: float, u0_s: float, interval_s: float, write_s: float = 0.0
) -> float:
    """Meta's E[ETTR] (first order; see the module docstring)."""
    lam = num_nodes * rate_per_node_day / DAY_S
    return (1 - lam * (u0_s + interval_s / 2)) / (1 + write_s / interval_s)
