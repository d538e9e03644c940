"""The values of torchrun's worker environment (:mod:`nonstop.protocol.torchrun`, which lists the
variables and what each means) for a process playing a rank, computed from the coordinator's view.

Coordinator thread only (it reads and updates :class:`~nonstop.coordinator.view.JobView`).
"""

from __future__ import annotations

from nonstop.coordinator.view import JobView, node_order
from nonstop.policy.phase import JobPhase

__all__ = ["local_ranks", "rank_env"]


def local_ranks(view: JobView, node: str, extra: tuple[int, int] | None = None) -> dict[int, int]:
    """rank -> LOCAL_RANK for the ranks ``node`` plays (plus ``extra``: ``(rank, spawn id)`` of a
    process about to play a rank there, not a member yet). Indexes are kept on the worker records:
    a process keeps its index; one without an index takes the smallest free one (ranks in order)."""
    playing = {r: sid for r, sid in view.members.items() if view.workers[sid].node == node}
    if extra is not None:
        playing[extra[0]] = extra[1]
    taken: set[int] = set()
    out: dict[int, int] = {}
    for rank in sorted(playing):
        idx = view.workers[playing[rank]].local_rank
        if idx is not None and idx not in taken:
            taken.add(idx)
            out[rank] = idx
    free = (i for i in range(len(playing) + len(taken) + 1) if i not in taken)
    for rank in sorted(playing):
        if rank not in out:
            out[rank] = next(free)
            view.workers[playing[rank]].local_rank = out[rank]
    return out


def rank_env(view: JobView, sid: int, rank: int, world_size: int | None = None) -> dict[str, str]:
    """torchrun's variables (the module docstring) for process ``sid`` playing ``rank`` in a world
    of ``world_size`` (default the view's); assigns its LOCAL_RANK if it has none."""
    world = view.world_size if world_size is None else world_size
    node = view.workers[sid].node
    local = local_ranks(view, node, (rank, sid))
    nodes = sorted(view.nodes, key=node_order)
    if view.phase is JobPhase.STARTING:  # the start plan: every node plays --nproc ranks
        local_world = max(view.nodes[node].nproc, len(local))
        group_world = len(view.alive_nodes())
    else:
        local_world = len(local)
        group_world = len({view.workers[s].node for s in view.members.values()} | {node})
    return {
        "RANK": str(rank),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "ROLE_WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local[rank]),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(nodes.index(node) if node in nodes else 0),
        "GROUP_WORLD_SIZE": str(group_world),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RESTART_COUNT": str(view.failures_total),
    }
