"""The simulator takes the runtime's survivors decision (shrink first or replace first) and charges
every strategy its measured per-step cost."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nonstop.policy import survivors
from nonstop.policy.decisions import FailureKind
from nonstop.policy.survivors import SurvivorChoice, SurvivorMode
from nonstop.sim.advisor import Advice, advise
from nonstop.sim.api import JobSpec, SimResult
from nonstop.sim.calibrate import Calibration, load_calibration, rendezvous_s
from nonstop.sim.engine import simulate
from nonstop.sim.failures import Cause, FailureModel
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.strategies import CheckpointRestart, TorchftLike
from tests.simscript import NODE_LOSS, Scripted

JOB = JobSpec(num_gpus=64, days=1)
CRASH = Cause(name="crash", weight=1, kind=FailureKind.KILLED)
# a slow link to the peers (0.05 GB/s: 80 s for a GPU's 4 GB): a spare node's fetch is long, while
# the survivors restore from their own memory
SLOW_FETCH = Calibration(peer_gbps_per_gpu=0.05)


def run(
    survivors_mode: SurvivorMode,
    *,
    cause: Cause = NODE_LOSS,
    min_world_size: int = 56,
    cal: Calibration = SLOW_FETCH,
) -> tuple[SimResult, Nonstop]:
    params = NonstopParams(
        spare_nodes=2, min_world_size=min_world_size, survivors=survivors_mode, replica_nodes=0
    )
    strat = Nonstop(job=JOB, params=params, calibration=cal)
    return simulate(JOB, Scripted((10_000.0, 3), cause=cause), strat), strat


def test_shrink_first_goes_on_while_the_spare_prepares() -> None:
    wait, _ = run(SurvivorMode.WAIT)
    assert wait.resizes == {} and wait.replacements == {"spare": 1}
    first, strat = run(SurvivorMode.CONTINUE)
    assert first.resizes == {"shrink_first": 1, "grow": 1}
    assert first.replacements == {"spare": 1} and first.failures == 1
    # the survivors pause for detection, the plan (with the default budget's interval, waiting for
    # their rescue writes), their own restore and one rebuild -- not for the spare node's launch
    # and fetch, which starts beside the rescue writes -- then train shrunk until the spare has
    # prepared
    cal = SLOW_FETCH
    assert strat.every > 1 and strat.rescues
    plan = cal.plan_s + strat.capture
    pause = cal.node_lease_s + plan + strat.restore_local + rendezvous_s(JOB.num_nodes)
    prepare = strat._spare_prepare_s(in_place=False)
    assert prepare == pytest.approx(strat.transfer + strat.restore_local + JOB.step_s)
    assert first.shrunk_s == pytest.approx(cal.node_lease_s + cal.plan_s + prepare - pause, rel=1e-9)
    assert first.shrunk_s > 60
    assert first.lost_by_stage["launch"] == 0 < wait.lost_by_stage["launch"]
    assert first.lost_by_stage["shrunk"] > 0
    # what the ledger does not book is exactly the progress kept
    assert first.ettr * JOB.horizon_s == pytest.approx(strat.work, rel=1e-9)
    assert sum(first.lost_by_cause.values()) == pytest.approx(sum(first.lost_by_stage.values()))


def test_a_process_spare_on_the_node_itself_joins_by_a_grow_too() -> None:
    first, strat = run(SurvivorMode.CONTINUE, cause=CRASH)
    assert first.resizes == {"shrink_first": 1, "grow": 1} and first.replacements == {"spare": 1}
    # the node's machine stays: its memory is never counted out of the replica ring
    assert strat.mem_back_at.get(3, 0.0) < float("inf")
    # prepared (launch, restore, a warm-up step) before the survivors' rebuild is done: it joins
    # as soon as they train again, so the job never trained shrunk
    assert strat._spare_prepare_s(in_place=True) < strat.restore_local + strat.rebuild
    assert first.shrunk_s == 0


def test_only_an_elastic_job_shrinks_first() -> None:
    wait, _ = run(SurvivorMode.WAIT)
    for floor in (0, 64, 57):  # not elastic; elastic but the shrink would go below the minimum
        r, strat = run(SurvivorMode.CONTINUE, min_world_size=floor)
        assert r.resizes == {} and r.ettr == wait.ettr
        assert not strat.survivor_choice(100.0).shrink_first


def test_auto_asks_the_runtime_policy_with_the_costs_at_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = survivors.choose

    def spy(mode: SurvivorMode, **kw: Any) -> SurvivorChoice:
        calls.append({"mode": mode, **kw})
        return real(mode, **kw)

    monkeypatch.setattr(survivors, "choose", spy)
    auto, strat = run(SurvivorMode.AUTO)
    (call,) = calls
    assert call["mode"] is SurvivorMode.AUTO and call["can_shrink"] is True
    costs = call["costs"]
    assert costs.step_s == JOB.step_s and costs.rebuild_s == strat.rebuild
    assert costs.restore_s == pytest.approx(strat._spare_prepare_s(in_place=False) - JOB.step_s)
    assert costs.swap_s == strat.grow_pause
    assert call["rate"] == pytest.approx(1 / 2)  # 64 shards on 56 ranks: the slowest plays 2
    # with these costs the policy replaces first (a grow pays a second rebuild and a boundary
    # restore): the same result as --survivors wait
    wait, _ = run(SurvivorMode.WAIT)
    assert auto.resizes == {} and auto.ettr == wait.ettr


def test_the_runtime_choice_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    first, _ = run(SurvivorMode.CONTINUE)
    monkeypatch.setattr(
        survivors, "choose", lambda mode, **kw: SurvivorChoice(shrink_first=True, reason="test")
    )
    forced, _ = run(SurvivorMode.AUTO)
    assert forced.resizes == first.resizes == {"shrink_first": 1, "grow": 1}
    assert forced.ettr == first.ettr
    monkeypatch.setattr(
        survivors, "choose", lambda mode, **kw: SurvivorChoice(shrink_first=False, reason="test")
    )
    never, _ = run(SurvivorMode.CONTINUE)
    assert never.resizes == {} and never.ettr != first.ettr


def test_every_strategy_pays_its_measured_per_step_cost() -> None:
    quiet = FailureModel(rate_per_node_day=0.0, causes=(NODE_LOSS,))
    free = Calibration(torchft_step_overhead_s=0.0, nonstop_step_overhead_s=0.0)
    paid = Calibration(torchft_step_overhead_s=0.05, nonstop_step_overhead_s=0.02)
    tf0 = simulate(JOB, quiet, TorchftLike(job=JOB, calibration=free))
    tf1 = simulate(JOB, quiet, TorchftLike(job=JOB, calibration=paid))
    # torchft's hourly checkpoint blocks in both; every step costs 0.05 s of 5 s more
    assert tf0.ettr - tf1.ettr == pytest.approx(0.01 * tf0.ettr, rel=1e-6)
    ns0 = simulate(JOB, quiet, Nonstop(job=JOB, calibration=free))
    ns1 = simulate(JOB, quiet, Nonstop(job=JOB, calibration=paid))
    assert ns0.ettr - ns1.ettr == pytest.approx(0.02 / JOB.step_s, rel=1e-6)
    cr0 = simulate(JOB, quiet, CheckpointRestart(job=JOB, interval_s=1800, calibration=free))
    cr1 = simulate(JOB, quiet, CheckpointRestart(job=JOB, interval_s=1800, calibration=paid))
    assert cr0.ettr == cr1.ettr  # plain DDP: no framework per step


def test_per_step_costs_are_read_from_the_side_by_side_benchmark(tmp_path: Path) -> None:
    def summary(torchft: float, nonstop_off: float) -> dict[str, Any]:
        return {
            "summary": {
                "torchft": {"extra_s_vs_ddp": {"median": torchft}},
                "nonstop_off": {"extra_s_vs_ddp": {"median": nonstop_off}},
            }
        }

    (tmp_path / "step_cost_peers-tiny.json").write_text(json.dumps(summary(0.004, -0.002)))
    cal = load_calibration(tmp_path)
    assert cal.torchft_step_overhead_s == 0.004
    assert cal.nonstop_step_overhead_s == 0.0  # faster than DDP here: charged nothing, not a gain
    assert cal.source("torchft_step_overhead_s").startswith("measured: step_cost_peers-tiny.json")
    missing = load_calibration(tmp_path / "nothing")
    assert missing.torchft_step_overhead_s == Calibration().torchft_step_overhead_s
    assert "not found" in missing.source("torchft_step_overhead_s")


def _advise_node_losses(**kw: Any) -> Advice:
    """The advisor on a data-parallel job of 256 GPUs losing nodes, the pool an hour away."""
    job = JobSpec(num_gpus=256, days=2)
    return advise(
        job=job,
        model=FailureModel(rate_per_node_day=0.05, causes=(NODE_LOSS,)),
        calibration=Calibration(node_provision_s=3600.0),
        host_budget_bytes=job.gpus_per_node * job.state_bytes_per_gpu * 3,
        seeds=(0,),
        max_replicas=1,
        replica_nodes=0,
        **kw,
    )


def test_the_advisor_weighs_elasticity_against_spares() -> None:
    adv = _advise_node_losses()
    elastic = [c for c in adv.candidates if c.min_world_size]
    assert {(c.min_world_size, c.shards_per_rank) for c in elastic} == {(230, 1), (230, 4)}
    assert {c.spare_nodes for c in elastic} >= {0, 1, 2}
    assert adv.best == max(adv.candidates, key=lambda c: c.goodput_per_provisioned_gpu)
    # with no spare, shrinking beats waiting an hour for the pool's node, and more shards per rank
    # shrink more gently
    by = {(c.min_world_size, c.shards_per_rank, c.spare_nodes): c for c in adv.candidates}
    best = adv.best
    key = (best.replicas, best.snapshot_every, best.persist_every_s)
    no_spare = [c for c in adv.candidates if (c.replicas, c.snapshot_every, c.persist_every_s) == key]
    off = next(c for c in no_spare if c.spare_nodes == 0 and not c.min_world_size)
    assert by[(230, 1, 0)].ettr > off.ettr and by[(230, 4, 0)].ettr > by[(230, 1, 0)].ettr
    assert "shard(s)/rank" in adv.table() or best.elastic == "off"


def test_the_advisor_tries_dropping_the_shrunk_batch_only_when_allowed() -> None:
    assert {c.shrink_batch for c in _advise_node_losses().candidates} == {"keep"}
    adv = _advise_node_losses(may_drop_batch=True)
    drop = {c.spare_nodes: c for c in adv.candidates if c.shrink_batch == "drop"}
    keep4 = {c.spare_nodes: c for c in adv.candidates if c.min_world_size and c.shards_per_rank == 4}
    assert set(drop) == set(keep4) and {c.min_world_size for c in drop.values()} == {230}
    # without a spare, a shrunk step at full speed on 248 of 256 shards beats 4 -> 5 micro-batches
    assert drop[0].ettr > keep4[0].ettr
    assert drop[0].params().shrink_batch == "drop" and "dropped" in drop[0].elastic
    assert adv.best == max(adv.candidates, key=lambda c: c.goodput_per_provisioned_gpu)
