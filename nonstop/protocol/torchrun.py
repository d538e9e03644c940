"""torchrun's worker environment: what a process playing a rank finds in ``os.environ``.

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
                                fixed for the process's life (:mod:`nonstop.devices.inventory`;
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
``MASTER_PORT``                 :mod:`nonstop.agent.node`): nonstop's process group rendezvous
                                goes through the coordinator, not a ``TCPStore`` there, so a
                                script must not call ``init_process_group`` itself —
                                ``nonstop.init()`` builds the group
``TORCHELASTIC_RESTART_COUNT``  failures the job has recovered from (or is recovering from) when
                                the generation starts — torchrun's count of worker-group restarts;
                                under nonstop the survivors' processes are not restarted
==============================  =================================================================

The coordinator computes the values (:func:`nonstop.coordinator.torch_env.rank_env`); a node agent
starts every process from a base environment without them (:func:`without_rank_vars`).
"""

from __future__ import annotations

__all__ = ["RANK_VARS", "without_rank_vars"]

# The variables :func:`~nonstop.coordinator.torch_env.rank_env` computes for a process playing a
# rank. A process inherits none of
# them from whoever started its agent (a shell inside a torchrun job, a test that set them): a spare
# has none until it is given a rank, and a rank has the coordinator's values only.
RANK_VARS = (
    "RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


def without_rank_vars(env: dict[str, str]) -> dict[str, str]:
    """``env`` less :data:`RANK_VARS`: the base environment an agent gives every process it starts."""
    return {k: v for k, v in env.items() if k not in RANK_VARS}
