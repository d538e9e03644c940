"""The flags of ``nonstop run`` for the nodes of a job (``--nnodes``, ``--coordinator``, the control
store, replication, quarantine, preemption, elasticity, ``--mesh``): :func:`node_args` adds them to
a parser, in the group "many nodes" (the control store's, the leases' and quarantine's, and the
preemption notices' flags are defined beside the parts they fill: :mod:`.security`,
:mod:`.detection`, :mod:`.operations`); :func:`node_config` reads back the job's own fields,
:func:`replication_config` and :func:`elastic_config` their parts."""

from __future__ import annotations

import argparse

from nonstop.cli.env import nnodes_value
from nonstop.cli.flags.detection import lease_arg, quarantine_args
from nonstop.cli.flags.operations import preempt_args, swap_transfer_arg
from nonstop.cli.flags.security import secret_arg, store_args
from nonstop.config import SHRINK_BATCHES, SURVIVOR_MODES, ElasticConfig, JobConfig, ReplicationConfig

__all__ = ["elastic_config", "node_args", "node_config", "replication_config"]


def node_args(p: argparse.ArgumentParser) -> None:
    """Add the flags of a job's nodes to ``p``, in its group "many nodes" (the order ``--help``
    lists them); their defaults are :class:`~nonstop.config.JobConfig`'s and its parts'."""
    c = JobConfig(script="")
    g = p.add_argument_group("many nodes")
    _where_args(g)
    _replica_args(g, c)
    preempt_args(g)
    _elastic_args(g, c.elastic)
    _mesh_args(g, c)


def _where_args(g: argparse._ArgumentGroup) -> None:
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
    store_args(g)
    g.add_argument(
        "--data-host",
        default=None,
        help="address this node's data plane (peer replicas) binds and advertises "
        "(default: node 0 the coordinator's host; others the local address that reaches it)",
    )
    lease_arg(g)


def _replica_args(g: argparse._ArgumentGroup, c: JobConfig) -> None:
    """Peer replicas, the job secret, quarantine and joining."""
    g.add_argument(
        "--replicas",
        type=int,
        default=c.replication.replicas,
        help="peer copies of each rank's snapshot (default %(default)s)",
    )
    g.add_argument("--replica-bandwidth", type=float, default=None, metavar="MB/S", help="cap on replication")
    secret_arg(g)
    quarantine_args(g)
    g.add_argument("--join-timeout", type=float, default=c.join_timeout_s, metavar="SECONDS")


def _elastic_args(g: argparse._ArgumentGroup, c: ElasticConfig) -> None:
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
        default=c.wait_s,
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
    swap_transfer_arg(g)
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
    """The job's own fields of the flags above (its nodes, where they meet, its mesh)."""
    return {
        "nnodes": ns.nnodes,
        "node_rank": ns.node_rank,
        "coordinator": ns.coordinator,
        "domain": ns.domain,
        "data_host": ns.data_host,
        "join_timeout_s": ns.join_timeout,
        "mesh": ns.mesh,
        "keep_groups": not ns.rebuild_all_groups,
    }


def replication_config(ns: argparse.Namespace) -> ReplicationConfig:
    """The job's replication part (``--replicas``, ``--replica-bandwidth``)."""
    return ReplicationConfig(replicas=ns.replicas, bandwidth_mb_s=ns.replica_bandwidth)


def elastic_config(ns: argparse.Namespace) -> ElasticConfig:
    """The job's elastic part (``--min-world-size``, ``--elastic-wait``, ``--survivors``, ...)."""
    return ElasticConfig(
        min_world_size=ns.min_world_size,
        wait_s=ns.elastic_wait,
        survivors=ns.survivors,
        shrink_batch=ns.shrink_batch,
        shards_per_rank=ns.shards_per_rank,
    )
