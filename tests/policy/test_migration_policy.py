"""The pure decisions of a live migration: target, joiner, boundary, catch-up and swap transfer."""

from __future__ import annotations

import pytest

from nonstop.config import JobConfig, OperationsConfig
from nonstop.errors import UsageError
from nonstop.policy.migration import (
    CATCHUP_ROUNDS,
    CatchUp,
    Transfer,
    boundary_step,
    catch_up_to,
    choose_joiner,
    choose_target,
    swap_as_delta,
)


def _m(**kw: object) -> CatchUp:
    m = CatchUp()
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_target_prefers_another_domain_then_the_least_loaded() -> None:
    idle = {7: "0", 8: "2", 9: "3"}
    domains = {"0": "a", "1": "a", "2": "b", "3": "b"}
    load = {"0": 0, "2": 2, "3": 1}
    assert choose_target("1", idle, ["0", "1", "2", "3"], domains, load) == "3"
    assert choose_target("1", {}, ["0", "2"], domains, load) is None
    assert choose_joiner("2", {9: "2", 8: "2", 7: "0"}) == 8 and choose_joiner("5", idle) is None
    assert boundary_step({0: 10, 1: 12}) == 15 and boundary_step({}) == 3


def test_catch_up_waits_for_the_joiner_and_one_round_at_a_time() -> None:
    assert catch_up_to(_m(ready=False, held=10), 14) is None  # the joiner is still preparing
    assert catch_up_to(_m(ready=True, held=None), 14) is None  # nothing tracked: swap fetches whole
    assert catch_up_to(_m(ready=True, held=10, catchup_req=5), 14) is None  # one in flight
    assert catch_up_to(_m(ready=True, held=14), 14) is None  # already at the committed step
    assert catch_up_to(_m(ready=True, held=10), None) is None
    assert catch_up_to(_m(ready=True, held=10), 14) == (14, True)  # the missed steps, as a delta
    assert catch_up_to(_m(ready=True, held=14, rounds=1), 16) == (16, False)  # the whole: a measure
    assert catch_up_to(_m(ready=True, held=10, rounds=CATCHUP_ROUNDS), 20) is None  # bounded


def test_swap_fetches_a_delta_only_when_deltas_measured_faster() -> None:
    full = Transfer(raw_bytes=300_000_000, wire_bytes=300_000_000, seconds=0.15)  # 2 GB/s loopback
    slow_delta = Transfer(raw_bytes=300_000_000, wire_bytes=200_000_000, seconds=0.6)
    assert not swap_as_delta(full, [slow_delta, slow_delta])
    capped_full = Transfer(raw_bytes=300_000_000, wire_bytes=300_000_000, seconds=2.4)  # 1 Gbit/s
    assert swap_as_delta(capped_full, [slow_delta])
    assert not swap_as_delta(None, [slow_delta])  # no whole fetch crossed the link: no evidence
    assert not swap_as_delta(capped_full, [])
    # the median decides, not one lucky round
    fast = Transfer(raw_bytes=300_000_000, wire_bytes=1, seconds=0.01)
    slower = Transfer(raw_bytes=300_000_000, wire_bytes=2, seconds=5.0)
    assert not swap_as_delta(capped_full, [fast, slower, slower])
    # --swap-transfer decides alone when not auto
    assert swap_as_delta(None, [], "delta") and not swap_as_delta(capped_full, [slow_delta], "whole")


def test_a_wrong_swap_transfer_fails_at_start() -> None:
    with pytest.raises(UsageError, match="--swap-transfer must be one of auto, delta, whole"):
        JobConfig(script="x.py", operations=OperationsConfig(swap_transfer="fast"))
