"""What nonstop's recoveries cost at a cluster's scale: the laws that
:class:`~nonstop.sim.nonstop_strategy.Nonstop` times its detection and its rebuilds with."""

from __future__ import annotations

import math

from nonstop.mesh import MeshSpec
from nonstop.policy import decisions
from nonstop.policy.decisions import FailureKind, Tier
from nonstop.sim.api import JobSpec, require
from nonstop.sim.calibrate import Calibration, rendezvous_s
from nonstop.sim.strategies import DEFAULT_GROUP_NODES

__all__ = ["default_replica_nodes", "detect_s", "has_donors", "restore_tier", "swap_rebuild_s"]


def default_replica_nodes(job: JobSpec) -> int:
    """The nodes of one model copy when nobody says: the job torchft-like models (its replica
    groups, :data:`DEFAULT_GROUP_NODES` nodes: Llama 3 405B's TP 8 x PP 16), so a side-by-side
    run charges both strategies for the same job."""
    return math.gcd(job.num_nodes, DEFAULT_GROUP_NODES)


def swap_rebuild_s(job: JobSpec, replica_nodes: int) -> float:
    """The rebuild a step-boundary swap of one node costs: the rendezvous of the widest group
    with one of the node's ranks in it (a group's rendezvous scales with the nodes it spans,
    :func:`rendezvous_s`); every other group is kept. The default group is new too, but a
    sharded job's is created unbound and lazy (``train/devicegroups.py``, independent mode: no
    NCCL communicator, no gloo connection): a store exchange, not charged. ``replica_nodes`` 0:
    one data-parallel group of the whole job."""
    if not replica_nodes:
        return rendezvous_s(job.num_nodes)
    require(
        job.num_nodes % replica_nodes == 0,
        f"--replica-nodes must divide the job's {job.num_nodes} nodes; got {replica_nodes}",
    )
    g = job.gpus_per_node
    spec = MeshSpec.of({"replicate": job.num_nodes // replica_nodes, "shard": replica_nodes * g})
    spans = [len({r // g for r in ranks}) for _, ranks in spec.changed_groups(range(g))]
    return rendezvous_s(max(spans))


def detect_s(cal: Calibration, kind: FailureKind) -> float:
    """How long nonstop takes to notice a failure of ``kind``: a lost node's lease, a hang's
    heartbeat timeout, else the agent's exit report."""
    if kind is FailureKind.NODE_LOST:
        return cal.node_lease_s
    if kind is FailureKind.HANG:
        return cal.heartbeat_timeout_s + cal.detect_exit_s
    return cal.detect_exit_s


def has_donors(snapshot_every: int, model_copies: int) -> bool:
    """Whether a job's failures between two snapshots are rescued whole (the simulator's
    question about :mod:`nonstop.policy.rescue`, which the runtime answers from the survivors'
    reports): with K > 1, a lost rank's shards survive in another model copy -- any rank of a
    data-parallel job (``model_copies`` its ranks), a counterpart in another replica group of an
    HSDP job -- so its replacement has a donor; with one copy (FSDP alone) it has none."""
    return snapshot_every > 1 and model_copies >= 2


def restore_tier(
    target: str,
    node: int,
    *,
    num_nodes: int,
    alive: bool,
    holders: list[int],
    rescued: bool,
    survivor: bool = False,
) -> Tier:
    """Where the ranks of node ``node`` (of ``num_nodes``), played next on ``target``, restore
    from: the runtime's :func:`~nonstop.policy.decisions.restore_source` (called through its
    module: a test patches it), asked with what the plan's inventory holds of their restore step --
    the node's own slots if it is ``alive`` (or the ranks are a ``survivor``'s, restoring their
    own), the replicas on the live ``holders``; or, when the survivors ``rescued`` a step newer
    than any snapshot (:mod:`nonstop.policy.rescue`), only their donor's rescue (a survivor on
    another node; a one-node job has none). Held nowhere in memory: the durable tier, which always
    has the newest persisted step."""
    name = f"n{node}"
    where: list[tuple[str, str]]
    if survivor:
        where = [(name, "local")]
    elif rescued and num_nodes > 1:
        where = [(f"n{(node + 1) % num_nodes}", "local")]  # the donor's own slots
    else:
        where = ([(name, "local")] if alive else []) + [(f"n{h}", "replica") for h in holders]
    src = decisions.restore_source(target=target, holders=where, durable=True)
    assert src is not None  # durable=True: the durable tier serves what memory does not
    return src.tier
