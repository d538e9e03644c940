"""What a job's config fixes about it, as the coordinator's operations take it: the mesh, the
data shards, the elastic and survivor policies, the snapshot slots per rank, the quarantine, and
whether snapshots replicate to peers. Pure: read once by :func:`~nonstop.coordinator.assembly.assemble`
before any operation is built."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.config import JobConfig
from nonstop.mesh import MeshSpec
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.survivors import SurvivorMode

__all__ = ["JobShape", "job_shape", "replicates"]


def replicates(config: JobConfig) -> bool:
    """Whether the job replicates snapshots to peers' memory (replicas, and another node)."""
    return config.replication.replicas > 0 and config.nnodes > 1


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """What the config fixes about the job, as the operations take it (pure policies, sizes).

    ``num_shards``: the data-parallel shards, those of the full-size job (an elastic job keeps
    them; a sharded one comes and goes by whole replica groups, :mod:`nonstop.mesh`);
    ``num_slots``: snapshot slots per rank -- replicating, the held replicated step, the one a
    round is sending, the newest and one to write (4), else 2."""

    mesh: MeshSpec | None
    num_shards: int
    survivor_mode: SurvivorMode
    elastic: ElasticPolicy
    num_slots: int
    quarantine: QuarantinePolicy
    replicating: bool


def job_shape(config: JobConfig) -> JobShape:
    """The job's :class:`JobShape` from its config."""
    mesh = MeshSpec.parse(config.mesh) if config.mesh is not None else None
    return JobShape(
        mesh=mesh,
        num_shards=mesh.dp_size if mesh else config.world_size * config.elastic.shards_per_rank,
        survivor_mode=SurvivorMode(config.elastic.survivors),  # policy/survivors.py
        elastic=ElasticPolicy(
            full_world_size=config.world_size,
            min_world_size=config.min_world,
            wait_s=config.elastic.wait_s,
            unit=mesh.group_size if mesh else 1,
        ),
        num_slots=4 if replicates(config) else 2,
        quarantine=QuarantinePolicy(
            max_failures=config.detection.quarantine_failures, window_s=config.detection.quarantine_window_s
        ),
        replicating=replicates(config),
    )
