"""What elasticity reads (:class:`ElasticConfig`, ``config.elastic``: the coordinator's elastic
policy and survivors' choice, the workers' shards): validated alone (a bad value: one line naming
its flag); the checks that need the job's shape (``--min-world-size`` against the world size,
``--survivors continue`` and ``--shrink-batch drop`` against it and the mesh) are the job's
(:class:`~nonstop.config.job.JobConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.config.enums import ShrinkBatch, SurvivorMode, set_members
from nonstop.errors import UsageError

__all__ = ["ElasticConfig"]


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Elasticity (policy/elastic.py, policy/survivors.py).

    ``min_world_size``: shrink down to this many ranks when no spare is left (0: never shrink).
    ``wait_s``: wait this long for a spare before shrinking. ``survivors``: a failure spares could
    replace: auto | wait (replace first) | continue (shrink first, then grow with the spares).
    ``shrink_batch``: a shrunk job keeps the global batch (the lost ranks' shards played by the
    others; bitwise) or drops the lost ranks' shares of it until it grows back (torchft's).
    ``shards_per_rank``: data shards (micro-batches) a rank plays per step at full size."""

    min_world_size: int = 0
    wait_s: float = 0.0
    survivors: SurvivorMode = SurvivorMode.AUTO
    shrink_batch: ShrinkBatch = ShrinkBatch.KEEP
    shards_per_rank: int = 1

    def __post_init__(self) -> None:
        set_members(
            self,
            (("survivors", SurvivorMode, "--survivors"), ("shrink_batch", ShrinkBatch, "--shrink-batch")),
        )
        if self.wait_s < 0:
            raise UsageError(f"--elastic-wait must be >= 0 seconds (got {self.wait_s})")
        if isinstance(self.shards_per_rank, bool) or not 1 <= self.shards_per_rank <= 4096:
            raise UsageError(f"--shards-per-rank must be in 1..4096 (got {self.shards_per_rank})")
