"""The job's flags of ``nonstop run`` and ``demo`` and how they become config values: the failure
detector (``--heartbeat-timeout``, ...), snapshots and the durable tier (``--snapshot``,
``--persist``, ...) and the nodes of a job (``--nnodes``, ``--coordinator``, elastic, preemption,
``--mesh``). Each ``*_args`` adds flags to a parser; its ``*_config`` reads them back."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.clienv import nnodes_value
from nonstop.config import (
    SHRINK_BATCHES,
    SNAPSHOT_COPIES,
    SNAPSHOT_MODES,
    SURVIVOR_MODES,
    SWAP_TRANSFERS,
    DetectorConfig,
    JobConfig,
    ProbeConfig,
)
from nonstop.policy.straggler import DEGRADED_ACTIONS, STRAGGLER_MODES, StragglerConfig

__all__ = [
    "detector",
    "detector_args",
    "health",
    "health_args",
    "node_args",
    "node_config",
    "probe_args",
    "probes",
    "snapshot_args",
    "snapshot_config",
]


def detector_args(p: argparse.ArgumentParser) -> None:
    d = DetectorConfig()
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout_s,
        help="seconds of heartbeat silence before a worker counts as hung (default %(default)s)",
    )
    p.add_argument(
        "--hang-factor",
        type=float,
        default=d.hang_factor,
        help="no progress for this many median step times counts as a hang (default %(default)s)",
    )
    p.add_argument(
        "--hang-min-s",
        type=float,
        default=d.hang_min_s,
        help="floor of the progress-based hang timeout, seconds (default %(default)s)",
    )
    p.add_argument(
        "--no-confirm-silence",
        dest="confirm_silence",
        action="store_false",
        help="kill a silent worker at once, without its node agent's look at whether it is starved "
        "of CPU rather than stuck (by default one that moves is spared, for 3x the timeout)",
    )


def detector(ns: argparse.Namespace) -> DetectorConfig:
    return DetectorConfig(
        heartbeat_timeout_s=ns.heartbeat_timeout,
        hang_factor=ns.hang_factor,
        hang_min_s=ns.hang_min_s,
        confirm_silence=ns.confirm_silence,
    )


def health_args(p: argparse.ArgumentParser) -> None:
    """Issue 21: fail-slow ranks and degraded nodes (policy/straggler.py, coordinator/health.py)."""
    s = StragglerConfig()
    p.add_argument(
        "--straggler",
        choices=STRAGGLER_MODES,
        default=s.mode,
        help="a rank persistently slower than its peers (its compute time outside the gradient "
        "allreduce): 'warn' logs it (event 'straggler', status), 'migrate' also moves it live to a "
        "node with an idle spare when the slowdown over the remaining steps costs more than a "
        "migration, 'off' does not look (default %(default)s)",
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=s.factor,
        help="slower than this x the median of the other ranks is slow (default %(default)s)",
    )
    p.add_argument(
        "--straggler-window",
        type=int,
        default=s.window,
        metavar="STEPS",
        help="a rank slow in 3/4 of the last STEPS steps is flagged (default %(default)s)",
    )
    p.add_argument(
        "--migration-cost",
        type=float,
        default=s.migration_cost_s,
        metavar="SECONDS",
        help="what a live migration is assumed to cost until one is measured (default %(default)s)",
    )
    p.add_argument(
        "--on-degraded",
        choices=DEGRADED_ACTIONS,
        default=s.on_degraded,
        help="a node whose health verdict is degraded or failing: 'warn' logs it, 'drain' moves its "
        "ranks live to nodes with an idle spare and releases it (default %(default)s)",
    )


def health(ns: argparse.Namespace) -> StragglerConfig:
    return StragglerConfig(
        mode=ns.straggler,
        factor=ns.straggler_factor,
        window=ns.straggler_window,
        migration_cost_s=ns.migration_cost,
        on_degraded=ns.on_degraded,
    )


def probe_args(p: argparse.ArgumentParser) -> None:
    """Issue 21: every node agent's health probes (agent/probes.py); validated by
    :class:`~nonstop.config.ProbeConfig` (a bad value: one line, exit 2)."""
    c = ProbeConfig()
    p.add_argument(
        "--probe-period",
        type=float,
        default=c.period_s,
        metavar="SECONDS",
        help="each node agent runs its health probes (host memory and clock, NVML where "
        "nvidia-ml-py is installed, --health-cmd) this often; 0: no probes (default %(default)s)",
    )
    p.add_argument(
        "--health-cmd",
        default=c.command,
        metavar="CMD",
        help="a node's own health check, run by each agent every --probe-period (split like a shell "
        "would, run without one; NONSTOP_NODE names the node): exit 0 healthy, else failing; a last "
        'stdout line {"verdict": "degraded", "detail": "..."} refines it',
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=c.timeout_s,
        metavar="SECONDS",
        help="a --health-cmd still running after this is killed and counts as failing (default %(default)s)",
    )


def probes(ns: argparse.Namespace) -> ProbeConfig:
    return ProbeConfig(period_s=ns.probe_period, command=ns.health_cmd, timeout_s=ns.health_timeout)


def snapshot_args(p: argparse.ArgumentParser) -> None:
    c = JobConfig(script="")
    p.add_argument(
        "--snapshot",
        choices=SNAPSHOT_MODES,
        default=c.snapshot,
        help="per-step capture: overlapped with the next step, sync, or off (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=c.snapshot_every,
        metavar="K",
        help="snapshot every K steps: 1/K of the per-step snapshot cost, up to K-1 steps redone after "
        "a failure (`nonstop advise` weighs it; default %(default)s)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=c.snapshot_budget,
        metavar="FRACTION",
        help="tune the interval to a stall budget: the coordinator measures each snapshot's stall "
        "and the step time and snapshots every K-th step (K >= --snapshot-every, at most 128), the "
        "smallest K whose stall costs at most FRACTION of the training time, e.g. 0.002; failures "
        "between snapshots are rescued; it widens only where a rescue can replace a lost rank (ranks "
        "alike, two model copies or more) (0: keep --snapshot-every, every step unless it is set; "
        "default %(default)s)",
    )
    p.add_argument(
        "--snapshot-max-age",
        type=float,
        default=c.snapshot_max_age_s,
        metavar="SECONDS",
        help="with --snapshot-budget: the interval's steps take at most this long, so the newest "
        "step every rank snapshotted (what persists and peer replicas follow) is never older "
        "(default %(default)s)",
    )
    p.add_argument(
        "--rescue-wait",
        type=float,
        default=c.rescue_wait_s,
        metavar="SECONDS",
        help="with --snapshot-every > 1 or a --snapshot-budget, how long a recovery waits for the "
        "survivors to write the state after their last completed step (redoing only the step in "
        "flight); 0: roll back to the last snapshot (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-copies",
        choices=SNAPSHOT_COPIES,
        default=c.snapshot_copies,
        help="a data-parallel job's parameters and optimizer state, alike on every rank, are kept once "
        "per node (node: one rank copies them each step, the others only their own RNG, buffers "
        "and data position) or once per rank (default %(default)s)",
    )
    p.add_argument(
        "--persist",
        default=None,
        metavar="URL",
        help="durable tier: directory or fsspec URL (default JOB_DIR/checkpoints)",
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=c.persist_every,
        help="persist the committed step every N steps, lazily; 0: only on demand, SIGTERM and exit "
        "(default %(default)s)",
    )
    p.add_argument(
        "--keep", type=int, default=c.keep, help="durable checkpoints to retain (default %(default)s)"
    )
    p.add_argument(
        "--lossy", action="store_true", help="quantise delta checkpoints (optimizer moments, weight deltas)"
    )
    p.add_argument("--lossy-bits", type=int, default=c.lossy_bits, help="4 or 8 (default %(default)s)")
    p.add_argument(
        "--shm-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where this node keeps its snapshot memory: a memory filesystem with room for every "
        "slot (default /dev/shm)",
    )


def snapshot_config(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "snapshot": ns.snapshot,
        "snapshot_every": ns.snapshot_every,
        "snapshot_budget": ns.snapshot_budget,
        "snapshot_max_age_s": ns.snapshot_max_age,
        "rescue_wait_s": ns.rescue_wait,
        "snapshot_copies": ns.snapshot_copies,
        "persist_url": ns.persist,
        "persist_every": ns.persist_every,
        "keep": ns.keep,
        "lossy": ns.lossy,
        "lossy_bits": ns.lossy_bits,
        "shm_dir": ns.shm_dir,
    }


def node_args(p: argparse.ArgumentParser) -> None:
    c = JobConfig(script="")
    g = p.add_argument_group("many nodes")
    g.add_argument(
        "--nnodes",
        type=nnodes_value,
        default=1,
        metavar="N|MIN:MAX",
        help="nodes in the job; MIN:MAX (torchrun's): MAX nodes, elastic down to MIN nodes' ranks "
        "(default 1)",
    )
    g.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 hosts the coordinator")
    g.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT", help="where node 0 listens and the others connect"
    )
    g.add_argument(
        "--domain", default=None, help="this node's failure domain (rack, zone); replicas avoid it"
    )
    g.add_argument(
        "--store",
        default=c.store,
        help="control store: embedded:// (default; the coordinator lives in node 0's process) or "
        "etcd://HOST:PORT (job state and node leases in etcd: the coordinator runs as its own process "
        "and may restart without stopping the job; needs --secret-file, the etcd password); "
        "etcds://HOST:PORT: the same over TLS (--etcd-ca, --etcd-cert, --etcd-key)",
    )
    g.add_argument(
        "--reconnect",
        type=float,
        default=c.reconnect_s,
        help="with --store etcd: seconds agents and workers wait for a restarted coordinator "
        "(default %(default)s)",
    )
    g.add_argument(
        "--data-host",
        default=None,
        help="address this node's data plane (peer replicas) binds and advertises "
        "(default: node 0 the coordinator's host; others the local address that reaches it)",
    )
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=c.lease_ttl_s,
        help="seconds without a lease renewal after which a node is lost (default %(default)s)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=c.replicas,
        help="peer copies of each rank's snapshot (default %(default)s)",
    )
    g.add_argument("--replica-bandwidth", type=float, default=None, metavar="MB/S", help="cap on replication")
    g.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="job secret (default: JOB_DIR/secret, written by node 0)",
    )
    g.add_argument("--quarantine-failures", type=int, default=c.quarantine_failures)
    g.add_argument("--quarantine-window", type=float, default=c.quarantine_window_s, metavar="SECONDS")
    g.add_argument("--join-timeout", type=float, default=c.join_timeout_s, metavar="SECONDS")
    g.add_argument(
        "--preempt-grace",
        type=float,
        default=c.preempt_grace_s,
        metavar="SECONDS",
        help="SIGTERM to a node (not node 0) is a preemption notice: its ranks move live to other nodes "
        "within this grace; also JOB_DIR/preempt-node-N appearing (content: grace seconds)",
    )
    g.add_argument(
        "--preempt-url",
        default=None,
        metavar="URL",
        help="poll this HTTP endpoint for a preemption notice (a cloud metadata service, e.g. AWS "
        ".../spot/instance-action, GCP .../instance/preempted, Azure scheduled events); '{node}' is "
        "replaced by the node rank",
    )
    g.add_argument(
        "--preempt-header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="header of the notice request (e.g. 'Metadata-Flavor: Google'); repeatable",
    )
    g.add_argument(
        "--preempt-poll",
        type=float,
        default=c.preempt_poll_s,
        metavar="SECONDS",
        help="how often the notice endpoint is polled (default %(default)s)",
    )
    g.add_argument(
        "--min-world-size",
        type=int,
        default=c.min_world_size,
        metavar="N",
        help="elastic: when a rank cannot be replaced (no hot spare left), go on with fewer ranks, "
        "down to N, keeping the global batch by gradient accumulation; grow back when a node joins "
        "(default 0: never shrink)",
    )
    g.add_argument(
        "--elastic-wait",
        type=float,
        default=c.elastic_wait_s,
        metavar="SECONDS",
        help="elastic: wait this long for a spare before shrinking (default %(default)s)",
    )
    g.add_argument(
        "--survivors",
        choices=SURVIVOR_MODES,
        default=c.survivors,
        help="elastic: a failed rank a hot spare could take: 'continue' goes on without it at once "
        "(its data shards played by the others) and the spare joins at a step boundary; 'wait' "
        "has every rank wait for the spare's restore; 'auto' chooses per failure by the restore "
        "and step times measured (default %(default)s)",
    )
    g.add_argument(
        "--shrink-batch",
        choices=SHRINK_BATCHES,
        default=c.shrink_batch,
        help="elastic, while the job is shrunk: 'keep' the global batch (the lost ranks' data shards "
        "played by the others: same samples, bitwise an uninterrupted run's weights, slower steps) "
        "or 'drop' the lost ranks' shares of it until the job grows back (as torchft does: steps "
        "as fast as at full size, fewer samples each) (default %(default)s)",
    )
    g.add_argument(
        "--shards-per-rank",
        type=int,
        default=c.shards_per_rank,
        metavar="M",
        help="data shards (micro-batches, by gradient accumulation) each rank plays per step at full "
        "size: the script's Session.shard_steps yields them; with M > 1 a shrunk job spreads a lost "
        "rank's shards over more ranks (default %(default)s)",
    )
    g.add_argument(
        "--swap-transfer",
        choices=SWAP_TRANSFERS,
        default=c.swap_transfer,
        help="how a live migration's swap brings the boundary step to the joiner's node: as a delta "
        "against the step its catch-up fetched, the whole step, or auto: a delta when the catch-up "
        "measured deltas faster (a slow link) (default %(default)s)",
    )
    g.add_argument(
        "--mesh",
        default=c.mesh,
        metavar="replicate=R,shard=S,tp=T",
        help="a sharded job's device mesh (any subset of the dims; their product is the world size, "
        "tp divides --nproc-per-node): the script trains through Session.run(build=...), which "
        "builds its FSDP2 / HSDP / TP model on that mesh (default: data-parallel DDP)",
    )
    g.add_argument(
        "--rebuild-all-groups",
        action="store_true",
        help="a sharded job builds every mesh group again in each new generation; by default a "
        "group whose members all left the last one at a step boundary, unchanged, is kept",
    )


def node_config(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "nnodes": ns.nnodes,
        "node_rank": ns.node_rank,
        "coordinator": ns.coordinator,
        "domain": ns.domain,
        "data_host": ns.data_host,
        "store": ns.store,
        "reconnect_s": ns.reconnect,
        "lease_ttl_s": ns.lease_ttl,
        "replicas": ns.replicas,
        "replica_bandwidth_mb_s": ns.replica_bandwidth,
        "secret_file": ns.secret_file,
        "quarantine_failures": ns.quarantine_failures,
        "quarantine_window_s": ns.quarantine_window,
        "join_timeout_s": ns.join_timeout,
        "preempt_grace_s": ns.preempt_grace,
        "preempt_url": ns.preempt_url,
        "preempt_headers": tuple(ns.preempt_header),
        "preempt_poll_s": ns.preempt_poll,
        "min_world_size": ns.min_world_size,
        "elastic_wait_s": ns.elastic_wait,
        "survivors": ns.survivors,
        "shrink_batch": ns.shrink_batch,
        "swap_transfer": ns.swap_transfer,
        "shards_per_rank": ns.shards_per_rank,
        "mesh": ns.mesh,
        "keep_groups": not ns.rebuild_all_groups,
    }
