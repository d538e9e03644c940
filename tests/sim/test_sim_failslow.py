"""Fail-slow events and degraded signals in the simulator, decided by the runtime's own policies."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from nonstop.policy import grading, proactive, straggler
from nonstop.policy.decisions import FailureKind
from nonstop.policy.grading import Grade, Graded
from nonstop.policy.proactive import MigrationDecision
from nonstop.policy.straggler import StragglerConfig
from nonstop.sim.advisor import proactive_worth
from nonstop.sim.api import FailureEvents, JobSpec, SimResult, SlowEvents
from nonstop.sim.calibrate import load_calibration
from nonstop.sim.cli import add_parsers, dispatch
from nonstop.sim.engine import simulate
from nonstop.sim.failslow import FailSlowModel, WithFailSlow, detection_steps
from nonstop.sim.failures import Cause, TraceFailures, preset
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.proactivesim import NO_PROACTIVE
from nonstop.sim.strategies import CheckpointRestart, TorchftLike
from nonstop.sim.traces import find_trace, load_node_trace

CAL = load_calibration()
JOB = JobSpec(num_gpus=64, days=1)  # 8 nodes
GPUS = JOB.num_gpus
NODE_LOSS = (Cause(name="node", weight=1, kind=FailureKind.NODE_LOST),)


class Fixed:
    """Given failures ``(time, node, lead_s)`` and slowdowns ``(time, node, factor, duration)``."""

    def __init__(
        self,
        *,
        fails: Sequence[tuple[float, int, float]] = (),
        slows: Sequence[tuple[float, int, float, float]] = (),
    ) -> None:
        self.fails, self.slows = list(fails), list(slows)

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents:
        del job, rng
        n = len(self.fails)
        col = lambda rows, i, t: np.array([r[i] for r in rows], dtype=t)  # noqa: E731
        return FailureEvents(
            time=col(self.fails, 0, np.float64),
            node=col(self.fails, 1, np.int64),
            cause=np.zeros(n, dtype=np.int64),
            lemon=np.zeros(n, dtype=np.bool_),
            causes=NODE_LOSS,
            lead_s=col(self.fails, 2, np.float64),
            slow=SlowEvents(
                time=col(self.slows, 0, np.float64),
                node=col(self.slows, 1, np.int64),
                factor=col(self.slows, 2, np.float64),
                duration_s=col(self.slows, 3, np.float64),
            ),
        )


def nonstop(*, proactive_moves: bool = True) -> Nonstop:
    params = NonstopParams() if proactive_moves else NonstopParams(straggler=NO_PROACTIVE)
    return Nonstop(job=JOB, params=params, calibration=CAL)


def stage(r: SimResult, name: str) -> float:
    return r.lost_by_stage.get(name, 0.0)


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(list(argv))


def test_a_slow_rank_slows_the_whole_job_by_its_factor() -> None:
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 2.0, 3600.0)]), nonstop(proactive_moves=False))
    assert stage(r, "fail_slow") == pytest.approx(3600 * (1 - 1 / 2) * GPUS)
    assert r.lost_gpu_s["fail-slow"]["fail_slow"] == pytest.approx(stage(r, "fail_slow"))
    assert r.slowdowns == 1 and r.proactive == {}


def test_overlapping_slowdowns_run_at_the_slowest_pace() -> None:
    r = simulate(
        JOB, Fixed(slows=[(0.0, 1, 2.0, 1000.0), (500.0, 2, 4.0, 200.0)]), nonstop(proactive_moves=False)
    )
    assert stage(r, "fail_slow") == pytest.approx((800 * 0.5 + 200 * 0.75) * GPUS)


def test_the_slowed_progress_is_what_the_strategy_keeps() -> None:
    """What is not booked is the progress the strategy made: it trained dt / factor."""
    strat = TorchftLike(job=JOB, calibration=CAL)
    r = simulate(JOB, Fixed(slows=[(100.0, 0, 3.0, 7200.0)]), strat)
    assert strat.work == pytest.approx(JOB.horizon_s * r.ettr, rel=1e-9)


def test_detected_after_the_window_then_moved_back_to_full_speed() -> None:
    cfg = StragglerConfig()
    strat = nonstop()
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 2.0, 3600.0)]), strat)
    detect_s = cfg.needed * JOB.step_s * 2.0  # 6 of a window of 8 slow steps, each 2 x as long
    slow_for = detect_s + strat.migration_swap.prepare_s
    assert stage(r, "fail_slow") == pytest.approx(slow_for * 0.5 * GPUS)
    assert stage(r, "proactive_migration") == pytest.approx(strat.migration * GPUS)
    assert r.proactive == {"straggler": 1}


def test_a_slowdown_below_the_detectors_factor_is_never_moved() -> None:
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 1.3, 3600.0)]), nonstop())
    assert r.proactive == {} and stage(r, "fail_slow") == pytest.approx(3600 * (1 - 1 / 1.3) * GPUS)


def test_detection_is_the_runtimes_tracker() -> None:
    steps, verdict = detection_steps(StragglerConfig(), 2.0, step_s=5.0) or (0, None)
    assert steps == 6 and verdict is not None and verdict.compute_s == pytest.approx(10.0)
    assert (detection_steps(StragglerConfig(window=4), 2.0, step_s=5.0) or (0,))[0] == 3
    assert detection_steps(StragglerConfig(), 1.4, step_s=5.0) is None


def test_the_sim_takes_the_runtimes_migration_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Would fail if the simulator used its own rule: the runtime's policy says no, so no move."""
    no = MigrationDecision(migrate=False, reason="patched", expected_loss_s=0.0, cost_s=1.0)
    monkeypatch.setattr(proactive, "decide_migration", lambda **kw: no)
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 2.0, 3600.0)]), nonstop())
    assert r.proactive == {} and stage(r, "fail_slow") == pytest.approx(1800 * GPUS)


def test_the_sim_takes_the_runtimes_detector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(straggler.StragglerTracker, "judge", lambda self, members: {})
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 2.0, 3600.0)]), nonstop())
    assert r.proactive == {} and stage(r, "fail_slow") == pytest.approx(1800 * GPUS)


def test_a_short_run_left_is_not_worth_a_move() -> None:
    """The policy weighs the run's remaining steps: near the end, doing nothing costs less."""
    end = JOB.horizon_s
    r = simulate(JOB, Fixed(slows=[(end - 70.0, 3, 2.0, 3600.0)]), nonstop())
    assert r.proactive == {}


def test_a_failure_that_replaces_the_node_ends_its_slowdown() -> None:
    strat = CheckpointRestart(job=JOB, interval_s=1800.0, calibration=CAL)
    r = simulate(JOB, Fixed(slows=[(1000.0, 3, 2.0, 36000.0)], fails=[(3000.0, 3, 0.0)]), strat)
    assert stage(r, "fail_slow") == pytest.approx(2000 * 0.5 * GPUS)


def test_degraded_before_failure_turns_it_into_a_planned_swap() -> None:
    fails = [(20_000.0, 5, 600.0)]
    warned = simulate(JOB, Fixed(fails=fails), nonstop())
    blind = simulate(JOB, Fixed(fails=fails), nonstop(proactive_moves=False))
    assert warned.proactive == {"degraded": 1} and warned.actions == {"migrate": 1}
    assert stage(warned, "lost_work") == 0 and stage(warned, "detect") == 0
    assert stage(warned, "proactive_migration") > 0
    assert blind.actions == {"replace_node": 1} and stage(blind, "detect") > 0
    assert warned.ettr > blind.ettr


def test_a_signal_too_late_to_prepare_the_move_changes_nothing() -> None:
    r = simulate(JOB, Fixed(fails=[(20_000.0, 5, 1e-6)]), nonstop())
    assert r.proactive == {} and r.actions == {"replace_node": 1}


def test_the_drain_follows_the_runtimes_grading(monkeypatch: pytest.MonkeyPatch) -> None:
    stay = Graded(grade=Grade.RESTART_IN_PLACE, reason="patched")
    monkeypatch.setattr(grading, "grade_failure", lambda sig, q: stay)
    r = simulate(JOB, Fixed(fails=[(20_000.0, 5, 600.0)]), nonstop())
    assert r.proactive == {} and r.actions == {"replace_node": 1}


def test_the_wrapper_keeps_the_base_failures_and_draws_at_the_rates() -> None:
    job = JobSpec(num_gpus=16_384, days=54)
    base = preset("llama3")
    model = FailSlowModel()
    plain = base.sample(job, np.random.default_rng(7))
    wrapped = WithFailSlow(base=base, model=model).sample(job, np.random.default_rng(7))
    assert np.array_equal(plain.time, wrapped.time) and np.array_equal(plain.cause, wrapped.cause)
    assert wrapped.slow is not None and wrapped.lead_s is not None
    expected = model.rate_per_gpu_hour * job.num_gpus * job.horizon_s / 3600
    assert abs(len(wrapped.slow) - expected) < 4 * expected**0.5
    causes = wrapped.causes
    hardware = np.array(
        [causes[c].kind is FailureKind.NODE_LOST and not causes[c].planned for c in wrapped.cause]
    )
    warned = wrapped.lead_s > 0
    assert not np.any(warned & ~hardware)
    assert warned.sum() / hardware.sum() == pytest.approx(model.warned_fraction, abs=0.06)
    slow = wrapped.slow
    assert slow.factor.min() >= model.factor_min and slow.factor.max() <= model.factor_max
    assert slow.duration_s.min() >= model.duration_min_s and slow.duration_s.max() <= model.duration_max_s


def test_proactive_moves_pay_at_scale() -> None:
    """16,384 GPUs, llama3, one week: nonstop with the runtime's proactive moves beats itself
    without them, and both keep the failures they share."""
    job = JobSpec(num_gpus=16_384, days=7)
    src = WithFailSlow(base=preset("llama3"))
    on = simulate(job, src, Nonstop(job=job, calibration=CAL), seed=1)
    off = simulate(
        job, src, Nonstop(job=job, params=NonstopParams(straggler=NO_PROACTIVE), calibration=CAL), seed=1
    )
    assert on.failures == off.failures and on.slowdowns == off.slowdowns > 0
    assert on.ettr > off.ettr and on.proactive.get("straggler", 0) > 0


def test_simulate_fail_slow_reports_what_the_moves_are_worth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    argv = ["simulate", "--gpus", "1024", "--days", "7", "--fail-slow", "--json", str(out), "--no-progress"]
    assert dispatch(parse(*argv)) == 0
    text = capsys.readouterr().out
    assert "| nonstop no-proactive |" in text and "proactive migration is worth" in text
    doc = json.loads(out.read_text())
    assert doc["fail_slow"]["rate_per_gpu_hour"] == pytest.approx(FailSlowModel().rate_per_gpu_hour)
    names = [r["strategy"] for r in doc["median_runs"]]
    assert names == ["checkpoint-restart", "torchft-like", "nonstop", "nonstop no-proactive"]
    assert all(r["slowdowns"] > 0 for r in doc["median_runs"])


def test_simulate_without_fail_slow_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    assert dispatch(parse("simulate", "--gpus", "1024", "--days", "2", "--strategy", "nonstop")) == 0
    text = capsys.readouterr().out
    assert "no-proactive" not in text and "proactive migration" not in text


def test_advise_fail_slow_says_what_proactive_migration_is_worth(capsys: pytest.CaptureFixture[str]) -> None:
    worth = proactive_worth(
        job=JobSpec(num_gpus=1024, days=7),
        model=preset("llama3"),
        failslow=FailSlowModel(),
        calibration=CAL,
        seeds=(0,),
    )
    assert worth.ettr_with > worth.ettr_without and worth.moves_per_day
    assert "proactive migration" in worth.line() and worth.to_json()["num_gpus"] == 1024


def test_a_spot_preemption_gives_no_degraded_signal() -> None:
    job = JobSpec(num_gpus=256, days=1)
    trace = TraceFailures(trace=load_node_trace(find_trace("p3")))
    events = WithFailSlow(base=trace, model=FailSlowModel(warned_fraction=1.0)).sample(
        job, np.random.default_rng(0)
    )
    assert len(events) > 0 and events.lead_s is not None and not np.any(events.lead_s > 0)
