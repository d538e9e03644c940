"""Elasticity with real processes: a node is lost and no spare is left anywhere.

* ``--elastic-wait`` long enough: the job waits, the node comes back (its processes wait as
  spares), the rank is placed on it, and the result is bitwise equal to an uninterrupted run.
* ``--elastic-wait 0``: the job shrinks at once to 2 ranks (one plays 2 data shards by gradient
  accumulation), then grows back to 3 when the node comes back. The samples consumed, step by
  step, are exactly those of an uninterrupted run (every sample once), and the final weights are
  bitwise those of an uninterrupted elastic run (the gradient mean does not depend on the world
  size: ``nonstop.train.exactsum``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nonstop.demo.samples import check_sequence, effective_samples, read_log
from nonstop.errors import UsageError
from nonstop.launch.jobfiles import load_resume
from nonstop.snapshot.durable import DurableStore
from tests.conftest import (
    SHRUNK_STEP_DELAY,
    NodesInBackground,
    events_named,
    run_nodes_job,
    sampled_nodes_config,
)

pytestmark = pytest.mark.slow

BATCH = 4


def _config(job_dir: Path, steps: int, faults: tuple[str, ...], **kw: Any) -> Any:
    return sampled_nodes_config(job_dir, steps, faults, nproc_per_node=1, spares=0, nnodes=3, **kw)


def _run_with_rejoin(config: Any, event: str) -> list[dict[str, Any]]:
    """Run the job; start node 2 again (a node joining the running job) once ``event`` is logged;
    the job's events."""
    job = NodesInBackground(config)
    job.wait_event(event, timeout=120)
    job.start_node(2)
    result = job.result(timeout=300)
    assert result.error is None, result.error
    return job.events()


def test_waits_for_a_spare_then_replaces_bitwise(tmp_path: Path) -> None:
    steps = 40
    config = _config(tmp_path / "job", steps, ("node:node=2,step=6",), min_world_size=2, elastic_wait_s=60.0)
    events = _run_with_rejoin(config, "elastic_wait")
    assert events_named(events, "shrink") == []
    (wait,) = events_named(events, "elastic_wait")
    assert wait["ranks"] == [2]
    out = json.loads((config.job_dir / "result.json").read_text())
    # an elastic job's gradient mean (exactsum) is its own: the reference is elastic too
    ref = run_nodes_job(tmp_path / "ref", nnodes=3, spares=0, steps=steps, min_world_size=2)
    assert ref.out is not None
    assert out["world_size"] == 3 and out["final_hash"] == ref.out["final_hash"]


def test_shrink_then_grow_reads_every_sample_once(tmp_path: Path) -> None:
    steps = 80
    config = _config(
        tmp_path / "job", steps, ("node:node=2,step=6",), min_world_size=2, script_more=SHRUNK_STEP_DELAY
    )
    events = _run_with_rejoin(config, "shrink")
    (shrink,) = events_named(events, "shrink")
    assert shrink["world_size"] == 2 and shrink["dropped"] == [2]
    assert sorted(map(tuple, shrink["shards"].values())) == [(0,), (1, 2)]
    (grown,) = events_named(events, "grow_done")
    assert grown["world_size"] == 3
    (grow,) = events_named(events, "grow")
    shrunk_gen = next(g for g in events_named(events, "generation") if g["cause"] == [2])
    # no step rolled back beyond the one in flight at the loss, none at the grow
    assert shrunk_gen["restore_step"] >= 5
    grow_gen = next(g for g in events_named(events, "generation") if g.get("grow"))
    assert grow_gen["restore_step"] == grow["boundary"] > shrunk_gen["restore_step"]

    # The proof: for every step, the samples trained on (in the generation that counts) are
    # shards 0, 1, 2 of the global batch, each once -- the uninterrupted run's sequence.
    records = read_log(config.job_dir / "samples")
    assert check_sequence(records, steps=steps, num_shards=3, batch=BATCH) == []
    seen = effective_samples(records)
    assert [r.shard for r in seen[steps - 1]] == [0, 1, 2]
    # while shrunk, one process trained two shards in each step (gradient accumulation)
    doubled = _shards_per_process(config.job_dir / "samples", shrunk_gen["generation"])
    assert sorted(doubled.values()) == [[0], [1, 2]], doubled

    out = json.loads((config.job_dir / "result.json").read_text())
    ref = run_nodes_job(tmp_path / "ref", nnodes=3, spares=0, steps=steps, min_world_size=2)
    assert ref.out is not None and out["world_size"] == 3
    assert out["samples_seen"] == ref.out["samples_seen"] == steps * 3 * BATCH
    # same global batch, same samples, the shards summed in one order at every size: bitwise
    assert out["final_hash"] == ref.out["final_hash"]


def test_drop_shrink_skips_the_lost_share_then_grows_back(tmp_path: Path) -> None:
    """``--shrink-batch drop`` (torchft's semantics): shrunk, each survivor plays only its own
    shard and the lost rank's is skipped -- every step of the shrunk generation trains shards 0
    and 1 of its batch, each the samples it holds in an uninterrupted run, and the gradient mean
    is over those 2 (the samples the script counts, ``batch x session.shards_played``, say so)."""
    steps = 60
    config = _config(
        tmp_path / "job",
        steps,
        ("node:node=2,step=6",),
        min_world_size=2,
        shrink_batch="drop",
        script_more=SHRUNK_STEP_DELAY,
    )
    events = _run_with_rejoin(config, "shrink")
    (shrink,) = events_named(events, "shrink")
    assert shrink["world_size"] == 2 and shrink["shards"] == {"0": [0], "1": [1]}
    (grown,) = events_named(events, "grow_done")
    assert grown["world_size"] == 3
    shrunk_gen = next(g for g in events_named(events, "generation") if g["cause"] == [2])
    grow_gen = next(g for g in events_named(events, "generation") if g.get("grow"))

    records = read_log(config.job_dir / "samples")
    assert check_sequence(records, steps=steps, num_shards=3, batch=BATCH, dropped=True) == []
    seen = effective_samples(records)
    short = [step for step, recs in seen.items() if len(recs) == 2]
    # the steps trained shrunk (from the one in flight at the loss to the grow's boundary) skip
    # shard 2; every other step trains all three
    assert short == list(range(shrunk_gen["restore_step"], grow_gen["restore_step"])) != []
    assert all(len(seen[step]) == 3 for step in seen if step not in short)
    assert sorted(_shards_per_process(config.job_dir / "samples", shrunk_gen["generation"]).values()) == [
        [0],
        [1],
    ]
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["world_size"] == 3 and out["samples_seen"] == (steps * 3 - len(short)) * BATCH


def _shards_per_process(samples_dir: Path, gen: int) -> dict[str, list[int]]:
    """Log file (one per process) -> the shards that process trained on in generation ``gen``."""
    out: dict[str, set[int]] = {}
    for r in read_log(samples_dir):
        if r.gen == gen:
            out.setdefault(r.process, set()).add(r.shard)
    return {k: sorted(v) for k, v in out.items()}


def test_shrink_renumbers_the_ranks_after_the_lost_one(tmp_path: Path) -> None:
    """Node 1 (rank 1) is lost and never comes back: rank 2 becomes rank 1, restoring from its old
    number's memory, and the job ends on 2 ranks with every sample read once. Each rank plays 2
    shards at full size (``--shards-per-rank 2``): shrunk, each plays 3 of the 6."""
    steps = 24
    config = _config(tmp_path / "job", steps, ("node:node=1,step=6",), min_world_size=2, shards_per_rank=2)
    result = NodesInBackground(config).result(timeout=300)
    assert result.error is None, result.error
    events = [json.loads(x) for x in (config.job_dir / "events.jsonl").read_text().splitlines()]
    (shrink,) = events_named(events, "shrink")
    assert shrink["dropped"] == [1] and shrink["renumbered"] == {"2": 1}
    assert shrink["shards"] == {"0": [0, 1, 2], "1": [3, 4, 5]}
    gen = next(g for g in events_named(events, "generation") if g["cause"] == [1])
    assert gen["fetches"] == {} and gen["nodes"] == {"0": "0", "1": "2"}
    records = read_log(config.job_dir / "samples")
    assert check_sequence(records, steps=steps, num_shards=6, batch=BATCH) == []
    out = json.loads((config.job_dir / "result.json").read_text())
    assert out["world_size"] == 2 and out["samples_seen"] == steps * 6 * BATCH
    # the nodes persisted the final step of the shrunk job: a checkpoint of its 2 ranks
    ckpt = str(config.job_dir / "checkpoints")
    assert DurableStore(ckpt).latest_step() == steps and DurableStore(ckpt).world_size_at(steps) == 2

    # Resumed at full size: a job that is not elastic is refused at start, with what to do ...
    more = steps + 8
    with pytest.raises(UsageError, match=r"has 2 ranks but this job has 3.*--min-world-size"):
        load_resume(_config(tmp_path / "refused", more, (), resume=ckpt, shards_per_rank=2))
    # ... an elastic one plays all 3 ranks (rank 2 from the checkpoint's rank 0) and reads on in order
    again = _config(tmp_path / "again", more, (), resume=ckpt, min_world_size=2, shards_per_rank=2)
    result = NodesInBackground(again).result(timeout=300)
    assert result.error is None, result.error
    events = [json.loads(x) for x in (again.job_dir / "events.jsonl").read_text().splitlines()]
    (resumed,) = events_named(events, "resume")
    assert resumed["step"] == steps and resumed["checkpoint_world_size"] == 2 and resumed["world_size"] == 3
    out = json.loads((again.job_dir / "result.json").read_text())
    assert out["world_size"] == 3 and out["samples_seen"] == more * 6 * BATCH
    records += read_log(again.job_dir / "samples")
    assert check_sequence(records, steps=more, num_shards=6, batch=BATCH) == []
