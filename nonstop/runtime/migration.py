"""Live migration: move a rank to another node while the job trains (``nonstop migrate``,
``nonstop drain``, preemption notices).

The stages, driven by the coordinator (``Coordinator._migrate_tick`` and friends):

1. **prepare** -- a hot spare on the target node (the *joiner*) is chosen; the target node gets the
   rank's newest committed snapshot ``P`` into its memory (copied from a replica it holds, or
   fetched from the leaver's node over the data plane); the joiner is told its rank and restores
   ``P``: the script builds its model and optimizer, and every buffer is allocated and filled,
   while the other ranks keep training;
2. **pause** -- the coordinator picks a boundary step ``S`` a few steps ahead of the newest step
   reported; every rank stops after completing step ``S`` (its snapshot complete) and says so;
3. **swap** -- a new generation: the leaver leaves the membership (and is stopped), the target
   node fetches the leaver's snapshot of ``S`` (the steps the joiner missed), the joiner restores
   it, the others keep their own state of ``S``, the process group is rebuilt with the joiner in
   the rank, and every rank continues from ``S``. Nothing is rolled back.

If the leaver (or any member) fails during a migration, the migration is aborted (the joiner is
stopped) and ordinary recovery runs. If the joiner dies, the migration is aborted and paused
ranks are told to continue in the same process group.

This module holds the record of a migration and the pure decisions; the coordinator does the I/O.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Migration", "MigrationPhase", "boundary_step", "choose_joiner", "choose_target"]

BOUNDARY_MARGIN = 3  # steps ahead of the newest reported step: no rank has started it yet


class MigrationPhase(enum.StrEnum):
    PREPARE = "prepare"  # fetch the snapshot to the target node, joiner restores it
    PAUSE = "pause"  # every rank runs to the boundary step and stops
    SWAP = "swap"  # the new generation with the joiner in the rank
    DONE = "done"
    ABORTED = "aborted"


@dataclass
class Migration:
    """One rank's move from ``leaver_node`` to ``target`` (see the module docstring)."""

    rank: int
    target: str
    leaver_sid: int
    leaver_node: str
    joiner_sid: int
    reason: str  # "migrate", "drain", "preempt"
    phase: MigrationPhase = MigrationPhase.PREPARE
    prepare_step: int | None = None  # P: what the joiner restores while the job trains
    boundary: int | None = None  # S: where every rank stops and the swap happens
    generation: int | None = None  # the generation of the swap
    paused: dict[int, int] = field(default_factory=dict)  # rank -> step it stopped at
    fetch_req: int | None = None
    gaps: dict[int, float] = field(default_factory=dict)  # rank -> seconds between its steps S and S+1
    marks: dict[str, float] = field(default_factory=lambda: {"start": time.time()})
    error: str | None = None

    def mark(self, name: str) -> None:
        self.marks[name] = time.time()

    def stage_seconds(self) -> dict[str, float]:
        """Seconds between consecutive marks, named by the later mark."""
        order = sorted(self.marks.items(), key=lambda kv: kv[1])
        return {b[0]: round(b[1] - a[1], 4) for a, b in itertools.pairwise(order)}


def choose_joiner(target: str, idle_spares: Mapping[int, str]) -> int | None:
    """The spare (spawn id) on ``target`` that becomes the rank; None when it has none.
    Deterministic: the oldest (lowest spawn id) spare there."""
    on_target = sorted(sid for sid, node in idle_spares.items() if node == target)
    return on_target[0] if on_target else None


def choose_target(
    leaver_node: str,
    idle_spares: Mapping[int, str],
    live_nodes: Sequence[str],
    domains: Mapping[str, str],
    load: Mapping[str, int],
) -> str | None:
    """Where to move a rank off ``leaver_node`` (drain, preemption): a live node with an idle
    spare, preferring another failure domain, then the least loaded; None when no node can
    take it (the caller then waits, or lets ordinary recovery handle the rank)."""
    spare_nodes = {node for node in idle_spares.values()}
    candidates = [n for n in live_nodes if n != leaver_node and n in spare_nodes]
    if not candidates:
        return None
    home = domains.get(leaver_node, leaver_node)

    def key(n: str) -> tuple[int, int, str]:
        return (int(domains.get(n, n) == home), load.get(n, 0), n)

    return min(candidates, key=key)


def boundary_step(latest: Mapping[int, int], margin: int = BOUNDARY_MARGIN) -> int:
    """The step every rank stops after: ``margin`` beyond the newest step any rank reported,
    so that none has begun it when the pause request arrives."""
    return max(latest.values(), default=0) + margin
