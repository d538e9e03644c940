"""The flags of ``nonstop run`` for the nodes of a job (``--nnodes``, ``--coordinator``, the control
store, replication, quarantine, preemption, elasticity, ``--mesh``): :func:`node_args` adds them to
a parser, in the group "many nodes"; :func:`node_config` reads them back as the job config's values."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.cli.env import nnodes_value
from nonstop.config import SHRINK_BATCHES, SURVIVOR_MODES, SWAP_TRANSFERS, JobConfig

__all__ = ["node_args", "node_config"]


def node_args(p: argparse.ArgumentParser) -> None:
    """Add the flags of a job's nodes to ``p``, in its group "many nodes" (the order ``--help``
    lists them); their defaults are :class:`~nonstop.config.JobConfig`'s."""
    c = JobConfig(script="")
    g = p.add_argument_group("many nodes")
    _where_args(g, c)
    _replica_args(g, c)
    _preempt_args(g, c)
    _elastic_args(g, c)
    _mesh_args(g, c)


def _where_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """Where the nodes meet: their count and ranks, the coordinator, the control store, leases."""
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


def _replica_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """Peer replicas, the job secret, quarantine and joining."""
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


def _preempt_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """Preemption notices: SIGTERM, a file in the job dir, or a polled endpoint."""
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


def _elastic_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """Elasticity: shrinking without a spare, and what a shrunk job trains on."""
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


def _mesh_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """A sharded job's mesh, its groups across generations, and how swaps move a step."""
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
