"""Rescue snapshots with real processes (``--snapshot-every 5``): a failure between two snapshots
costs the survivors the step in flight only -- they write the state after the step they completed
and restore it, whether a spare replaces the lost rank (it takes a survivor's state) or the
survivors go on without it first (a shrink, then a grow), in a data-parallel job and in an HSDP
one (the donor holds the same shards in the other replica group). Final weights bitwise those of
an uninterrupted run; every sample read once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nonstop.demo.samples import check_sequence, read_log
from tests.conftest import NodesInBackground, events_named, run_demo_job, run_nodes_job, sampled_nodes_config
from tests.e2e.test_sharded_e2e import HSDP, shards

pytestmark = pytest.mark.slow

BATCH = 4
EVERY = 5
# long enough for a saturated 2-core machine: the survivors' reports of their rescues come in
WAIT_S = 30.0


def _run(job_dir: Path, steps: int, faults: tuple[str, ...], **kw: Any) -> list[dict[str, Any]]:
    config = sampled_nodes_config(
        job_dir, steps, faults, snapshot_every=EVERY, rescue_wait_s=WAIT_S, spares=1, **kw
    )
    result = NodesInBackground(config).result(timeout=300)
    assert result.error is None, result.error
    assert check_sequence(read_log(job_dir / "samples"), steps=steps, num_shards=4, batch=BATCH) == []
    return [json.loads(x) for x in (job_dir / "events.jsonl").read_text().splitlines()]


def _final_hash(job_dir: Path) -> str:
    return str(json.loads((job_dir / "result.json").read_text())["final_hash"])


def _reference(tmp_path: Path, steps: int, **kw: Any) -> str:
    """The uninterrupted run's (an elastic job sums its gradients exactly: give the same ``kw``)."""
    ref = run_nodes_job(tmp_path / "ref", nnodes=2, nproc=2, spares=0, steps=steps, **kw)
    assert ref.out is not None
    return str(ref.out["final_hash"])


def test_a_killed_rank_is_replaced_by_a_spare_that_takes_a_survivors_rescued_step(tmp_path: Path) -> None:
    steps = 20
    events = _run(tmp_path / "job", steps, ("kill:rank=1,step=8",), nnodes=2, nproc_per_node=2)
    (rec,) = events_named(events, "recovery")
    # killed at the start of step 8 (0-based): 8 steps done, the last snapshot was after 5
    assert rec["restore_step"] == 8 and rec["lost_steps"] == 0 and rec["redone_steps"] <= 1
    assert rec["replacement"] == "spare"
    assert _final_hash(tmp_path / "job") == _reference(tmp_path, steps)


def test_a_hung_rank_is_dropped_and_the_survivors_keep_their_step(tmp_path: Path) -> None:
    steps = 40
    faults = ("hang:rank=2,step=8",)
    events = _run(
        tmp_path / "job", steps, faults, nnodes=2, nproc_per_node=2, min_world_size=2, survivors="continue"
    )
    (failure,) = events_named(events, "failure")
    assert failure["kind"] == "hang"
    shrink, *_ = events_named(events, "shrink")
    assert shrink["shrink_first"] and shrink["dropped"] == [2]
    rec = events_named(events, "recovery")[0]
    assert rec["restore_step"] == 8 and rec["lost_steps"] == 0 and rec["redone_steps"] <= 1
    assert events_named(events, "grow_done")[-1]["world_size"] == 4
    assert _final_hash(tmp_path / "job") == _reference(tmp_path, steps, min_world_size=2)


def test_an_hsdp_rank_takes_the_rescued_shards_of_its_copy_in_the_other_replica_group(tmp_path: Path) -> None:
    """HSDP 2 x 2: rank 3 is killed between two snapshots; its spare restores rank 1's rescued
    step (the same shards, the other replica group), the survivors their own."""
    pace = ("--step-delay", "0.1")
    steps = 16
    run = run_demo_job(
        tmp_path / "job",
        steps=steps,
        faults=("kill:rank=3,step=8",),
        script_extra=pace,
        snapshot_every=EVERY,
        rescue_wait_s=WAIT_S,
        **HSDP,
    )
    (kill,) = run.result.failures
    assert (kill["rank"], kill["replacement"]) == (3, "spare")
    assert kill["restore_step"] == 8 and kill["lost_steps"] == 0 and kill["redone_steps"] <= 1
    ref = run_demo_job(tmp_path / "ref", steps=steps, spares=0, script_extra=pace, **HSDP)
    assert shards(run) == shards(ref)
