"""Shrink first, with real processes (issue 18): on a failure a hot spare could take, the
survivors go on at once without the lost rank (its data shards played by the others), the spare
prepares in the background and joins at a step boundary (a grow). The final weights are bitwise
those of an uninterrupted run, every sample is read once, and no committed step is lost.

2 nodes x 2 ranks, one hot spare per node, ``--min-world-size 2 --survivors continue``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nonstop.demo.samples import check_sequence, read_log
from tests.conftest import NodesInBackground, events_named, run_nodes_job, sampled_nodes_config

pytestmark = pytest.mark.slow

BATCH = 4
WORLD = 4


def _config(job_dir: Path, steps: int, faults: tuple[str, ...], **kw: Any) -> Any:
    kw.setdefault("survivors", "continue")
    return sampled_nodes_config(
        job_dir, steps, faults, nproc_per_node=2, spares=1, nnodes=2, min_world_size=2, **kw
    )


def _reference(tmp_path: Path, steps: int) -> dict[str, Any]:
    ref = run_nodes_job(tmp_path / "ref", nnodes=2, nproc=2, spares=0, steps=steps, min_world_size=2)
    assert ref.out is not None
    return ref.out


def _run(config: Any) -> list[dict[str, Any]]:
    result = NodesInBackground(config).result(timeout=300)
    assert result.error is None, result.error
    return [json.loads(x) for x in (config.job_dir / "events.jsonl").read_text().splitlines()]


def _check_shrink_then_grow(
    events: list[dict[str, Any]], config: Any, steps: int, dropped: list[int], world: int = WORLD
) -> None:
    shrinks = events_named(events, "shrink")
    assert shrinks and all(s["shrink_first"] for s in shrinks), shrinks
    assert shrinks[0]["dropped"] == dropped
    grows = events_named(events, "grow_done")
    assert grows and grows[-1]["world_size"] == world
    # no spare took a rank in a recovery: every failure was recovered by a shrink
    assert all(r["replacement"] == "none" for r in events_named(events, "recovery"))
    assert all(r["lost_steps"] == 0 for r in events_named(events, "recovery"))
    # every recovery says how long the survivors went between two steps
    assert all(
        r["survivor_gap_s"] > 0 and r["survivor_gap_steps"] > 0 for r in events_named(events, "recovery")
    )
    assert grows[-1]["pause_ratio"] > 0
    records = read_log(config.job_dir / "samples")
    assert check_sequence(records, steps=steps, num_shards=WORLD, batch=BATCH) == []


def test_a_killed_rank_is_dropped_at_once_and_its_spare_joins_by_a_grow_bitwise(tmp_path: Path) -> None:
    steps = 40
    config = _config(tmp_path / "job", steps, ("kill:rank=1,step=8",))
    events = _run(config)
    _check_shrink_then_grow(events, config, steps, dropped=[1])
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["world_size"] == WORLD
    assert out["final_hash"] == _reference(tmp_path, steps)["final_hash"]


def test_a_hung_rank_is_dropped_at_once_and_its_spare_joins_by_a_grow_bitwise(tmp_path: Path) -> None:
    steps = 40
    config = _config(tmp_path / "job", steps, ("hang:rank=2,step=8",))
    events = _run(config)
    _check_shrink_then_grow(events, config, steps, dropped=[2])
    (failure,) = events_named(events, "failure")
    assert failure["kind"] == "hang"
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["world_size"] == WORLD
    assert out["final_hash"] == _reference(tmp_path, steps)["final_hash"]


def test_a_lost_node_shrinks_at_once_then_grows_with_the_spare_left(tmp_path: Path) -> None:
    """Node 1 (ranks 2, 3 and its spare) is lost: the survivors go on as 2 ranks at once, node 0's
    spare joins (3 ranks) and the job ends at 3 -- bitwise equal to the uninterrupted 4-rank run,
    since the gradient mean does not depend on the world size."""
    steps = 40
    config = _config(tmp_path / "job", steps, ("node:node=1,step=8",))
    events = _run(config)
    _check_shrink_then_grow(events, config, steps, dropped=[2, 3], world=3)
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["world_size"] == 3
    assert out["final_hash"] == _reference(tmp_path, steps)["final_hash"]


def test_a_second_failure_while_the_spare_restores_and_a_failure_of_the_spare(tmp_path: Path) -> None:
    """Rank 1 is killed: shrink to 3 and node 0's spare prepares (slowly: 3 s in its restore,
    which it then dies in: the spare itself fails). Meanwhile rank 2 is killed too: the grow is
    over, the survivors shrink again at once (2 ranks), and fresh spares grow the job back to 4."""
    steps = 100  # 60 once ended before the second grow, beside another test job (make test's 2 workers)
    faults = (
        "kill:rank=1,step=8",
        "slow:rank=3,step=0,seconds=3,at=prepare",
        "kill:rank=2,step=12",
    )
    config = _config(tmp_path / "job", steps, faults)
    events = _run(config)
    shrinks = events_named(events, "shrink")
    assert [s["world_size"] for s in shrinks][:2] == [3, 2], shrinks
    assert events_named(events, "grow_aborted"), "the second failure should end the first grow"
    assert events_named(events, "grow_done")[-1]["world_size"] == WORLD
    assert all(r["lost_steps"] == 0 for r in events_named(events, "recovery"))
    records = read_log(config.job_dir / "samples")
    assert check_sequence(records, steps=steps, num_shards=WORLD, batch=BATCH) == []
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["final_hash"] == _reference(tmp_path, steps)["final_hash"]


def test_a_spare_that_dies_while_it_prepares_is_replaced_and_the_grow_retried(tmp_path: Path) -> None:
    steps = 50
    config = _config(tmp_path / "job", steps, ("kill:rank=1,step=8", "kill:rank=3,step=0,at=prepare"))
    events = _run(config)
    _check_shrink_then_grow(events, config, steps, dropped=[1])
    assert events_named(events, "grow_aborted")
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["final_hash"] == _reference(tmp_path, steps)["final_hash"]
