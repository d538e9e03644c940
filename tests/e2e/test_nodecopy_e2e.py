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
    # bytes per round are compared between two 2-node runs: a long lease, so a saturated machine
    # starving a node agent for seconds does not lose a node (and with it every peer replica)
    common = dict(nnodes=2, nproc=2, spares=1, replicas=1, lease_ttl_s=10.0)
    whole = run_nodes_job(tmp_path / "rank", snapshot_copies="rank", **common)
    assert whole.out is not None, whole.result.error
    run = run_nodes_job(tmp_path / "node", faults=("node:node=1,step=12",), **common)
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == whole.out["final_hash"]
    kinds = [(f["kind"], f["lost_steps"]) for f in run.result.failures]
    assert kinds == [("node", 0)] * 2, run.result.failures  # its 2 ranks
    gen = next(g for g in events_named(run.events, "generation") if g["cause"])
    assert gen["tier"] == "memory"
    assert any(v.endswith(":replica") for v in gen["fetches"].values())

    # two ranks per node: the shared write once and two own parts, against two whole snapshots;
    # and where the holder's own ranks had written the step (they hold the same state), not even
    # that: the own parts alone
    assert _per_round(run.events) < 0.75 * _per_round(whole.events)
    rounds = [float(e["raw_bytes"]) for e in events_named(run.events, "replicated") if e.get("raw_bytes")]
    assert min(rounds) < 0.1 * _per_round(whole.events), rounds
