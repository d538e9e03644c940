"""Read back the demo's ``--samples-log``: which samples a run trained on, step by step.

Each training process appends one JSON line per micro-batch as it starts it (a rank killed just
after its backward's collective still counts in that step): ``{gen, step, shard, first, n, t}``
(generation, optimizer step, data shard, first sample index, sample count, wall time). A step
interrupted by a failure is redone by a later generation, after every rank rolled back to a step
before it; only the last generation that ran a step counts. :func:`check_sequence` is the proof
used by the elastic tests and benchmark: the samples of every step are exactly those of an
uninterrupted run of the full-size job (every shard once, every sample once, in order).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nonstop.train.session import Session

__all__ = ["MicroBatch", "SamplesLog", "check_sequence", "effective_samples", "read_log"]


@dataclass(frozen=True)
class MicroBatch:
    process: str  # the log file (one per process)
    gen: int
    step: int
    shard: int
    first: int
    n: int
    t: float


class SamplesLog:
    """The writing side: one file per process in ``samples_dir``, a line per micro-batch."""

    def __init__(self, samples_dir: Path, *, batch: int) -> None:
        samples_dir.mkdir(parents=True, exist_ok=True)
        self.batch = batch
        self._f = (samples_dir / f"samples-{os.getpid()}.jsonl").open("a")

    def record(self, session: Session, step: int, shard: int) -> None:
        """Shard ``shard`` of step ``step`` holds samples ``(step * num_shards + shard) * batch ...``."""
        first = (step * session.num_shards + shard) * self.batch
        gen = session.generation
        rec = {"gen": gen, "step": step, "shard": shard, "first": first, "n": self.batch, "t": time.time()}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()


def read_log(samples_dir: Path) -> list[MicroBatch]:
    out = []
    for path in sorted(samples_dir.glob("samples-*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.append(
                MicroBatch(path.name, r["gen"], r["step"], r["shard"], r["first"], r["n"], r.get("t", 0.0))
            )
    return out


def effective_samples(records: list[MicroBatch]) -> dict[int, list[MicroBatch]]:
    """step -> the micro-batches of the last generation that ran that step, by shard."""
    by_step: dict[int, dict[int, list[MicroBatch]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_step[r.step][r.gen].append(r)
    return {step: sorted(gens[max(gens)], key=lambda r: r.shard) for step, gens in sorted(by_step.items())}


def check_sequence(
    records: list[MicroBatch], *, steps: int, num_shards: int, batch: int, dropped: bool = False
) -> list[str]:
    """What differs from an uninterrupted run's sample sequence (empty: identical). ``dropped``
    (``--shrink-batch drop``): a step may train only the first shards of its batch (a shrunk
    job's), each still the samples it holds in the uninterrupted run, none twice."""
    problems = []
    seen = effective_samples(records)
    if sorted(seen) != list(range(steps)):
        problems.append(f"steps run: {sorted(seen)[:5]}... ({len(seen)}), expected 0..{steps - 1}")
    for step, recs in seen.items():
        shards = [r.shard for r in recs]
        n = len(shards) if dropped and 0 < len(shards) <= num_shards else num_shards
        if shards != list(range(n)):
            problems.append(f"step {step}: shards {shards}, expected each of 0..{n - 1} once")
        firsts = [r.first for r in recs]
        if firsts != [(step * num_shards + k) * batch for k in range(len(recs))]:
            problems.append(f"step {step}: samples from {firsts}")
    flat = sorted(r.first + i for recs in seen.values() for r in recs for i in range(r.n))
    if not dropped and flat != list(range(steps * num_shards * batch)):
        problems.append("the samples trained on are not each sample of the run exactly once")
    return problems
