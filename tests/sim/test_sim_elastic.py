"""The simulator's elastic data parallelism, driven by the runtime's own `nonstop.policy.elastic`."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from nonstop.errors import UsageError
from nonstop.policy import elastic
from nonstop.policy.elastic import ElasticAction, ElasticDecision, ElasticPolicy
from nonstop.sim.api import JobSpec, Resizing, SimResult
from nonstop.sim.calibrate import Calibration, rendezvous_s
from nonstop.sim.cli import add_parsers, dispatch
from nonstop.sim.engine import simulate
from nonstop.sim.failures import FailureModel, preset
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.strategies import CheckpointRestart, TorchftLike
from tests.simscript import NODE_LOSS, Scripted

# code defaults (results that do not move when benchmarks/results is rewritten), without the
# frameworks' per-step costs measured since these figures were pinned (tests/sim/test_sim_survivors.py)
CAL = Calibration(torchft_step_overhead_s=0.0, nonstop_step_overhead_s=0.0)
SLOW_POOL = Calibration(node_provision_s=3600.0, torchft_step_overhead_s=0.0, nonstop_step_overhead_s=0.0)
JOB = JobSpec(num_gpus=1024, days=30)
LOSSES = FailureModel(rate_per_node_day=0.05, causes=(NODE_LOSS,))


def run(
    params: NonstopParams, *, cal: Calibration = SLOW_POOL, seed: int = 4, job: JobSpec = JOB
) -> SimResult:
    return simulate(job, LOSSES, Nonstop(job=job, params=params, calibration=cal), seed=seed)


def same(a: SimResult, b: SimResult) -> None:
    assert a.ettr == b.ettr and a.lost_gpu_s == b.lost_gpu_s
    assert (a.actions, a.tiers, a.replacements) == (b.actions, b.tiers, b.replacements)


def test_elastic_off_gives_the_results_of_before() -> None:
    """Figures computed before elasticity existed (same seeds, code-default calibration); the two
    nonstop ones re-pinned when the runtime's generation machine began timing recoveries (a
    replacement's peer fetch overlaps its launch, as in the runtime: 0.99762514 -> 0.99762707 and
    0.97634226 -> 0.97635390; the launch and replan figures are unchanged), and again when a
    rollback began to go back to the newest snapshot whose copy had landed, not a whole step per
    replica (tests/sim/test_sim_lost_work.py: 0.99762707 -> 0.99765600, 0.97635390 -> 0.97666640);
    torchft-like's re-pinned when each membership change began to reconfigure every group's
    cross-group process group (tests/sim/test_sim_torchft.py: 0.99978327 -> 0.99970719)."""
    dp = NonstopParams(replica_nodes=0, snapshot_budget=0.0)  # the data-parallel job, every step, as pinned
    ns = simulate(JOB, preset("meta-high"), Nonstop(job=JOB, params=dp, calibration=CAL), seed=3)
    assert ns.ettr == pytest.approx(0.9976560041084057, rel=1e-12)
    assert ns.replacements == {"spare": 18, "pool": 3} and ns.tiers == {"peer": 17, "local": 4}
    pool_params = NonstopParams(spare_nodes=0, replica_nodes=0, snapshot_budget=0.0)
    pool = run(pool_params, cal=CAL)
    assert pool.ettr == pytest.approx(0.9766663990821837, rel=1e-12) and pool.failures == 175
    assert pool.lost_gpu_s["node"]["launch"] == pytest.approx(53618595.83999273, rel=1e-12)
    assert pool.lost_gpu_s["node"]["replan"] == pytest.approx(302408.26335799694, rel=1e-12)
    assert pool.resizes == {} and pool.shrunk_s == 0 and pool.shrunk_throughput is None
    cr = simulate(
        JOB, preset("meta-high"), CheckpointRestart(job=JOB, interval_s=1800, calibration=CAL), seed=3
    )
    tf = simulate(JOB, preset("meta-high"), TorchftLike(job=JOB, calibration=CAL), seed=3)
    assert cr.ettr == pytest.approx(0.9919409500003415, rel=1e-12)
    assert tf.ettr == pytest.approx(0.9997071930934885, rel=1e-12)
    # elasticity off, spelled out: 0 or the full size (the runtime's ElasticPolicy.enabled is False)
    for off in (
        replace(pool_params, min_world_size=0, elastic_wait_s=600),
        replace(pool_params, min_world_size=1024),
    ):
        same(run(off, cal=CAL), pool)


def test_nonstop_is_a_resizing_strategy_and_the_baselines_are_not() -> None:
    assert isinstance(Nonstop(job=JOB, calibration=CAL), Resizing)
    assert not isinstance(CheckpointRestart(job=JOB, interval_s=1800, calibration=CAL), Resizing)


def test_with_spares_left_elasticity_changes_nothing() -> None:
    params = NonstopParams(spare_nodes=60, replica_nodes=0)
    same(run(NonstopParams(spare_nodes=60, min_world_size=512, replica_nodes=0)), run(params))


def test_shrinking_beats_waiting_for_the_pool() -> None:
    wait = run(NonstopParams(spare_nodes=0, replica_nodes=0))
    strat = Nonstop(
        job=JOB,
        params=NonstopParams(spare_nodes=0, min_world_size=512, replica_nodes=0),
        calibration=SLOW_POOL,
    )
    shrink = simulate(JOB, LOSSES, strat, seed=4)
    assert wait.failures == shrink.failures > 100  # the same failures
    assert wait.replacements == {"pool": wait.failures}
    assert shrink.ettr > wait.ettr + 0.05
    assert shrink.goodput_per_provisioned_gpu > wait.goodput_per_provisioned_gpu
    assert shrink.lost_by_stage["launch"] == 0 < shrink.lost_by_stage["shrunk"]
    assert shrink.resizes["shrink"] >= shrink.resizes["grow"] >= shrink.resizes["shrink"] - 1
    assert shrink.replacements.get("shrink", 0) == shrink.resizes["shrink"]
    assert shrink.tiers.get("local", 0) >= shrink.resizes["shrink"]  # survivors restore from memory
    # what the ledger does not book is exactly the progress kept; shrunk time is measured
    assert shrink.ettr * JOB.horizon_s == pytest.approx(strat.work, rel=1e-9)
    assert 0 < shrink.shrunk_s < JOB.horizon_s
    assert sum(shrink.lost_by_cause.values()) == pytest.approx(sum(shrink.lost_by_stage.values()))


def test_dropping_the_lost_ranks_batch_costs_only_their_share() -> None:
    """``--shrink-batch drop`` (torchft's semantics): a job shrunk by a node trains at full step
    speed on 1016 of 1024 shards; keep plays the lost shards too, one rank two (half speed)."""
    params = NonstopParams(spare_nodes=0, min_world_size=512, replica_nodes=0)
    keep = run(params)
    strat = Nonstop(job=JOB, params=replace(params, shrink_batch="drop"), calibration=SLOW_POOL)
    drop = simulate(JOB, LOSSES, strat, seed=4)
    assert drop.failures == keep.failures and drop.resizes == keep.resizes and drop.resizes["shrink"] > 100
    assert strat.elastic.rate(1016) == 1016 / 1024 and keep.shrunk_throughput == pytest.approx(0.5, abs=0.01)
    assert drop.shrunk_s == pytest.approx(keep.shrunk_s, rel=0.01)  # shrunk as long ...
    assert drop.lost_by_stage["shrunk"] < keep.lost_by_stage["shrunk"] / 20  # ... at 1/64 of the cost
    assert drop.ettr > keep.ettr + 0.05
    assert drop.ettr * JOB.horizon_s == pytest.approx(strat.work, rel=1e-9)
    with pytest.raises(UsageError, match="--shrink-batch must be one of keep, drop"):
        NonstopParams(shrink_batch="halve")


def test_an_hsdp_job_shrinks_by_whole_model_copies() -> None:
    """With replica groups (the runtime's ``--mesh replicate=R``) a lost node takes its whole
    model copy out, the copy's other nodes wait idle (a failure there touches nothing), and the
    shrunk rate is over copies: keep, one copy plays two batches; drop, 2 of 3 are trained."""
    job = JobSpec(num_gpus=384, days=1)  # 48 nodes: 3 copies of 16
    src = Scripted((10_000.0, 3), (11_000.0, 5))  # node 3 lost; then node 5, of the same copy

    def one(batch: str) -> tuple[Nonstop, SimResult]:
        params = NonstopParams(spare_nodes=0, min_world_size=256, replica_nodes=16, shrink_batch=batch)
        strat = Nonstop(job=job, params=params, calibration=SLOW_POOL)
        return strat, simulate(job, src, strat)

    (keep_s, keep), (drop_s, drop) = one("keep"), one("drop")
    for r in (keep, drop):
        assert r.resizes == {"shrink": 1, "grow": 1} and r.replacements == {"shrink": 1, "none": 1}
    assert keep_s.elastic.unit == 128 and keep_s.elastic.rate(256) == 0.5
    assert drop_s.elastic.rate(256) == 2 / 3
    assert drop.shrunk_s == pytest.approx(keep.shrunk_s) and keep.shrunk_s > 0
    assert drop.lost_by_stage["shrunk"] == pytest.approx(keep.lost_by_stage["shrunk"] * (1 / 3) / (1 / 2))


def test_min_world_size_above_the_survivors_falls_back_to_ordinary_recovery() -> None:
    wait = run(NonstopParams(spare_nodes=0, replica_nodes=0))
    # one lost node leaves 1016 ranks: below 1017 the runtime's policy says FAIL
    r = run(NonstopParams(spare_nodes=0, min_world_size=1024 - 8 + 1, replica_nodes=0))
    same(r, wait)
    assert r.resizes == {"fail": r.failures} and r.shrunk_s == 0


def test_elastic_wait_then_shrink_books_the_wait_as_planning() -> None:
    job = JobSpec(num_gpus=64, days=1)
    src = Scripted((10_000.0, 3))
    plain = simulate(
        job,
        src,
        Nonstop(
            job=job,
            params=NonstopParams(spare_nodes=0, min_world_size=8, replica_nodes=0),
            calibration=SLOW_POOL,
        ),
    )
    waited = simulate(
        job,
        src,
        Nonstop(
            job=job,
            params=NonstopParams(spare_nodes=0, min_world_size=8, elastic_wait_s=600, replica_nodes=0),
            calibration=SLOW_POOL,
        ),
    )
    assert plain.resizes == waited.resizes == {"shrink": 1, "grow": 1}
    extra = waited.lost_by_stage["plan"] - plain.lost_by_stage["plan"]
    assert extra == pytest.approx(600 * 64)
    assert plain.shrunk_s - waited.shrunk_s == pytest.approx(600)  # the pool node comes no sooner
    # a wait the pool node ends is a replacement as without elasticity
    long_wait = NonstopParams(spare_nodes=0, min_world_size=8, elastic_wait_s=4000, replica_nodes=0)
    pool = simulate(
        job,
        src,
        Nonstop(job=job, params=NonstopParams(spare_nodes=0, replica_nodes=0), calibration=SLOW_POOL),
    )
    r = simulate(job, src, Nonstop(job=job, params=long_wait, calibration=SLOW_POOL))
    same(r, pool)
    assert r.resizes == {"wait": 1}


@pytest.mark.parametrize("action", [ElasticAction.WAIT, ElasticAction.FAIL])
def test_the_runtime_on_unplaced_decides(monkeypatch: pytest.MonkeyPatch, action: ElasticAction) -> None:
    params = NonstopParams(spare_nodes=0, min_world_size=512, replica_nodes=0)
    shrink, wait = run(params), run(NonstopParams(spare_nodes=0, replica_nodes=0))
    calls: list[tuple[int, int, float]] = []

    def decide(self: ElasticPolicy, *, world_size: int, unplaced: int, waited_s: float) -> ElasticDecision:
        calls.append((world_size, unplaced, waited_s))
        return ElasticDecision(action=action, world_size=world_size, wait_s=1e9)

    monkeypatch.setattr(elastic.ElasticPolicy, "on_unplaced", decide)
    r = run(params)
    same(r, wait)
    assert r.ettr < shrink.ettr
    assert r.resizes == {action.value: r.failures} and r.shrunk_s == 0
    assert len(calls) == r.failures and all(c == (1024, 8, 0.0) for c in calls)


def test_shrunk_throughput_is_what_play_shards_implies(monkeypatch: pytest.MonkeyPatch) -> None:
    job = JobSpec(num_gpus=64, days=1)
    # node 3 is lost; a later failure of its position finds no machine there (shrunk away)
    src = Scripted((10_000.0, 3), (11_000.0, 3))
    strat = Nonstop(
        job=job,
        params=NonstopParams(spare_nodes=0, min_world_size=56, replica_nodes=0),
        calibration=SLOW_POOL,
    )
    r = simulate(job, src, strat)
    assert r.resizes == {"shrink": 1, "grow": 1} and r.failures == 2
    assert r.replacements == {"shrink": 1, "none": 1}
    frac = strat.steady_fraction  # the stall per step (the default budget's interval)
    slowest = max(len(s) for s in elastic.assign_shards(64, 56))
    assert slowest == math.ceil(64 / 56) == 2
    assert r.shrunk_throughput == pytest.approx((1 - frac) / slowest, rel=1e-12)
    # shrunk from the end of the shrink's pause (lease, plan -- with the default budget's interval,
    # the survivors' rescue writes -- restore from memory, rebuild) until the pool node, asked for
    # at the plan, has arrived and prepared
    cal = SLOW_POOL
    assert strat.rescues
    plan = cal.plan_s + strat.capture
    pause = cal.node_lease_s + plan + strat.restore_local + rendezvous_s(job.num_nodes)
    ready = 10_000 + cal.node_lease_s + cal.plan_s + cal.node_provision_s + strat.grow_prepare
    assert r.shrunk_s == pytest.approx(ready - (10_000 + pause), rel=1e-12)
    assert r.lost_by_stage["shrunk"] == pytest.approx(64 * r.shrunk_s * (1 - frac) * (1 - 1 / slowest))
    assert r.lost_by_stage["lost_work"] <= 64 * job.step_s  # the step in flight, nothing more
    # the grow's pause is the boundary-swap machine's, timed at this scale: the boundary fetched
    # from rank 0's node, restored, the group rebuilt, plus the measured per-swap cost
    stages = dict(strat.grow_swap.stages)
    assert stages["fetch"] == pytest.approx(strat.transfer) and stages["restore"] == strat.restore_local
    assert stages["rebuild"] == pytest.approx(rendezvous_s(job.num_nodes) + cal.grow_pause_steps * job.step_s)
    assert strat.grow_pause == pytest.approx(sum(stages.values()))
    assert r.ettr * job.horizon_s == pytest.approx(strat.work, rel=1e-9)

    # the rate follows the runtime's play_shards: a shrunk rank playing 3 shards makes it a third
    def lopsided(
        num_shards: int, full: int, world_size: int, *, drop: bool = False
    ) -> tuple[tuple[int, ...], ...]:
        if world_size >= full:
            return elastic.assign_shards(num_shards, world_size)
        rest = elastic.assign_shards(num_shards - 3, world_size - 1)
        return ((0, 1, 2), *(tuple(k + 3 for k in ks) for ks in rest))

    monkeypatch.setattr(elastic, "play_shards", lopsided)
    r3 = simulate(job, src, strat)
    assert r3.shrunk_throughput == pytest.approx((1 - frac) / 3, rel=1e-12)
    assert r3.shrunk_s == pytest.approx(r.shrunk_s) and r3.ettr < r.ettr


def test_the_runtime_grow_to_decides_when_to_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    job = JobSpec(num_gpus=64, days=1)
    src = Scripted((10_000.0, 3))
    params = NonstopParams(spare_nodes=0, min_world_size=56, replica_nodes=0)
    grows = simulate(job, src, Nonstop(job=job, params=params, calibration=SLOW_POOL))
    monkeypatch.setattr(elastic.ElasticPolicy, "grow_to", lambda self, *, world_size, idle_spares: world_size)
    stays = simulate(job, src, Nonstop(job=job, params=params, calibration=SLOW_POOL))
    assert stays.resizes == {"shrink": 1} and stays.shrunk_s > grows.shrunk_s + 60_000
    assert stays.ettr < grows.ettr


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_parsers(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(list(argv))


def test_simulate_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    argv = (
        "simulate",
        "--gpus",
        "1024",
        "--days",
        "10",
        "--rate",
        "50",
        "--strategy",
        "nonstop",
        "--spare-nodes",
        "0",
        "--replica-nodes",
        "0",
    )
    assert dispatch(parse(*argv, "--min-world-size", "900", "--elastic-wait", "30", "--json", str(out))) == 0
    text = capsys.readouterr().out
    assert "nonstop elastic: grow" in text and "of full speed" in text
    run_doc = json.loads(out.read_text())["median_runs"][0]
    assert run_doc["resizes"]["shrink"] > 0 and run_doc["shrunk_hours_per_day"] > 0
    assert 0 < run_doc["shrunk_throughput"] < 1
    assert run_doc["params"]["min_world_size"] == 900 and run_doc["params"]["elastic_wait_s"] == 30
    assert run_doc["params"]["shrink_batch"] == "keep"
    assert (
        dispatch(parse(*argv, "--min-world-size", "900", "--shrink-batch", "drop", "--json", str(out))) == 0
    )
    dropped = json.loads(out.read_text())["median_runs"][0]
    capsys.readouterr()
    assert dropped["params"]["shrink_batch"] == "drop"
    # 1016 of 1024 shards at full speed, not one rank playing 2: about twice the rate
    assert dropped["shrunk_throughput"] > 1.9 * run_doc["shrunk_throughput"]
    assert dispatch(parse(*argv)) == 0
    assert "elastic" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, match",
    [
        (("--min-world-size", "2000"), "--min-world-size"),
        (("--min-world-size", "-1"), "--min-world-size"),
        (("--elastic-wait", "-1"), "--elastic-wait"),
    ],
)
def test_bad_elastic_flags(extra: tuple[str, ...], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        dispatch(parse("simulate", "--gpus", "1024", "--days", "1", "--strategy", "nonstop", *extra))
