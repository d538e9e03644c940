"""Elastic data parallelism: shrink when a rank cannot be replaced, grow back when capacity returns.

The job's data-parallel width is fixed at start: ``num_shards`` = the world size it was started
with times ``--shards-per-rank`` M (default 1). A **shard** is one micro-batch of the global
batch: at step ``s`` shard ``k`` reads the samples ``(s * num_shards + k) * batch ...``; at full
size rank ``r`` plays shards ``r*M .. r*M+M-1`` (M micro-batches by gradient accumulation).
With M > 1 a lost rank's shards spread over more survivors: a step of the shrunk job takes
``ceil(W0*M / W') / M`` of the full job's, not twice as long. When the world is smaller, each rank
plays several shards by gradient accumulation (one micro-batch per shard, the gradient summed
locally, allreduced once, and divided by ``num_shards``), so the global batch, the learning
dynamics and the sample order stay those of the full-size job. No sample is skipped or read twice.

``--shrink-batch drop`` trades that for speed, as torchft does: a shrunk job of ``W'`` ranks plays
only the first ``W'`` blocks of the full job's shards (each rank its own M micro-batches) and the
gradient mean is over the shards played, so a step takes as long as at full size and the job
trains at ``W' / W0`` of its samples per step until it grows back; the shards of the blocks beyond
``W'`` are skipped in those steps (:func:`play_shards`). Keep (the default) is the one whose
final weights an uninterrupted run's equal bit for bit.

How the coordinator uses this module (``Coordinator._begin_generation``, ``_grow_tick``):

* **shrink** -- a failed rank that no hot spare can take (its node is lost, and cold processes
  are not started on other nodes: a node has room for its own ranks only) is either waited for
  (``ElasticPolicy.wait_s``, a spare may come: a node joining) or dropped. The survivors are
  renumbered ``0..W'-1`` in their old order (:func:`renumber`), each restores the newest step all
  survivors hold from its own memory (a data-parallel rank's snapshot reflects every shard's
  gradient up to its step: nothing is rolled back beyond the step in flight), and the shards are
  spread over them (:func:`assign_shards`).
* **grow** -- while the world is below ``num_shards`` and idle spares exist (a node joined), the
  spares first restore rank 0's committed step and warm up while the job trains (as a migration's
  joiner does); then every rank stops after a boundary step (the live-migration pause), the spares
  fetch that step from rank 0's memory and join as new ranks; nothing is rolled back.

Everything here is pure (no I/O, no clock): the simulator can use the same decisions.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ElasticAction",
    "ElasticDecision",
    "ElasticPolicy",
    "assign_shards",
    "play_shards",
    "played",
    "renumber",
    "resume_sources",
]


def assign_shards(num_shards: int, world_size: int) -> tuple[tuple[int, ...], ...]:
    """The shards each rank ``0..world_size-1`` plays: contiguous, balanced, every shard once.

    ``assign_shards(4, 4) == ((0,), (1,), (2,), (3,))``; ``assign_shards(3, 2) == ((0,), (1, 2))``.
    """
    if not 1 <= world_size <= num_shards:
        raise ValueError(f"world size must be in 1..{num_shards} (got {world_size})")
    return tuple(
        tuple(range(r * num_shards // world_size, (r + 1) * num_shards // world_size))
        for r in range(world_size)
    )


def play_shards(
    num_shards: int, full_world_size: int, world_size: int, *, drop: bool = False
) -> tuple[tuple[int, ...], ...]:
    """The shards each rank of a generation of ``world_size`` ranks plays, in a job of
    ``num_shards`` shards started with ``full_world_size`` ranks. Keep (``drop`` False): every
    shard, spread over the ranks (:func:`assign_shards`). Drop (``--shrink-batch drop``): rank
    ``r`` plays the full job's rank ``r``'s block and the blocks beyond ``world_size`` are not
    played -- a step's batch is ``world_size / full_world_size`` of the full one. Either way the
    ranks' blocks are contiguous and in rank order, from shard 0 (what the exact gradient mean
    needs: its shard count is the shards played, ``sum(map(len, ...))``)."""
    if not drop or world_size >= full_world_size:
        return assign_shards(num_shards, world_size)
    if world_size < 1:
        raise ValueError(f"world size must be in 1..{full_world_size} (got {world_size})")
    return assign_shards(num_shards, full_world_size)[:world_size]


def played(shards: Sequence[Sequence[int]]) -> int:
    """The distinct data shards a generation plays, from each rank's (``play_shards``,
    ``MeshSpec.data_shards``; the ranks of a TP group play the same ones): the gradient mean's
    divisor, and what a step trains."""
    return len({k for mine in shards for k in mine})


def resume_sources(checkpoint_world: int, world_size: int) -> dict[int, int]:
    """rank -> the checkpoint rank it restores, when a job of ``world_size`` ranks restores a
    checkpoint written by ``checkpoint_world`` ranks (a job that shrank, persisted, and is resumed
    or recovers at another size). The ranks of a data-parallel job are replicas: rank ``r`` takes
    the checkpoint's rank ``r`` where there is one, the ranks beyond take rank 0's (as a grow's new
    ranks do). The shards each rank plays follow from the step and :func:`assign_shards`."""
    if checkpoint_world < 1 or world_size < 1:
        raise ValueError(f"world sizes must be >= 1 (got {checkpoint_world} and {world_size})")
    return {r: r if r < checkpoint_world else 0 for r in range(world_size)}


def renumber(ranks: Sequence[int]) -> dict[int, int]:
    """old rank -> new rank for the ranks that stay, in their old order (``0..len-1``)."""
    return {old: new for new, old in enumerate(sorted(set(ranks)))}


class ElasticAction(enum.StrEnum):
    REPLACE = "replace"  # every failed rank has a process: the world size stays
    WAIT = "wait"  # keep the job stopped a while: a spare may appear
    SHRINK = "shrink"  # go on without the ranks nobody can play
    FAIL = "fail"  # fewer ranks than the job allows: give up


@dataclass(frozen=True, kw_only=True)
class ElasticDecision:
    action: ElasticAction
    world_size: int  # the world size of the next generation
    wait_s: float = 0.0  # WAIT: how much longer to wait before deciding again
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ElasticPolicy:
    """When ranks cannot be replaced: wait up to ``wait_s`` for a spare, then shrink, never
    below ``min_world_size``. ``min_world_size`` equal to the full world size turns shrinking
    off (a rank that cannot be replaced fails the job after the wait, as it would without
    elasticity). Grows back to ``full_world_size`` as soon as spares are idle.

    ``unit``: the ranks that come and go together (1 for data parallelism; a sharded job's
    replica group, ``shard x tp``, see :mod:`nonstop.mesh`): world sizes are multiples of it, a
    grow waits for a whole unit of idle spares."""

    full_world_size: int
    min_world_size: int
    wait_s: float = 0.0
    unit: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_world_size <= self.full_world_size:
            raise ValueError(
                f"the minimum world size must be in 1..{self.full_world_size} (got {self.min_world_size})"
            )
        if self.wait_s < 0:
            raise ValueError(f"the wait for a spare must be >= 0 seconds (got {self.wait_s})")
        if self.unit < 1 or self.full_world_size % self.unit or self.min_world_size % self.unit:
            raise ValueError(
                f"world sizes {self.min_world_size}..{self.full_world_size} are not whole units "
                f"of {self.unit} ranks"
            )

    @property
    def enabled(self) -> bool:
        return self.min_world_size < self.full_world_size

    def on_unplaced(self, *, world_size: int, unplaced: int, waited_s: float) -> ElasticDecision:
        """``unplaced`` failed ranks have no process to play them, ``waited_s`` after the failure."""
        if unplaced <= 0:
            return ElasticDecision(action=ElasticAction.REPLACE, world_size=world_size)
        if waited_s < self.wait_s:
            return ElasticDecision(
                action=ElasticAction.WAIT,
                world_size=world_size,
                wait_s=self.wait_s - waited_s,
                reason=f"waiting up to {self.wait_s:g}s for a spare",
            )
        smaller = world_size - unplaced
        if smaller < self.min_world_size:
            return ElasticDecision(
                action=ElasticAction.FAIL,
                world_size=world_size,
                reason=(
                    f"{unplaced} rank(s) have no spare and shrinking to {smaller} would go below the "
                    f"minimum world size {self.min_world_size} (--min-world-size)"
                ),
            )
        return ElasticDecision(
            action=ElasticAction.SHRINK,
            world_size=smaller,
            reason=f"no spare for {unplaced} rank(s) after {waited_s:.2f}s",
        )

    def grow_to(self, *, world_size: int, idle_spares: int) -> int:
        """The world size to grow to now (``world_size`` itself: do not grow)."""
        if not self.enabled:
            return world_size
        more = max(0, idle_spares) // self.unit * self.unit
        return min(self.full_world_size, world_size + more)
