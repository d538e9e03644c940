"""The job config's parts (nonstop/config/): each validates its own fields alone, a bad value one
line naming its flag; the CLI builds each from its flags and composes them into the JobConfig;
the defaults are what they were when the config was flat; the flat record maps every old name to
its part, both ways."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import nonstop.config as config
from nonstop.cli import build_parser
from nonstop.cli.run import job_config, with_defaults
from nonstop.config import (
    FLAT,
    PARTS,
    ControlConfig,
    DetectionConfig,
    ElasticConfig,
    JobConfig,
    OperationsConfig,
    PersistConfig,
    ReplicationConfig,
    ShrinkBatch,
    SnapshotConfig,
    SnapshotCopies,
    SnapshotMode,
    SurvivorMode,
    SwapTransfer,
    job_config_from_flat,
    job_config_from_json,
    job_config_to_flat,
    job_config_to_json,
)
from nonstop.errors import UsageError

# (part, a bad field, the message's start): each part alone, without a JobConfig
BAD: list[tuple[type[Any], dict[str, Any], str]] = [
    (SnapshotConfig, {"every": 0}, "--snapshot-every must be >= 1 step (got 0)"),
    (SnapshotConfig, {"budget": 1.0}, "--snapshot-budget must be a fraction in [0, 1)"),
    (SnapshotConfig, {"max_age_s": 0.0}, "--snapshot-max-age must be > 0 seconds (got 0.0)"),
    (SnapshotConfig, {"rescue_wait_s": 61.0}, "--rescue-wait must be between 0 and 60 seconds"),
    (SnapshotConfig, {"mode": "later"}, "--snapshot must be one of overlapped, sync, off (got 'later')"),
    (SnapshotConfig, {"copies": "gpu"}, "--snapshot-copies must be one of node, rank (got 'gpu')"),
    (SnapshotConfig, {"shm_dir": Path("/nonexistent/shm")}, "--shm-dir '/nonexistent/shm' is not a writable"),
    (PersistConfig, {"every": -1}, "--persist-every must be >= 0 (got -1)"),
    (PersistConfig, {"lossy_bits": 2}, "--lossy-bits must be 4 or 8 (got 2)"),
    (PersistConfig, {"keep": 0}, "--keep must be >= 1 (got 0)"),
    (DetectionConfig, {"lease_ttl_s": 0.01}, "--lease-ttl must be > 0.05 seconds (got 0.01)"),
    (DetectionConfig, {"quarantine_failures": 0}, "--quarantine-failures must be >= 1"),
    (ReplicationConfig, {"bandwidth_mb_s": 0.0}, "--replica-bandwidth must be > 0 MB/s"),
    (ElasticConfig, {"wait_s": -1.0}, "--elastic-wait must be >= 0 seconds (got -1.0)"),
    (ElasticConfig, {"shards_per_rank": 0}, "--shards-per-rank must be in 1..4096 (got 0)"),
    (ElasticConfig, {"survivors": "x"}, "--survivors must be one of auto, wait, continue (got 'x')"),
    (ElasticConfig, {"shrink_batch": "x"}, "--shrink-batch must be one of keep, drop (got 'x')"),
    (ControlConfig, {"store": "redis://h:1"}, "--store must be embedded://, etcd://HOST:PORT"),
    (ControlConfig, {"reconnect_s": 0.0}, "--reconnect must be > 0 seconds (got 0.0)"),
    (ControlConfig, {"store": "etcds://h:1"}, "--store etcds://... needs --etcd-ca FILE"),
    (ControlConfig, {"etcd_ca": Path("ca.pem")}, "--etcd-ca/--etcd-cert/--etcd-key are for TLS to etcd"),
    (OperationsConfig, {"metrics_port": 70000}, "--metrics-port must be in 0..65535 (got 70000)"),
    (OperationsConfig, {"preempt_url": "ftp://x"}, "--preempt-url must be an http:// or https:// URL"),
    (OperationsConfig, {"preempt_headers": ("novalue",)}, "--preempt-header must be 'Name: value'"),
    (OperationsConfig, {"preempt_poll_s": 0.0}, "--preempt-poll must be > 0 seconds (got 0.0)"),
    (OperationsConfig, {"swap_transfer": "x"}, "--swap-transfer must be one of auto, delta, whole (got 'x')"),
]


@pytest.mark.parametrize(("part", "fields", "message"), BAD, ids=lambda v: getattr(v, "__name__", None))
def test_each_part_rejects_a_bad_value_alone_in_one_line(
    part: type[Any], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(UsageError) as e:
        part(**fields)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_part_takes_a_closed_sets_string_as_its_member() -> None:
    assert SnapshotConfig(mode="sync", copies="rank").mode is SnapshotMode.SYNC  # type: ignore[arg-type]
    assert SnapshotConfig(copies="rank").copies is SnapshotCopies.RANK  # type: ignore[arg-type]
    e = ElasticConfig(survivors="wait", shrink_batch="drop")  # type: ignore[arg-type]
    assert (e.survivors, e.shrink_batch) == (SurvivorMode.WAIT, ShrinkBatch.DROP)
    assert OperationsConfig(swap_transfer="whole").swap_transfer is SwapTransfer.WHOLE  # type: ignore[arg-type]


def test_the_checks_across_parts_stay_with_the_job() -> None:
    """A part alone cannot know the job's shape: these pass as parts and fail as a job."""
    with pytest.raises(UsageError, match=r"^--replicas must be in 0\.\.1 "):
        JobConfig(script="x", nnodes=2, coordinator="h:5", replication=ReplicationConfig(replicas=2))
    store = ControlConfig(store="etcd://h:1")  # fine alone
    with pytest.raises(UsageError, match="needs --coordinator HOST:PORT with a fixed port"):
        JobConfig(script="x", control=store)
    with pytest.raises(UsageError, match="needs --secret-file on every node"):
        JobConfig(script="x", coordinator="h:5", control=store)
    with pytest.raises(UsageError, match=r"^--min-world-size must be in 0\.\.2 "):
        JobConfig(script="x", nproc_per_node=2, elastic=ElasticConfig(min_world_size=3))
    with pytest.raises(UsageError, match="--survivors continue needs an elastic job"):
        JobConfig(script="x", elastic=ElasticConfig(survivors=SurvivorMode.CONTINUE))


def test_the_defaults_are_the_flat_configs() -> None:
    """Pinned: what JobConfig(script=...) held before it had parts."""
    c = JobConfig(script="x")
    assert (c.nproc_per_node, c.spares, c.host, c.port, c.max_restarts, c.nnodes) == (
        1,
        0,
        "127.0.0.1",
        0,
        10,
        1,
    )
    assert (c.job_dir, c.join_timeout_s, c.keep_groups, c.mesh) == (Path(".nonstop/job"), 300.0, True, None)
    s = c.snapshot
    assert (s.mode, s.every, s.budget, s.max_age_s, s.rescue_wait_s) == ("overlapped", 1, 1e-4, 600.0, 2.0)
    assert (s.copies, s.shm_dir) == ("node", None)
    p = c.persist
    assert (p.url, p.every, p.keep, p.lossy, p.lossy_bits, p.timeout_s, p.resume) == (
        None,
        100,
        3,
        False,
        8,
        120.0,
        None,
    )
    d = c.detection
    assert (d.lease_ttl_s, d.quarantine_failures, d.quarantine_window_s, d.rebuild_timeout_s) == (
        1.0,
        3,
        600.0,
        30.0,
    )
    assert (d.detector.heartbeat_timeout_s, d.straggler.mode, d.probes.period_s) == (1.0, "warn", 10.0)
    assert (c.replication.replicas, c.replication.bandwidth_mb_s) == (1, None)
    e = c.elastic
    assert (e.min_world_size, e.wait_s, e.survivors, e.shrink_batch, e.shards_per_rank) == (
        0,
        0.0,
        "auto",
        "keep",
        1,
    )
    k = c.control
    assert (k.store, k.reconnect_s, k.secret_file, k.tls, k.uses_store) == (
        "embedded://",
        30.0,
        None,
        False,
        False,
    )
    o = c.operations
    assert (o.metrics_port, o.preempt_grace_s, o.preempt_url, o.preempt_poll_s) == (None, 30.0, None, 2.0)
    assert o.swap_transfer == "auto" and o.preempt_headers == ()


def _cli(*argv: str) -> JobConfig:
    """What ``nonstop run ARGV train.py`` would run (flags, torchrun's forms resolved)."""
    ap, parsers = build_parser()
    args = ["run", *argv, "train.py"]
    return job_config(with_defaults(ap, parsers["run"], ap.parse_args(args), args))


def test_the_cli_builds_each_part_from_its_flags() -> None:
    c = _cli(
        "--nproc-per-node", "2", "--nnodes", "2", "--coordinator", "h:5", "--node-rank", "1",
        "--snapshot", "sync", "--snapshot-every", "4", "--shm-dir", "/dev/shm",
        "--persist", "/ck", "--persist-every", "7", "--keep", "2", "--resume", "/old",
        "--heartbeat-timeout", "2.5", "--straggler", "migrate", "--probe-period", "0",
        "--lease-ttl", "3", "--quarantine-failures", "5",
        "--replicas", "1", "--replica-bandwidth", "50",
        "--min-world-size", "2", "--elastic-wait", "4", "--survivors", "continue",
        "--reconnect", "9", "--metrics-port", "0", "--preempt-url", "http://m/{node}",
        "--preempt-header", "A: b", "--swap-transfer", "delta", "--rebuild-all-groups",
    )  # fmt: skip
    assert (c.nproc_per_node, c.nnodes, c.node_rank, c.coordinator, c.keep_groups) == (2, 2, 1, "h:5", False)
    assert c.snapshot == SnapshotConfig(mode=SnapshotMode.SYNC, every=4, shm_dir=Path("/dev/shm"))
    assert c.persist == PersistConfig(url="/ck", every=7, keep=2, resume="/old")
    assert (c.detection.detector.heartbeat_timeout_s, c.detection.straggler.mode) == (2.5, "migrate")
    assert (c.detection.probes.period_s, c.detection.lease_ttl_s, c.detection.quarantine_failures) == (
        0,
        3,
        5,
    )
    assert c.replication == ReplicationConfig(replicas=1, bandwidth_mb_s=50.0)
    assert c.elastic == ElasticConfig(min_world_size=2, wait_s=4.0, survivors=SurvivorMode.CONTINUE)
    assert c.control == ControlConfig(reconnect_s=9.0)
    assert c.operations == OperationsConfig(
        metrics_port=0,
        preempt_url="http://m/{node}",
        preempt_headers=("A: b",),
        swap_transfer=SwapTransfer.DELTA,
    )


def test_the_cli_with_no_flags_is_the_default_config() -> None:
    c = _cli()
    default = JobConfig(script="train.py")
    for part in PARTS:
        got, want = getattr(c, part), getattr(default, part)
        assert got == want, part
    assert (c.nproc_per_node, c.job_dir, c.max_restarts) == (default.nproc_per_node, default.job_dir, 10)


def test_a_bad_flag_fails_in_the_cli_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from nonstop.cli import main

    assert main(["run", "--lease-ttl", "0", "train.py"]) == 2
    assert capsys.readouterr().err == "nonstop: error: --lease-ttl must be > 0.05 seconds (got 0.0)\n"


def test_every_flat_name_has_one_home_and_the_record_round_trips() -> None:
    names = [name for name, _, _ in FLAT]
    assert len(names) == len(set(names)) == 59  # the flat JobConfig's fields, each once
    for _, part, attr in FLAT:
        owner = JobConfig if part is None else PARTS[part]
        assert attr in owner.__dataclass_fields__, (part, attr)
    cfg = job_config_from_flat(
        {
            "script": "x",
            "snapshot_every": 3,
            "lease_ttl_s": 2.0,
            "survivors": "wait",
            "swap_transfer": "whole",
        }
    )
    assert (cfg.snapshot.every, cfg.detection.lease_ttl_s) == (3, 2.0)
    assert (cfg.elastic.survivors, cfg.operations.swap_transfer) == (SurvivorMode.WAIT, SwapTransfer.WHOLE)
    flat = job_config_to_flat(cfg)
    assert list(flat) == names and flat["snapshot_every"] == 3
    assert job_config_from_json(job_config_to_json(cfg)) == cfg
    assert json.loads(job_config_to_json(cfg))["elastic_wait_s"] == 0.0  # the record keeps the flat names
    with pytest.raises(TypeError, match="no setting 'snapshot_evry'"):
        job_config_from_flat({"script": "x", "snapshot_evry": 3})


def test_every_name_the_flat_module_exported_still_imports() -> None:
    old = (
        "DetectorConfig JobConfig ProbeConfig ShrinkBatch SnapshotCopies SnapshotMode SurvivorMode "
        "SwapTransfer WorkerEnv ENV SNAPSHOT_COPIES SNAPSHOT_MODES SWAP_TRANSFERS SURVIVOR_MODES "
        "SHRINK_BATCHES member channel_tls_from_env etcd_tls_paths_from_env job_config_from_json "
        "job_config_to_json security_env security_environ"
    ).split()
    assert all(hasattr(config, name) for name in old)
    assert set(config.__all__) <= set(dir(config))
