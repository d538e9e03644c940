"""The job config as a flat record: JSON for a process that must rebuild it (the restartable
coordinator reads what its launcher wrote), in the shape it has always had, one key per setting
under its old flat name (``snapshot_every``, ``lease_ttl_s``, ...), so a record written before the
config had parts reads back as one written now.

:data:`FLAT` says where each flat name lives: ``(name, part, field)``, ``part`` None for a field of
the job itself. :func:`job_config_from_flat` builds a :class:`JobConfig` from flat names (the
record's decoder; also what a test that names settings flat may call)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from nonstop.config.control import ControlConfig
from nonstop.config.detection import DetectionConfig, DetectorConfig, ProbeConfig, StragglerConfig
from nonstop.config.elastic import ElasticConfig
from nonstop.config.job import JobConfig
from nonstop.config.operations import OperationsConfig
from nonstop.config.replication import ReplicationConfig
from nonstop.config.snapshot import PersistConfig, SnapshotConfig

__all__ = [
    "FLAT",
    "PARTS",
    "job_config_from_flat",
    "job_config_from_json",
    "job_config_to_flat",
    "job_config_to_json",
]

# each part of JobConfig by its attribute name, and the class that builds it
PARTS: dict[str, type[Any]] = {
    "snapshot": SnapshotConfig,
    "persist": PersistConfig,
    "detection": DetectionConfig,
    "replication": ReplicationConfig,
    "elastic": ElasticConfig,
    "control": ControlConfig,
    "operations": OperationsConfig,
}

_JOB = None  # a field of the job itself
# (flat name, part, field), in the record's order (the flat JobConfig's field order)
FLAT: tuple[tuple[str, str | None, str], ...] = (
    ("script", _JOB, "script"),
    ("script_args", _JOB, "script_args"),
    ("nproc_per_node", _JOB, "nproc_per_node"),
    ("spares", _JOB, "spares"),
    ("job_dir", _JOB, "job_dir"),
    ("host", _JOB, "host"),
    ("port", _JOB, "port"),
    ("max_restarts", _JOB, "max_restarts"),
    ("rebuild_timeout_s", "detection", "rebuild_timeout_s"),
    ("detector", "detection", "detector"),
    ("faults", _JOB, "faults"),
    ("extra_env", _JOB, "extra_env"),
    ("snapshot", "snapshot", "mode"),
    ("snapshot_every", "snapshot", "every"),
    ("snapshot_budget", "snapshot", "budget"),
    ("snapshot_max_age_s", "snapshot", "max_age_s"),
    ("rescue_wait_s", "snapshot", "rescue_wait_s"),
    ("snapshot_copies", "snapshot", "copies"),
    ("persist_url", "persist", "url"),
    ("persist_every", "persist", "every"),
    ("keep", "persist", "keep"),
    ("resume", "persist", "resume"),
    ("lossy", "persist", "lossy"),
    ("lossy_bits", "persist", "lossy_bits"),
    ("persist_timeout_s", "persist", "timeout_s"),
    ("nnodes", _JOB, "nnodes"),
    ("node_rank", _JOB, "node_rank"),
    ("coordinator", _JOB, "coordinator"),
    ("domain", _JOB, "domain"),
    ("data_host", _JOB, "data_host"),
    ("lease_ttl_s", "detection", "lease_ttl_s"),
    ("replicas", "replication", "replicas"),
    ("replica_bandwidth_mb_s", "replication", "bandwidth_mb_s"),
    ("secret_file", "control", "secret_file"),
    ("quarantine_failures", "detection", "quarantine_failures"),
    ("quarantine_window_s", "detection", "quarantine_window_s"),
    ("join_timeout_s", _JOB, "join_timeout_s"),
    ("preempt_grace_s", "operations", "preempt_grace_s"),
    ("preempt_url", "operations", "preempt_url"),
    ("preempt_headers", "operations", "preempt_headers"),
    ("preempt_poll_s", "operations", "preempt_poll_s"),
    ("shards_per_rank", "elastic", "shards_per_rank"),
    ("swap_transfer", "operations", "swap_transfer"),
    ("mesh", _JOB, "mesh"),
    ("keep_groups", _JOB, "keep_groups"),
    ("min_world_size", "elastic", "min_world_size"),
    ("elastic_wait_s", "elastic", "wait_s"),
    ("survivors", "elastic", "survivors"),
    ("shrink_batch", "elastic", "shrink_batch"),
    ("store", "control", "store"),
    ("reconnect_s", "control", "reconnect_s"),
    ("etcd_ca", "control", "etcd_ca"),
    ("etcd_cert", "control", "etcd_cert"),
    ("etcd_key", "control", "etcd_key"),
    ("tls", "control", "tls"),
    ("metrics_port", "operations", "metrics_port"),
    ("shm_dir", "snapshot", "shm_dir"),
    ("straggler", "detection", "straggler"),
    ("probes", "detection", "probes"),
)
_WHERE = {name: (part, attr) for name, part, attr in FLAT}
_PATHS = ("job_dir", "secret_file", "etcd_ca", "etcd_cert", "etcd_key", "shm_dir")
_NESTED: dict[str, type[Any]] = {
    "detector": DetectorConfig,
    "straggler": StragglerConfig,
    "probes": ProbeConfig,
}


def job_config_to_flat(config: JobConfig) -> dict[str, Any]:
    """``config`` as ``flat name -> value``, in :data:`FLAT`'s order (values as they are)."""
    out: dict[str, Any] = {}
    for name, part, attr in FLAT:
        owner = config if part is None else getattr(config, part)
        out[name] = getattr(owner, attr)
    return out


def job_config_from_flat(values: Mapping[str, Any]) -> JobConfig:
    """A :class:`JobConfig` from flat names (:data:`FLAT`; a name left out keeps its default);
    validated like any other. TypeError for a name that is no setting."""
    job: dict[str, Any] = {}
    parts: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        if name not in _WHERE:
            raise TypeError(f"JobConfig has no setting {name!r}")
        part, attr = _WHERE[name]
        (job if part is None else parts.setdefault(part, {}))[attr] = value
    for part, kwargs in parts.items():  # in the values' order, as the flat config checked them
        job[part] = PARTS[part](**kwargs)
    return JobConfig(**job)


def job_config_to_json(config: JobConfig) -> str:
    """``config`` as JSON (for a process that must rebuild it: the restartable coordinator)."""
    doc: dict[str, object] = {}
    for name, v in job_config_to_flat(config).items():
        if is_dataclass(v) and not isinstance(v, type):
            v = {g.name: getattr(v, g.name) for g in fields(v)}
        elif isinstance(v, Path):
            v = str(v)
        doc[name] = v
    return json.dumps(doc)


def job_config_from_json(text: str) -> JobConfig:
    """The inverse of :func:`job_config_to_json` (validated like any JobConfig)."""
    doc = json.loads(text)
    for name, kind in _NESTED.items():
        if name in doc:  # straggler, probes: issue 21; absent from a record written before it
            doc[name] = kind(**doc[name])
    for name in _PATHS:
        if doc.get(name) is not None:
            doc[name] = Path(doc[name])
    for name in ("script_args", "faults", "preempt_headers"):
        if name in doc:
            doc[name] = tuple(doc[name])
    doc["extra_env"] = tuple((str(k), str(v)) for k, v in doc["extra_env"])
    return job_config_from_flat(doc)
