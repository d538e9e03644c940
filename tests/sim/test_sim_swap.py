"""The simulator times the runtime's own boundary-swap machine: the machine decides, the
simulated executor gives each action its calibrated duration."""

from __future__ import annotations

import pytest

from nonstop.policy import boundary_swap as swap_machine
from nonstop.policy.boundary_swap import SwapKind
from nonstop.policy.migration import BOUNDARY_MARGIN, CATCHUP_ROUNDS
from nonstop.sim.api import JobSpec
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.swapsim import SwapCosts, time_swap

COSTS = SwapCosts(step_s=2.0, fetch_s=0.5, delta_fetch_s=0.5, restore_s=0.3, rebuild_s=1.0, extra_pause_s=0.4)


def test_a_migration_is_timed_action_by_action() -> None:
    t = time_swap(SwapKind.MIGRATION, COSTS)
    # prepare fetch, restore + warm-up step, a catch-up round while a newer step is committed (with
    # 2 s steps only one is), then the job runs to the boundary; no whole round measured: no delta
    assert t.catchup_rounds == 1 and t.swap_delta is False
    assert t.boundary_steps_ahead >= BOUNDARY_MARGIN
    assert dict(t.stages) == pytest.approx({"fetch": 0.5, "restore": 0.3, "rebuild": 1.4})
    assert t.pause_s == pytest.approx(2.2)
    assert t.prepare_s >= 0.5 + 0.3 + 2.0 + 0.5
    assert t.actions[:2] == ("migration_start", "Fetch") and t.actions[-2:] == ("migration_done", "Finished")


def test_a_faster_delta_makes_the_boundary_a_delta() -> None:
    short = {**vars(COSTS), "step_s": 0.05}  # steps keep committing: both catch-up rounds run
    whole = time_swap(SwapKind.MIGRATION, SwapCosts(**short))
    assert whole.catchup_rounds == CATCHUP_ROUNDS and whole.swap_delta is False  # measured no faster
    t = time_swap(SwapKind.MIGRATION, SwapCosts(**{**short, "delta_fetch_s": 0.1}))
    assert t.catchup_rounds == CATCHUP_ROUNDS and t.swap_delta is True
    assert dict(t.stages)["fetch"] == pytest.approx(0.1)


def test_a_grow_prepares_every_joiner_and_fetches_no_catch_up() -> None:
    t = time_swap(SwapKind.GROW, COSTS, joiners=8)
    assert t.catchup_rounds == 0 and t.swap_delta is None
    assert t.actions.count("Prepare") == 8 and t.actions[-2:] == ("grow_done", "Finished")
    assert t.pause_s == pytest.approx(0.5 + 0.3 + 1.4)


def test_the_runtime_machine_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator calls the runtime's decisions through their module: change them, the
    simulated swap changes (as the policy tests do for recovery)."""
    before = time_swap(SwapKind.MIGRATION, COSTS)
    monkeypatch.setattr(swap_machine, "catch_up_to", lambda c, committed: None)
    monkeypatch.setattr(swap_machine, "boundary_step", lambda latest, margin=3: max(latest.values()) + 10)
    after = time_swap(SwapKind.MIGRATION, COSTS)
    assert after.catchup_rounds == 0 and after.boundary_steps_ahead > before.boundary_steps_ahead
    assert after.prepare_s > before.prepare_s  # ten steps ahead outweighs two skipped rounds


def test_the_strategy_uses_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    job = JobSpec(num_gpus=64, days=1)
    strat = Nonstop(job=job)
    assert strat.migration == pytest.approx(strat.migration_swap.pause_s)
    assert strat.grow_prepare == pytest.approx(strat.cal.launch_cold_s + strat.grow_swap.prepare_s)
    monkeypatch.setattr(swap_machine, "boundary_step", lambda latest, margin=3: max(latest.values()) + 20)
    later = Nonstop(job=job)
    assert later.grow_prepare > strat.grow_prepare
    fixed = Nonstop(job=job, params=NonstopParams(migration_pause_s=7.0))
    assert fixed.migration == 7.0


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="step_s"):
        SwapCosts(step_s=0.0, fetch_s=1, delta_fetch_s=1, restore_s=1, rebuild_s=1)
    with pytest.raises(ValueError, match="fetch_s"):
        SwapCosts(step_s=1.0, fetch_s=-1, delta_fetch_s=1, restore_s=1, rebuild_s=1)
