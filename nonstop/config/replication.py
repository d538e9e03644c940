"""What peer replication reads (:class:`ReplicationConfig`, ``config.replication``): validated
alone (a bad value: one line naming its flag); ``--replicas`` against ``--nnodes`` is the job's
check (:class:`~nonstop.config.job.JobConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.errors import UsageError

__all__ = ["ReplicationConfig"]


@dataclass(frozen=True, kw_only=True)
class ReplicationConfig:
    """Peer replicas (``--replicas``, ``--replica-bandwidth``): ``replicas`` peer copies of each
    rank's snapshot, each on another node (0: none; its range is checked with ``--nnodes`` by the
    job); ``bandwidth_mb_s`` a cap per node on replication traffic (None: none)."""

    replicas: int = 1
    bandwidth_mb_s: float | None = None

    def __post_init__(self) -> None:
        if self.bandwidth_mb_s is not None and self.bandwidth_mb_s <= 0:
            raise UsageError("--replica-bandwidth must be > 0 MB/s (omit it for no cap)")
