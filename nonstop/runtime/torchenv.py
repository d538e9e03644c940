"""torchrun's worker environment, as the coordinator sees the job: what a process playing a rank
finds in ``os.environ``.

A process launched as a rank gets these variables before the script starts (the ``spawn``
message carries them to its agent); every ``reconfigure`` message carries them again and
``nonstop.init()`` / a recovery sets them (:mod:`nonstop.train.membership`), so a hot spare that
takes a rank, a rank that moves and a survivor renumbered by an elastic shrink read their new
values once ``nonstop.init()`` returns or the generation starts.

==============================  =================================================================
``RANK``, ``ROLE_RANK``         the rank (one role, torchrun's ``default``)
``WORLD_SIZE``,                 the generation's world size
``ROLE_WORLD_SIZE``
``LOCAL_RANK``                  on a node with accelerator devices: the index of the process's
                                own device, given by its agent at spawn (spares included) and
                                fixed for the process's life (:mod:`nonstop.runtime.devices`;
                                after a recovery it need not be below ``LOCAL_WORLD_SIZE``: a
                                spare on GPU 7 taking rank 3 keeps 7). On a CPU node: the rank's
                                index among the ranks its node plays: a process keeps the index
                                it was given while it lives; a rank new to a node (a spare
                                taking it, a fresh process) takes the smallest index no other
                                rank on that node holds
``LOCAL_WORLD_SIZE``            how many ranks the node plays (at the job's start: ``--nproc``)
``GROUP_RANK``                  the node's index among the job's nodes (by name, numbers first)
``GROUP_WORLD_SIZE``            how many nodes play ranks
``ROLE_NAME``                   ``default``
``MASTER_ADDR``,                the coordinator's host and control port (set by the node agent,
``MASTER_PORT``                 :mod:`nonstop.runtime.node`): nonstop's process group rendezvous
                                goes through the coordinator, not a ``TCPStore`` there, so a
                                script must not call ``init_process_group`` itself —
                                ``nonstop.init()`` builds the group
``TORCHELASTIC_RESTART_COUNT``  failures the job has recovered from (or is recovering from) when
                                the generation starts — torchrun's count of worker-group restarts;
                                under nonstop the survivors' processes are not restarted
==============================  =================================================================

Coordinator thread only (it reads and updates :class:`~nonstop.runtime.view.JobView`).
"""

from __future__ import annotations

from nonstop.runtime.phase import JobPhase
from nonstop.runtime.view import JobView, node_order

__all__ = ["RANK_VARS", "rank_env", "without_rank_vars"]

# The variables :func:`rank_env` computes for a process playing a rank. A process inherits none of
# them from whoever started its agent (a shell inside a torchrun job, a test that set them): a spare
# has none until it is given a rank, and a rank has the coordinator's values only.
RANK_VARS = (
    "RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


def without_rank_vars(env: dict[str, str]) -> dict[str, str]:
    """``env`` less :data:`RANK_VARS`: the base environment an agent gives every process it starts."""
    return {k: v for k, v in env.items() if k not in RANK_VARS}


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
