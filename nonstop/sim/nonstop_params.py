"""nonstop's knobs in the simulator (:class:`NonstopParams`): each the runtime's flag of the same
name, validated when made (a bad setting fails before any simulation runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nonstop.config import SHRINK_BATCHES
from nonstop.policy.cadence import DEFAULT_BUDGET, MAX_AGE_S, choose_every
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.straggler import StragglerConfig
from nonstop.policy.survivors import SurvivorMode
from nonstop.sim.api import require
from nonstop.sim.proactivesim import PROACTIVE

__all__ = ["NonstopParams"]


@dataclass(frozen=True, kw_only=True)
class NonstopParams:
    """nonstop's knobs. ``None`` = derived from the calibration (see ``Nonstop.describe()``).

    snapshot_every: steps between in-memory snapshots. snapshot_budget: the runtime's
    ``--snapshot-budget`` (> 0: the interval is the smallest K >= snapshot_every whose stall costs
    at most this fraction of the step, :func:`~nonstop.policy.cadence.choose_every`, as the
    runtime's coordinator tunes it; never more steps than take ``snapshot_max_age_s``, the runtime's
    ``--snapshot-max-age``). stall_s: loop stall per snapshot.
    replicas: peer replicas of each node's snapshots (r). spares_per_node: pre-warmed process
    spares on every node. spare_nodes: hot spare nodes (None: 1% of the job's nodes, at least 1).
    persist_every_s: seconds of training between durable checkpoints. quarantine: the runtime's
    policy. migration_pause_s: the pause of a live migration. min_world_size: elastic (the
    runtime's ``--min-world-size``): when a lost node's ranks have no hot spare, go on with fewer
    data-parallel ranks (GPUs), never fewer than this, until a fresh node joins; 0 (or the job's
    GPU count) never shrinks: the job waits for the pool node. elastic_wait_s: the runtime's
    ``--elastic-wait``: wait this long for the pool node before shrinking. shards_per_rank: the
    runtime's ``--shards-per-rank`` M (micro-batches per rank and step at full size): a shrunk
    step takes ``max(len(shards)) / M`` of a full one. shrink_batch: the runtime's
    ``--shrink-batch``: ``keep`` (the lost ranks' shards played by the others) or ``drop`` (they
    are skipped: a shrunk step is as fast as a full one and trains ``W' / W`` of the samples,
    torchft's semantics). survivors: the runtime's ``--survivors``
    (``auto``: :func:`~nonstop.policy.survivors.choose` decides per failure; ``wait``: replace
    first; ``continue``: shrink first wherever the job may shrink); only an elastic job shrinks.
    replica_nodes: the job is HSDP over replica groups of this many nodes (the runtime's ``--mesh
    replicate=R,shard=S``, a shard group per replica group); a live migration or a grow then
    builds only the groups with the moved node's ranks in them (:meth:`MeshSpec.changed_groups`,
    the runtime's ``train/meshgroups.py``), a failure the same with ``keep_on_failure`` (the
    default, as the runtime does: ``train/settle.py``, on NCCL ``train/devicegroups.py``, whose
    unbound world costs no communicator), else every group; 0: data-parallel, one group of the
    whole job; None (the default): the job torchft-like models, model copies of
    :data:`~nonstop.sim.strategies.DEFAULT_GROUP_NODES` nodes (fewer where that does not divide
    the job's nodes), so both strategies are charged for the same job. straggler: the runtime's
    fail-slow and degraded-node settings (``mode`` migrate and ``on_degraded`` drain: proactive
    moves; :data:`~nonstop.sim.proactivesim.NO_PROACTIVE` detects only). rescue: the runtime's
    rescue snapshots (``--rescue-wait`` > 0, policy/rescue.py): with ``snapshot_every`` > 1 and
    a model copy to take a lost rank's state from, a failure in memory loses only the step in
    flight, and the plan waits for the survivors' write of their state (one device-to-host copy).
    """

    snapshot_every: int = 1
    snapshot_budget: float = DEFAULT_BUDGET
    snapshot_max_age_s: float = MAX_AGE_S
    stall_s: float | None = None
    replicas: int = 1
    spares_per_node: int = 1
    spare_nodes: int | None = None
    persist_every_s: float = 1800.0
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)
    migration_pause_s: float | None = None
    min_world_size: int = 0
    elastic_wait_s: float = 0.0
    shards_per_rank: int = 1
    shrink_batch: str = "keep"
    survivors: SurvivorMode = SurvivorMode.AUTO
    replica_nodes: int | None = None
    keep_on_failure: bool = True
    straggler: StragglerConfig = PROACTIVE
    rescue: bool = True

    def interval(self, stall_s: float, step_s: float, *, copies: int) -> int:
        """Steps between two snapshots: ``snapshot_every``, or with a budget the one the runtime's
        coordinator tunes (:func:`~nonstop.policy.cadence.choose_every`) where a lost rank has a
        stand-in, another of the job's ``copies`` of the model (ranks seeded alike, as here)."""
        if self.snapshot_budget <= 0 or copies < 2:
            return self.snapshot_every
        return choose_every(
            stall_s,
            step_s,
            budget=self.snapshot_budget,
            floor=self.snapshot_every,
            max_age_s=self.snapshot_max_age_s,
        )

    def __post_init__(self) -> None:
        require(self.snapshot_every >= 1, f"--snapshot-every must be >= 1 step; got {self.snapshot_every}")
        require(
            0.0 <= self.snapshot_budget < 1.0,
            f"--snapshot-budget must be a fraction in [0, 1); got {self.snapshot_budget}",
        )
        require(
            math.isfinite(self.snapshot_max_age_s) and self.snapshot_max_age_s > 0,
            f"--snapshot-max-age must be > 0 s; got {self.snapshot_max_age_s}",
        )
        require(self.replicas >= 0, f"--replicas must be >= 0; got {self.replicas}")
        require(self.spares_per_node >= 0, f"--spares-per-node must be >= 0; got {self.spares_per_node}")
        require(
            self.spare_nodes is None or self.spare_nodes >= 0,
            f"--spare-nodes must be >= 0; got {self.spare_nodes}",
        )
        require(self.persist_every_s > 0, f"--persist-every-s must be > 0; got {self.persist_every_s}")
        for label, v in (("stall", self.stall_s), ("migration pause", self.migration_pause_s)):
            require(v is None or (math.isfinite(v) and v >= 0), f"nonstop {label} must be >= 0 s; got {v}")
        require(
            self.min_world_size >= 0,
            f"--min-world-size must be >= 0 (0: never shrink); got {self.min_world_size}",
        )
        require(self.shards_per_rank >= 1, f"--shards-per-rank must be >= 1; got {self.shards_per_rank}")
        require(
            self.shrink_batch in SHRINK_BATCHES,
            f"--shrink-batch must be one of {', '.join(SHRINK_BATCHES)}; got {self.shrink_batch!r}",
        )
        require(
            self.replica_nodes is None or self.replica_nodes >= 0,
            f"--replica-nodes must be >= 0; got {self.replica_nodes}",
        )
        require(
            math.isfinite(self.elastic_wait_s) and self.elastic_wait_s >= 0,
            f"--elastic-wait must be >= 0 s; got {self.elastic_wait_s}",
        )
