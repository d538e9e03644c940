"""Closed forms, and the simulator against them (Young/Daly, exact renewal, Meta's E[ETTR])."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from nonstop.policy.decisions import FailureKind
from nonstop.sim import theory
from nonstop.sim.api import DAY_S, JobSpec
from nonstop.sim.calibrate import load_calibration
from nonstop.sim.engine import simulate
from nonstop.sim.failures import Cause, FailureModel
from nonstop.sim.strategies import CheckpointRestart

ONE_CAUSE = (Cause(name="crash", weight=1, kind=FailureKind.EXIT),)


def bare_cr(job: JobSpec, *, interval_s: float, ckpt_s: float = 0.0, restart_s: float) -> CheckpointRestart:
    """Checkpoint-restart reduced to the textbook model: blocking checkpoint, fixed restart."""
    return CheckpointRestart(
        job=job,
        interval_s=interval_s,
        calibration=load_calibration(),
        blocking_s=ckpt_s,
        write_s=0.0,
        restart_s=restart_s,
        load_s=0.0,
        detect_s=0.0,
        hang_detect_s=0.0,
        spare_nodes=0,
        node_replace_s=0.0,
        first_step_extra_s=0.0,
    )


@pytest.mark.parametrize("c_over_m", [1e-4, 1e-3, 1e-2, 0.05])
def test_daly_matches_the_exact_optimum_within_2_percent(c_over_m: float) -> None:
    m = 3600.0
    exact = theory.optimal_interval(ckpt_s=c_over_m * m, rate_per_s=1 / m)
    daly = theory.daly_interval(ckpt_s=c_over_m * m, mtbf_s=m)
    assert abs(daly - exact) / exact < 0.02
    # the optimum really is the maximum of the exact ETTR

    def f(tau: float) -> float:
        return theory.exact_ettr(tau=tau, ckpt_s=c_over_m * m, restart_s=60, rate_per_s=1 / m)

    assert f(exact) >= f(exact * 1.05) and f(exact) >= f(exact * 0.95)


def test_young_is_the_first_order_limit() -> None:
    m = 3600.0
    exact = theory.optimal_interval(ckpt_s=1e-3 * m, rate_per_s=1 / m)
    assert abs(theory.young_interval(ckpt_s=1e-3 * m, mtbf_s=m) - exact) / exact < 0.02
    # and visibly wrong when checkpoints are expensive: that is what Daly's correction is for
    exact = theory.optimal_interval(ckpt_s=0.1 * m, rate_per_s=1 / m)
    assert abs(theory.young_interval(ckpt_s=0.1 * m, mtbf_s=m) - exact) / exact > 0.1


def test_meta_closed_form_values() -> None:
    def meta(interval_s: float) -> float:
        return theory.meta_ettr(num_nodes=2048, rate_per_node_day=6.5e-3, u0_s=300.0, interval_s=interval_s)

    assert meta(3600) == pytest.approx(0.68, abs=0.005)
    assert meta(300) == pytest.approx(0.93, abs=0.005)


def meta_sim(interval_s: float, days: float = 400.0, seeds: int = 3) -> float:
    job = JobSpec(num_gpus=2048 * 8, days=days)
    model = FailureModel(rate_per_node_day=6.5e-3, causes=ONE_CAUSE)
    strat = bare_cr(job, interval_s=interval_s, restart_s=300.0)
    return statistics.mean(simulate(job, model, strat, seed=s).ettr for s in range(seeds))


@pytest.mark.parametrize("interval_min", [2, 5, 10])
def test_simulator_within_001_of_meta_in_its_regime(interval_min: float) -> None:
    """Regime: N r_f (u0 + dt) <= ~0.15, where the first-order formula holds."""
    lam = 2048 * 6.5e-3 / DAY_S
    assert lam * (300 + interval_min * 60) < 0.16
    closed = theory.meta_ettr(
        num_nodes=2048, rate_per_node_day=6.5e-3, u0_s=300, interval_s=interval_min * 60
    )
    assert abs(meta_sim(interval_min * 60) - closed) < 0.01


def test_outside_the_regime_the_simulator_follows_the_exact_formula() -> None:
    """At dt = 60 min Meta's linearisation undershoots (0.676); the simulator tracks the exact
    renewal value (0.714), as it should."""
    lam = 2048 * 6.5e-3 / DAY_S
    exact = theory.exact_ettr(tau=3600, ckpt_s=0, restart_s=300, rate_per_s=lam)
    sim = meta_sim(3600.0)
    assert abs(sim - exact) < 0.005
    assert sim - theory.meta_ettr(num_nodes=2048, rate_per_node_day=6.5e-3, u0_s=300, interval_s=3600) > 0.02


def test_monte_carlo_matches_the_exact_renewal_formula() -> None:
    """Exponential failures, blocking checkpoints, interruptible restarts: mean over seeds within
    4 standard errors of Daly's exact formula."""
    job = JobSpec(num_gpus=8, gpus_per_node=8, days=3000.0)
    rate_day = 6.0  # one node failing 6x a day: MTBF 4 h
    model = FailureModel(rate_per_node_day=rate_day, causes=ONE_CAUSE)
    tau, ckpt, restart = 1800.0, 120.0, 600.0
    strat = bare_cr(job, interval_s=tau, ckpt_s=ckpt, restart_s=restart)
    runs = [simulate(job, model, strat, seed=s).ettr for s in range(8)]
    exact = theory.exact_ettr(tau=tau, ckpt_s=ckpt, restart_s=restart, rate_per_s=rate_day / DAY_S)
    se = statistics.stdev(runs) / math.sqrt(len(runs))
    assert abs(statistics.mean(runs) - exact) < 4 * se + 1e-4
    assert se < 0.002  # the test has power: ~18,000 failures per run


def test_simulated_optimum_agrees_with_daly() -> None:
    """Scan the interval with common random numbers, fit a parabola in log(interval) around the
    best point: the simulated optimum lands within 10% of Daly's (the curve is flat there)."""
    job = JobSpec(num_gpus=8, gpus_per_node=8, days=1500.0)
    rate_day, ckpt = 12.0, 60.0  # MTBF 2 h, c/m = 0.0083
    model = FailureModel(rate_per_node_day=rate_day, causes=ONE_CAUSE)
    daly = theory.daly_interval(ckpt_s=ckpt, mtbf_s=DAY_S / rate_day)
    grid = daly * np.exp(np.linspace(-0.8, 0.8, 9))
    ettr = [
        statistics.mean(
            simulate(job, model, bare_cr(job, interval_s=float(t), ckpt_s=ckpt, restart_s=120.0), seed=s).ettr
            for s in range(2)
        )
        for t in grid
    ]
    a, b, _ = np.polyfit(np.log(grid), ettr, 2)
    assert a < 0  # a maximum
    sim_opt = math.exp(-b / (2 * a))
    assert abs(sim_opt - daly) / daly < 0.10
