"""`nonstop simulate` / `nonstop advise` through `dispatch`, the predictor, and bad input."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from nonstop.errors import UsageError
from nonstop.policy.decisions import FailureKind
from nonstop.sim.api import JobSpec
from nonstop.sim.calibrate import load_calibration
from nonstop.sim.cli import add_parsers, dispatch
from nonstop.sim.failures import Cause, FailureModel
from nonstop.sim.nonstop_strategy import NonstopParams
from nonstop.sim.predictor import ARForecaster, evaluate, fit_ar
from nonstop.sim.strategies import CheckpointRestart
from nonstop.sim.traces import Availability, find_trace, load_availability


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(list(argv))


def test_simulate_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    ns = parse(
        "simulate", "--gpus", "1024", "--days", "10", "--seeds", "2", "--json", str(out), "--plot", str(png)
    )
    assert dispatch(ns) == 0
    text = capsys.readouterr().out
    assert "| nonstop |" in text and "| checkpoint-restart |" in text and "| torchft-like |" in text
    doc = json.loads(out.read_text())
    assert [r["strategy"] for r in doc["median_runs"]] == ["checkpoint-restart", "torchft-like", "nonstop"]
    assert len(doc["runs"]["nonstop"]) == 2
    run = doc["median_runs"][2]
    assert 0 < run["ettr"] < 1 and run["lost_gpu_hours_per_day_by_stage"]["overhead"] > 0
    assert doc["calibration"]["detect_exit_s"]["source"].startswith("measured")
    assert png.stat().st_size > 10_000


def test_simulate_a_spot_trace(capsys: pytest.CaptureFixture[str]) -> None:
    ns = parse(
        "simulate", "--gpus", "256", "--days", "1", "--trace", "p3", "--strategy", "nonstop", "--no-progress"
    )
    assert dispatch(ns) == 0
    assert "trace p3" in capsys.readouterr().out


def test_advise_picks_settings_within_the_memory_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "adv.json", tmp_path / "adv.png"
    # 8 GPUs x 4 GB x (2 + r) <= 100 GB -> r <= 1
    ns = parse(
        "advise", "--gpus", "512", "--days", "7", "--host-mem-gb", "100", "--seeds", "1",
        "--trace", "p3", "--json", str(out), "--plot", str(png),
    )  # fmt: skip
    assert dispatch(ns) == 0
    doc = json.loads(out.read_text())
    assert doc["best"]["replicas"] <= 1 and doc["rejected_replicas_for_memory"] == [2, 3]
    assert doc["best"]["host_gb_per_node"] <= 100
    assert {f["replicas"] for f in doc["frontier"]} == {0, 1}
    assert doc["spot"]["drops"] > 0 and png.exists()
    assert "spot trace" in capsys.readouterr().out


def test_advise_refuses_an_impossible_budget() -> None:
    with pytest.raises(UsageError, match="host-mem-gb"):
        dispatch(parse("advise", "--gpus", "64", "--days", "1", "--host-mem-gb", "10"))


@pytest.mark.parametrize(
    "argv, match",
    [
        (("simulate", "--gpus", "1001"), "multiple of --gpus-per-node"),
        (("simulate", "--days", "0"), "--days"),
        (("simulate", "--rate", "-1"), "--rate"),
        (("simulate", "--trace", "no-such-trace"), "not found"),
        (("simulate", "--quarantine", "three"), "FAILURES/WINDOW_S"),
        (("simulate", "--gpus", "64", "--group-nodes", "3", "--strategy", "torchft-like"), "--group-nodes"),
        (("simulate", "--weibull-shape", "0"), "weibull"),
        (("simulate", "--gpus", "64", "--seeds", "0"), "--seeds"),
    ],
)
def test_bad_input_is_a_usage_error(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        dispatch(parse(*argv))


def test_bad_configs_say_what_to_do() -> None:
    job = JobSpec(num_gpus=64)
    with pytest.raises(UsageError, match="interval"):
        CheckpointRestart(job=job, interval_s=1.0, calibration=load_calibration(), write_s=10.0)
    with pytest.raises(UsageError, match="--replicas"):
        NonstopParams(replicas=-1)
    with pytest.raises(UsageError, match="lemon"):
        FailureModel(rate_per_node_day=1e-3, lemon_fraction=2.0)
    with pytest.raises(UsageError):
        FailureModel(rate_per_node_day=1e-3, causes=(Cause(name="x", weight=-1, kind=FailureKind.EXIT),))


def test_ar_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    y = np.zeros(5000)
    for t in range(2, len(y)):
        y[t] = 0.1 + 0.5 * y[t - 1] - 0.3 * y[t - 2] + rng.normal(scale=0.1)
    c = fit_ar(y, 2)
    assert c == pytest.approx([0.1, 0.5, -0.3], abs=0.03)


def test_forecaster_extrapolates_a_trend_and_a_flat_series() -> None:
    ramp = np.arange(200, dtype=np.float64)
    assert ARForecaster(p=2).forecast(ramp, 3) == pytest.approx([200, 201, 202], abs=1e-3)
    assert list(ARForecaster(p=2).forecast(np.full(100, 7.0), 2)) == [7.0, 7.0]


def test_predictor_on_a_real_trace_reports_honest_figures() -> None:
    series = load_availability(find_trace("p3"))
    assert series.interval_s == 60 and series.counts.max() == 32
    ev = evaluate(
        series, model=ARForecaster(p=3), horizon=10, unplanned_cost_gpu_s=100, proactive_cost_gpu_s=10
    )
    assert ev.drops > 50 and 0 <= ev.recall <= 1 and 0 <= ev.precision <= 1
    assert ev.anticipated > 0  # p3's removals come in waves an AR on differences can see coming
    # a series that never drops gives no alarm and saves nothing
    flat = evaluate(Availability(name="flat", interval_s=60, counts=np.full(300, 8.0)))
    assert flat.drops == 0 and flat.alarms == 0 and flat.saved_gpu_s_per_day == 0


def test_skypilot_trace_is_resampled_to_60s() -> None:
    series = load_availability(find_trace("sky-us-east-2b"))
    assert series.interval_s == 60 and len(series.counts) == 3247 * 5


def test_advise_with_an_ettr_goal_takes_the_cheapest_setting_that_reaches_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a goal the advisor maximises goodput per provisioned GPU; with one it takes the best
    of that among the settings whose ETTR reaches the goal, and says when none does (exit 3),
    choosing then the highest ETTR."""
    base = ("advise", "--gpus", "1024", "--days", "7", "--seeds", "1", "--preset", "meta-high")
    free = tmp_path / "free.json"
    assert dispatch(parse(*base, "--json", str(free))) == 0
    doc = json.loads(free.read_text())
    assert doc["ettr_goal"] is None and doc["goal_met"] is None
    cheapest = doc["best"]
    assert cheapest["ettr"] < 0.998  # (no spare node: the goodput per provisioned GPU is the best)
    met = tmp_path / "met.json"
    assert dispatch(parse(*base, "--ettr-goal", "0.998", "--json", str(met))) == 0
    doc = json.loads(met.read_text())
    best = doc["best"]
    assert doc["goal_met"] is True and best["ettr"] >= 0.998 and best["spare_nodes"] > 0
    assert best["goodput_per_provisioned_gpu"] < cheapest["goodput_per_provisioned_gpu"]
    unreachable = tmp_path / "none.json"
    assert dispatch(parse(*base, "--ettr-goal", "0.9999999", "--json", str(unreachable))) == 3
    doc = json.loads(unreachable.read_text())
    assert doc["goal_met"] is False
    assert doc["best"]["ettr"] == max(f["ettr"] for f in doc["frontier"])
    assert "not reached by any setting tried" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--ettr-goal"):
        dispatch(parse(*base, "--ettr-goal", "1.5"))
