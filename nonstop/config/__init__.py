"""Small typed configs, one per component, and the one place where environment variables are read.

Each component owns a frozen keyword-only dataclass that validates its own fields in
``__post_init__``, so a bad value fails at start (one line naming its flag), not at step 10,000;
the CLI builds each from its flags (``nonstop/cli/flags/``) and composes them into a
:class:`JobConfig` (the job itself, and its parts: ``config.snapshot``, ``config.persist``,
``config.detection``, ``config.replication``, ``config.elastic``, ``config.control``,
``config.operations``), which checks what needs several parts.

Modules: ``enums`` (the closed sets), ``snapshot`` (memory and durable tier), ``detection``,
``replication``, ``elastic``, ``control``, ``operations``, ``job`` (:class:`JobConfig`),
``record`` (the flat JSON record), ``env`` (:class:`ENV`, :class:`WorkerEnv`, security settings).
Every name here is importable from ``nonstop.config``.
"""

from __future__ import annotations

from nonstop.config.control import EMBEDDED_STORE, ControlConfig
from nonstop.config.detection import DetectionConfig, DetectorConfig, ProbeConfig, StragglerConfig
from nonstop.config.elastic import ElasticConfig
from nonstop.config.enums import (
    SHRINK_BATCHES,
    SNAPSHOT_COPIES,
    SNAPSHOT_MODES,
    SURVIVOR_MODES,
    SWAP_TRANSFERS,
    ShrinkBatch,
    SnapshotCopies,
    SnapshotMode,
    SurvivorMode,
    SwapTransfer,
    member,
)
from nonstop.config.env import (
    ENV,
    WorkerEnv,
    channel_tls_from_env,
    etcd_tls_paths_from_env,
    security_env,
    security_environ,
)
from nonstop.config.job import JobConfig
from nonstop.config.operations import OperationsConfig
from nonstop.config.record import (
    FLAT,
    PARTS,
    job_config_from_flat,
    job_config_from_json,
    job_config_to_flat,
    job_config_to_json,
)
from nonstop.config.replication import ReplicationConfig
from nonstop.config.snapshot import PersistConfig, SnapshotConfig

__all__ = [
    "ControlConfig",
    "DetectionConfig",
    "DetectorConfig",
    "ElasticConfig",
    "JobConfig",
    "OperationsConfig",
    "PersistConfig",
    "ProbeConfig",
    "ReplicationConfig",
    "ShrinkBatch",
    "SnapshotConfig",
    "SnapshotCopies",
    "SnapshotMode",
    "StragglerConfig",
    "SurvivorMode",
    "SwapTransfer",
    "WorkerEnv",
    "EMBEDDED_STORE",
    "ENV",
    "FLAT",
    "PARTS",
    "SHRINK_BATCHES",
    "SNAPSHOT_COPIES",
    "SNAPSHOT_MODES",
    "SURVIVOR_MODES",
    "SWAP_TRANSFERS",
    "channel_tls_from_env",
    "etcd_tls_paths_from_env",
    "job_config_from_flat",
    "job_config_from_json",
    "job_config_to_flat",
    "job_config_to_json",
    "member",
    "security_env",
    "security_environ",
]
