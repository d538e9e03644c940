"""The fail-slow policy (policy/straggler.py) over generated step timings: a persistent straggler
is flagged after k of W steps; a whole-job slowdown, a one-off slow step, noisy timings (+-30%
jitter, a loaded machine) and a hang are not."""

from __future__ import annotations

import random

import pytest

from nonstop.errors import UsageError
from nonstop.policy.straggler import StragglerConfig, StragglerTracker, _medians_of_others

BASE = 0.05  # seconds of compute per step


def feed(
    t: StragglerTracker,
    ranks: int,
    steps: range,
    slow: dict[int, float],
    *,
    jitter: float = 0.0,
    seed: int = 0,
) -> list[int]:
    """Record ``steps`` for ``ranks`` ranks (rank -> slowdown factor in ``slow``); return the
    steps after which something was flagged."""
    rng = random.Random(seed)
    flagged_at = []
    for s in steps:
        for r in range(ranks):
            x = BASE * slow.get(r, 1.0) * (1 + rng.uniform(-jitter, jitter))
            t.record(r, s, x, who=r)
        if t.judge(range(ranks)):
            flagged_at.append(s)
    return flagged_at


def test_a_persistent_straggler_is_flagged_after_k_of_w_steps() -> None:
    cfg = StragglerConfig(factor=1.5, window=8)
    t = StragglerTracker(cfg)
    assert feed(t, 3, range(10), {}) == []
    at = feed(t, 3, range(10, 30), {1: 3.0})
    assert at and at[0] == 10 + cfg.needed - 1  # flagged at the k-th slow step
    (v,) = t.judge(range(3)).values()
    assert v.rank == 1 and v.factor == pytest.approx(3.0) and v.steps == 8 and v.window == 8


def test_the_straggler_is_found_among_many_ranks_with_noise() -> None:
    t = StragglerTracker(StragglerConfig())
    feed(t, 16, range(40), {7: 2.0}, jitter=0.3, seed=3)
    assert set(t.judge(range(16))) == {7}


def test_a_whole_job_slowdown_is_not_flagged() -> None:
    t = StragglerTracker(StragglerConfig())
    assert feed(t, 4, range(20), {}) == []
    assert feed(t, 4, range(20, 60), {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}) == []


def test_a_one_off_slow_step_is_not_flagged() -> None:
    t = StragglerTracker(StragglerConfig())
    assert feed(t, 3, range(20), {}) == []
    assert feed(t, 3, range(20, 21), {2: 10.0}) == []
    assert feed(t, 3, range(21, 40), {}) == []


def test_a_few_slow_steps_below_k_are_not_flagged() -> None:
    cfg = StragglerConfig(window=8)
    t = StragglerTracker(cfg)
    for s in range(40):
        slow = {1: 3.0} if s % 8 < cfg.needed - 1 else {}
        assert feed(t, 3, range(s, s + 1), slow) == []


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_noisy_timings_are_not_flagged(seed: int, ranks: int) -> None:
    """+-30% uniform jitter on every rank's every step, 300 steps: no false positive."""
    t = StragglerTracker(StragglerConfig())
    assert feed(t, ranks, range(300), {}, jitter=0.3, seed=seed) == []


def test_a_hung_rank_reports_no_step_and_is_not_flagged() -> None:
    t = StragglerTracker(StragglerConfig())
    feed(t, 3, range(10), {})
    for s in range(10, 30):  # rank 2 stopped reporting
        t.record(0, s, BASE, who=0)
        t.record(1, s, BASE, who=1)
        assert t.judge(range(3)) == {}


def test_a_new_process_playing_the_rank_is_judged_afresh() -> None:
    t = StragglerTracker(StragglerConfig())
    feed(t, 3, range(20), {1: 3.0})
    assert set(t.judge(range(3))) == {1}
    for s in range(20, 23):  # a migrated rank: another process, at its usual pace
        for r in range(3):
            t.record(r, s, BASE, who=r if r != 1 else 99)
    assert t.judge(range(3)) == {}  # its window holds too few steps of the new process
    feed_new = [t.record(r, s, BASE, who=r if r != 1 else 99) for s in range(23, 40) for r in range(3)]
    assert feed_new and t.judge(range(3)) == {}


def test_tiny_steps_need_an_absolute_excess_too() -> None:
    t = StragglerTracker(StragglerConfig(min_excess_s=0.002))
    for s in range(20):
        for r in range(3):
            t.record(r, s, 0.0003 if r == 1 else 0.0001, who=r)
    assert t.judge(range(3)) == {}


def test_one_rank_has_no_peers() -> None:
    t = StragglerTracker(StragglerConfig())
    for s in range(20):
        t.record(0, s, 1.0 + s, who=0)
    assert t.judge([0]) == {}


def test_medians_of_others() -> None:
    vals = {0: 5.0, 1: 1.0, 2: 3.0, 3: 2.0}
    got = _medians_of_others(vals)
    for k in vals:
        others = sorted(v for j, v in vals.items() if j != k)
        assert got[k] == others[len(others) // 2]  # three others: the middle one
    got3 = _medians_of_others({0: 1.0, 1: 4.0, 2: 2.0})
    assert got3 == {0: 3.0, 1: 1.5, 2: 2.5}


@pytest.mark.parametrize(
    "kw", [{"mode": "kill"}, {"factor": 1.0}, {"window": 1}, {"k": 9}, {"migration_cost_s": -1.0}]
)
def test_bad_configs_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        StragglerConfig(**kw)  # type: ignore[arg-type]
