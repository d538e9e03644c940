"""The pure elastic decisions (policy/elastic.py) and the placement rule they rely on."""

from __future__ import annotations

import itertools

import pytest

from nonstop.config import ElasticConfig, JobConfig
from nonstop.errors import UsageError
from nonstop.policy.decisions import choose_replacements
from nonstop.policy.elastic import (
    ElasticAction,
    ElasticPolicy,
    assign_shards,
    play_shards,
    renumber,
    resume_sources,
)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 8])
def test_every_shard_is_played_exactly_once_at_every_world_size(num_shards: int) -> None:
    for world in range(1, num_shards + 1):
        plan = assign_shards(num_shards, world)
        assert len(plan) == world
        flat = list(itertools.chain.from_iterable(plan))
        assert flat == list(range(num_shards))  # each once, in order: contiguous blocks
        sizes = [len(p) for p in plan]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_full_size_is_one_shard_per_rank_and_bad_sizes_are_refused() -> None:
    assert assign_shards(3, 3) == ((0,), (1,), (2,))
    assert assign_shards(3, 2) == ((0,), (1, 2))
    with pytest.raises(ValueError):
        assign_shards(3, 4)
    with pytest.raises(ValueError):
        assign_shards(3, 0)


def test_drop_plays_the_first_ranks_blocks_and_keep_every_shard() -> None:
    # 4 ranks x 2 shards; 3 left: keep spreads all 8, drop plays ranks 0..2's own and skips 6, 7
    assert play_shards(8, 4, 3) == assign_shards(8, 3) == ((0, 1), (2, 3, 4), (5, 6, 7))
    assert play_shards(8, 4, 3, drop=True) == ((0, 1), (2, 3), (4, 5))
    # what the exact gradient mean checks: rank r's block is assign_shards(played, world)'s
    for world in range(1, 5):
        dropped = play_shards(8, 4, world, drop=True)
        played = sum(map(len, dropped))
        assert played == 2 * world and dropped == assign_shards(played, world)
    assert play_shards(8, 4, 4, drop=True) == assign_shards(8, 4)  # at full size: the same
    with pytest.raises(ValueError):
        play_shards(8, 4, 0, drop=True)


def test_renumber_keeps_the_old_order() -> None:
    assert renumber([0, 2, 3]) == {0: 0, 2: 1, 3: 2}
    assert renumber([3, 1]) == {1: 0, 3: 1}


def test_a_checkpoint_of_another_size_restores_rank_by_rank_then_from_rank_0() -> None:
    assert resume_sources(2, 3) == {0: 0, 1: 1, 2: 0}  # written shrunk, resumed at full size
    assert resume_sources(3, 2) == {0: 0, 1: 1}  # resumed smaller: the first ranks' snapshots
    assert resume_sources(3, 3) == {0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match="world sizes"):
        resume_sources(0, 3)


def test_policy_waits_then_shrinks_but_not_below_the_minimum() -> None:
    p = ElasticPolicy(full_world_size=4, min_world_size=2, wait_s=10.0)
    assert p.on_unplaced(world_size=4, unplaced=0, waited_s=0).action is ElasticAction.REPLACE
    d = p.on_unplaced(world_size=4, unplaced=1, waited_s=3.0)
    assert d.action is ElasticAction.WAIT and d.wait_s == pytest.approx(7.0)
    d = p.on_unplaced(world_size=4, unplaced=1, waited_s=10.0)
    assert d.action is ElasticAction.SHRINK and d.world_size == 3
    d = p.on_unplaced(world_size=3, unplaced=2, waited_s=11.0)
    assert d.action is ElasticAction.FAIL and "minimum world size 2" in d.reason


def test_shrink_off_fails_after_the_wait_and_never_grows() -> None:
    p = ElasticPolicy(full_world_size=3, min_world_size=3, wait_s=0.0)
    assert not p.enabled
    assert p.on_unplaced(world_size=3, unplaced=1, waited_s=0).action is ElasticAction.FAIL
    assert p.grow_to(world_size=3, idle_spares=5) == 3


def test_grow_is_bounded_by_spares_and_the_full_size() -> None:
    p = ElasticPolicy(full_world_size=4, min_world_size=1)
    assert p.grow_to(world_size=2, idle_spares=0) == 2
    assert p.grow_to(world_size=2, idle_spares=1) == 3
    assert p.grow_to(world_size=2, idle_spares=9) == 4


def test_bad_policy_and_config_fail_at_start() -> None:
    with pytest.raises(ValueError):
        ElasticPolicy(full_world_size=3, min_world_size=4)
    with pytest.raises(ValueError):
        ElasticPolicy(full_world_size=3, min_world_size=2, wait_s=-1)
    with pytest.raises(UsageError, match="--min-world-size"):
        JobConfig(script="x.py", nproc_per_node=2, elastic=ElasticConfig(min_world_size=3))
    with pytest.raises(UsageError, match="--elastic-wait"):
        JobConfig(script="x.py", elastic=ElasticConfig(wait_s=-1))
    with pytest.raises(UsageError, match="--shrink-batch must be one of keep, drop"):
        JobConfig(
            script="x.py", nproc_per_node=4, elastic=ElasticConfig(min_world_size=2, shrink_batch="halve")
        )
    with pytest.raises(UsageError, match=r"--shrink-batch drop .* --min-world-size"):
        JobConfig(
            script="x.py", nproc_per_node=4, elastic=ElasticConfig(shrink_batch="drop")
        )  # a job that never shrinks
    assert (
        JobConfig(
            script="x.py", nproc_per_node=4, elastic=ElasticConfig(min_world_size=2, shrink_batch="drop")
        ).min_world
        == 2
    )
    assert JobConfig(script="x.py", nproc_per_node=4).min_world == 4  # 0: never shrink
    assert JobConfig(script="x.py", nproc_per_node=4, elastic=ElasticConfig(min_world_size=2)).min_world == 2


def test_elastic_placement_never_starts_a_cold_process_on_another_node() -> None:
    """Rank 2's node is lost and no spare is left: elastic jobs leave it unplaced (to shrink);
    others start it cold on the least loaded node, as before. A rank whose own node lives is
    restarted there cold either way."""
    kw = {
        "failed": {2: "2", 1: "1"},
        "spares": {},
        "data_nodes": {},
        "live_nodes": ["0", "1"],
        "load": {"0": 1, "1": 0},
    }
    assert set(choose_replacements(**kw, cold_elsewhere=False)) == {1}  # type: ignore[arg-type]
    both = choose_replacements(**kw)  # type: ignore[arg-type]
    assert both[2].node in ("0", "1") and both[2].spare is None
    one_spare = {**kw, "failed": {2: "2"}, "spares": {7: "0"}}
    assert choose_replacements(**one_spare, cold_elsewhere=False)[2].spare == 7  # type: ignore[arg-type]


def test_status_says_when_the_job_is_shrunk() -> None:
    from nonstop.cli.status import format_status

    st = {
        "job_id": "j",
        "state": "running",
        "generation": 2,
        "world_size": 2,
        "num_shards": 3,
        "min_world_size": 2,
        "shards": {"0": [0], "1": [1, 2]},
        "ranks": {
            "0": {"node": "0", "spawn_id": 0, "pid": 1, "step": 9},
            "1": {"node": "1", "spawn_id": 1, "pid": 2, "step": 9},
        },
        "growing": {"to": 3, "boundary": 12},
    }
    text = format_status(st)
    assert "rank 1: node 1, spawn 1, pid 2, step 9, shards [1, 2]" in text
    assert "elastic: shrunk to 2 of 3 ranks (minimum 2)" in text
    assert "growing to 3 ranks at step 12" in text
    full = format_status({**st, "world_size": 3, "growing": None})
    assert "shards" not in full and "shrunk" not in full


def test_an_elastic_job_does_not_start_a_cold_process_elsewhere_for_a_node_to_avoid() -> None:
    """replace_elsewhere never moves a cold process to a node an elastic job keeps for its own
    ranks: with no spare the rank restarts cold on its own node (the one to avoid) or shrinks."""
    kw = {"failed": {1: "1"}, "spares": {}, "data_nodes": {}, "live_nodes": ["0", "1"]}
    kw["load"] = {"0": 1, "1": 0}
    placed = choose_replacements(**kw, cold_elsewhere=False, avoid={1: "1"})  # type: ignore[arg-type]
    assert placed[1].node == "1" and placed[1].spare is None
