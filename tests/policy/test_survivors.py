"""The survivors' policy (policy/survivors.py): shrink first or replace first, over a table of
cases, and the costs it reads from the job's recovery reports."""

from __future__ import annotations

import pytest

from nonstop.config import job_config_from_flat
from nonstop.errors import UsageError
from nonstop.policy.elastic import assign_shards, play_shards
from nonstop.policy.survivors import SurvivorCosts, SurvivorMode, choose, costs_from_reports, shrunk_rate


def test_shrunk_rate_is_the_slowest_ranks_micro_batches() -> None:
    assert shrunk_rate(assign_shards(4, 4), assign_shards(4, 3)) == 0.5  # one rank plays 2
    assert shrunk_rate(assign_shards(16, 4), assign_shards(16, 3)) == pytest.approx(4 / 6)
    assert shrunk_rate(assign_shards(4096, 1024), assign_shards(4096, 1023)) == 0.8  # 4 -> 5 each
    assert shrunk_rate(assign_shards(4, 4), ()) == 0.0
    # --shrink-batch drop: steps as fast, the samples of the shards played
    assert shrunk_rate(play_shards(4, 4, 4), play_shards(4, 4, 3, drop=True)) == 0.75
    assert shrunk_rate(play_shards(4096, 1024, 1024), play_shards(4096, 1024, 1016, drop=True)) == 1016 / 1024
    # a TP pair plays the same shard: counted once
    assert shrunk_rate(((0,), (0,), (1,), (1,)), ((0,), (0,))) == 0.5


SLOW_RESTORE = SurvivorCosts(step_s=1.0, restore_s=8.0, rebuild_s=0.5, swap_s=1.0)
FAST_RESTORE = SurvivorCosts(step_s=1.0, restore_s=0.05, rebuild_s=0.02, swap_s=0.3)


@pytest.mark.parametrize(
    ("mode", "can", "costs", "rate", "first", "why"),
    [
        (SurvivorMode.WAIT, True, SLOW_RESTORE, 0.8, False, "--survivors wait"),
        (SurvivorMode.CONTINUE, True, FAST_RESTORE, 0.5, True, "--survivors continue"),
        (SurvivorMode.CONTINUE, False, SLOW_RESTORE, 0.8, False, "may not shrink"),
        (SurvivorMode.AUTO, False, SLOW_RESTORE, 0.8, False, "may not shrink"),
        (SurvivorMode.AUTO, True, None, 0.8, False, "no replacement measured"),
        (
            SurvivorMode.AUTO,
            True,
            SurvivorCosts(step_s=1, restore_s=None, rebuild_s=0, swap_s=0),
            0.8,
            False,
            "no replacement measured",
        ),
        # a long restore and little slowdown: 0.5 + 9 x 0.2 + 1 = 3.3 s lost vs 8.5 s
        (SurvivorMode.AUTO, True, SLOW_RESTORE, 0.8, True, "shrink first"),
        # the same restore at half speed: 0.5 + 9 x 0.5 + 1 = 6.0 s vs 8.5 s
        (SurvivorMode.AUTO, True, SLOW_RESTORE, 0.5, True, "shrink first"),
        # a spare that restores in 50 ms: the survivors are better off waiting for it
        (SurvivorMode.AUTO, True, FAST_RESTORE, 0.8, False, "replace first"),
        # nothing left to train with while it restores
        (SurvivorMode.AUTO, True, SLOW_RESTORE, 0.0, False, "replace first"),
    ],
)
def test_choose(
    mode: SurvivorMode, can: bool, costs: SurvivorCosts | None, rate: float, first: bool, why: str
) -> None:
    c = choose(mode, can_shrink=can, costs=costs, rate=rate)
    assert c.shrink_first is first and why in c.reason


def test_auto_weighs_the_seconds_lost_each_way() -> None:
    c = choose(SurvivorMode.AUTO, can_shrink=True, costs=SLOW_RESTORE, rate=0.8)
    assert c.replace_s == pytest.approx(8.5) and c.continue_s == pytest.approx(3.3)


def test_costs_come_from_the_newest_replacement_and_the_swaps_measured() -> None:
    reports = [
        {"replacement": "spare", "stages": {"launch": 0.5, "restore": 1.0, "rebuild": 0.2}},
        {"replacement": "none", "stages": {"launch": 0.0, "restore": 0.01, "rebuild": 0.1}},  # a shrink
        {"replacement": "cold", "stages": {"launch": 2.0, "restore": 1.5, "rebuild": 0.3}},
        {"replacement": "none", "stages": {"launch": 0.0, "restore": 0.01, "rebuild": 0.1}},
    ]
    c = costs_from_reports(reports, step_s=2.0, swap_ratios=[1.5, 1.2, 3.0])
    assert c is not None and c.restore_s == 3.5 and c.rebuild_s == 0.3
    assert c.swap_s == pytest.approx(0.5 * 2.0 + 0.3)  # the median swap's pause beyond a step
    fresh = costs_from_reports([], step_s=2.0)
    assert fresh is not None and fresh.restore_s is None and fresh.swap_s == pytest.approx(2.0)
    assert costs_from_reports(reports, step_s=None) is None


def test_continue_needs_an_elastic_job_that_can_go_on_without_a_group(tmp_path) -> None:  # type: ignore[no-untyped-def]
    base = dict(script="-m x", job_dir=tmp_path, nproc_per_node=4)
    job_config_from_flat({**base, "survivors": "continue", "min_world_size": 2})
    with pytest.raises(UsageError, match=r"--survivors continue needs an elastic job.*--min-world-size"):
        job_config_from_flat({**base, "survivors": "continue"})
    with pytest.raises(UsageError, match="--survivors must be one of auto, wait, continue"):
        job_config_from_flat({**base, "survivors": "sometimes"})
    with pytest.raises(UsageError, match="needs replica groups"):
        job_config_from_flat({**base, "survivors": "continue", "mesh": "shard=4", "min_world_size": 2})
    job_config_from_flat(
        {**base, "survivors": "continue", "mesh": "replicate=2,shard=2", "min_world_size": 2}
    )
