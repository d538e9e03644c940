"""One copy per node of a DDP job's alike state (and of an HSDP job's replica groups', per shard
coordinate), in real jobs: real workers, real shared memory, real kills, real node loss. Recovery
reads the split snapshots (own part + the node's shared write) and ends bitwise where a job
keeping one copy per rank ends; a node replicates that state once, not once per rank."""

from __future__ import annotations

import os
import re
import statistics
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DemoRun, events_named, run_demo_job, run_nodes_job
from tests.test_sharded_e2e import shards

_SHARED = re.compile(r"-n(\d+)-s\d+$")

pytestmark = pytest.mark.slow


class _Peak(threading.Thread):
    """The most bytes the node's shared writes and its ranks' own slots held at one time."""

    def __init__(self, shm: Path) -> None:
        super().__init__(daemon=True)
        self.shm, self.done = shm, threading.Event()
        self.shared = self.own = 0
        self.groups: set[int] = set()  # the copy groups whose shared slots were seen

    def run(self) -> None:
        while not self.done.wait(0.02):
            shared = own = 0
            for p in self.shm.iterdir():
                try:
                    n = os.stat(p).st_blocks * 512
                except FileNotFoundError:
                    continue
                m = _SHARED.search(p.name)
                if m is not None:
                    shared += n
                    self.groups.add(int(m[1]))
                elif "-r" in p.name and "-s" in p.name:
                    own += n
            self.shared, self.own = max(self.shared, shared), max(self.own, own)


def _peaked_run(tmp_path: Path, faults: tuple[str, ...], **cfg: Any) -> tuple[DemoRun, _Peak]:
    """A demo job with a hot spare and ``faults``, its slots in a directory of its own, whose
    bytes a :class:`_Peak` watched while it ran."""
    shm = tmp_path / "shm"
    shm.mkdir()
    peak = _Peak(shm)
    peak.start()
    try:
        run = run_demo_job(
            tmp_path / "job",
            spares=1,
            faults=faults,
            shm_dir=shm,
            script_extra=("--step-delay", "0.05"),
            **cfg,
        )
    finally:
        peak.done.set()
        peak.join()
    return run, peak


def test_a_killed_rank_recovers_from_its_split_snapshot_bitwise(tmp_path: Path, reference_hash: str) -> None:
    run, peak = _peaked_run(tmp_path, ("kill:rank=1,step=8", "hang:rank=0,step=14"), nproc=3)
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference_hash  # the 3-rank job, one copy per rank, no fault
    assert [f["lost_steps"] for f in run.result.failures] == [0, 0]
    gens = [g for g in events_named(run.events, "generation") if g["cause"]]
    assert all(g["tier"] == "memory" for g in gens)
    # the node held its ranks' parameters and optimizer state once: its 3 ranks' own slots
    # (RNG, buffers, data position) are smaller than one shared write
    assert peak.shared > 0 and peak.own < peak.shared, (peak.shared, peak.own)


def _per_round(events: list[dict[str, Any]]) -> float:
    """A replication round's bytes before encoding, the median over the job's rounds."""
    done = [e for e in events_named(events, "replicated") if e.get("raw_bytes")]
    assert done
    return statistics.median(float(e["raw_bytes"]) for e in done)


def test_a_lost_node_recovers_from_replicas_sent_once_per_node_bitwise(tmp_path: Path) -> None:
    common = dict(nnodes=2, nproc=2, spares=1, replicas=1)
    whole = run_nodes_job(tmp_path / "rank", snapshot_copies="rank", **common)
    assert whole.out is not None, whole.result.error
    run = run_nodes_job(tmp_path / "node", faults=("node:node=1,step=12",), **common)
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == whole.out["final_hash"]
    assert [(f["kind"], f["lost_steps"]) for f in run.result.failures] == [("node", 0)] * 2  # its 2 ranks
    gen = next(g for g in events_named(run.events, "generation") if g["cause"])
    assert gen["tier"] == "memory"
    assert any(v.endswith(":replica") for v in gen["fetches"].values())

    # two ranks per node: the shared write once and two own parts, against two whole snapshots
    assert _per_round(run.events) < 0.75 * _per_round(whole.events)


def test_an_hsdp_node_s_replicas_take_the_shards_from_the_twin_node_and_recover_bitwise(
    tmp_path: Path,
) -> None:
    """HSDP 2x2 over 2 nodes, a replica group each: node 1's ranks hold node 0's shards, bitwise.
    Each node's replicas go to its twin, which takes the shards from its own ranks' memory: only
    the ranks' own parts travel. Node 1 lost: its ranks restore from the replicas node 0 holds,
    and the job ends bitwise where one keeping a whole copy per rank ends."""
    common = dict(nnodes=2, nproc=2, spares=1, replicas=1, mesh="replicate=2,shard=2", steps=14)
    whole = run_nodes_job(tmp_path / "rank", snapshot_copies="rank", **common)
    run = run_nodes_job(tmp_path / "node", faults=("node:node=1,step=9",), **common)
    assert shards(run) == shards(whole)
    assert [(f["kind"], f["lost_steps"]) for f in run.result.failures] == [("node", 0)] * 2
    gen = next(g for g in events_named(run.events, "generation") if g["cause"])
    assert gen["tier"] == "memory" and any(v.endswith(":replica") for v in gen["fetches"].values())
    # the shards stayed home: a round sends the ranks' own parts (RNG, data position) alone
    assert _per_round(run.events) < 0.25 * _per_round(whole.events)


def test_hsdp_replica_groups_on_one_node_keep_each_shard_once_and_recover_bitwise(tmp_path: Path) -> None:
    """HSDP 2x2 on one node of 4 ranks: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1,
    bitwise alike after every step; the node keeps each shard's parameters and optimizer state
    once (copy groups 0 and 1). A killed rank and a hung one restore from their split
    snapshots -- the killed one from the shared write its twin may have copied -- and the job
    ends bitwise where the uninterrupted one does."""
    hsdp = dict(mesh="replicate=2,shard=2", nproc=4, steps=14)
    reference = run_demo_job(tmp_path / "reference", spares=0, snapshot_copies="rank", **hsdp)
    run, peak = _peaked_run(tmp_path, ("kill:rank=2,step=5", "hang:rank=1,step=10"), **hsdp)
    assert shards(run) == shards(reference)
    assert shards(run)[0] == shards(run)[2] and shards(run)[1] == shards(run)[3]  # twins, bitwise
    failures = [(f["kind"], f["rank"], f["lost_steps"]) for f in run.result.failures]
    assert failures == [("kill", 2, 0), ("hang", 1, 0)]
    assert all(g["tier"] == "memory" for g in events_named(run.events, "generation") if g["cause"])
    assert peak.groups == {0, 1}
    # each shard once: 4 ranks' own slots (RNG, data position) are smaller than the shared writes
    assert peak.shared > 0 and peak.own < peak.shared, (peak.shared, peak.own)
