"""What a worker plays in the current generation: its rank, the world size, its data shards and
its coordinates on the mesh (the part of :class:`~nonstop.train.session.Session` a training
script reads every step).

A generation's ``reconfigure`` message sets them (:meth:`Membership._set_membership`), and the
worker's environment follows: torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ... as :mod:`nonstop.coordinator.torch_env` defines them), as
does the label the node agent puts on its output lines. Main thread only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from torch.nn.parallel import DistributedDataParallel

from nonstop.config import WorkerEnv
from nonstop.control.channel import Message
from nonstop.devices.inventory import DEVICE
from nonstop.mesh import MeshSpec
from nonstop.train.ddp import CanonicalGradSync
from nonstop.train.trainee import accumulate
from nonstop.workerlog import announce_rank

__all__ = ["Membership"]


class Membership:
    """Rank, world size, shards and mesh coordinates of this process in its generation."""

    env: WorkerEnv
    rank: int
    world_size: int
    _sync: CanonicalGradSync | None

    def _set_membership(self, msg: Message) -> None:
        """Rank, world size and data shards of the generation ``msg`` (a reconfigure) starts."""
        self.rank = int(msg["rank"])
        self.world_size = int(msg["world_size"])
        self.shards: tuple[int, ...] = tuple(int(k) for k in msg.get("shards", (self.rank,)))
        self.num_shards: int = int(msg.get("num_shards", self.world_size))  # the job's
        # the shards the generation plays, the gradient mean's divisor: the job's, or fewer while
        # a shrink drops the lost ranks' shares (--shrink-batch drop); a step trains
        # shards_played micro-batches of the global batch
        self.shards_played: int = int(msg.get("divisor", self.num_shards))
        if self._sync is not None:
            self._sync.set_shards(self.shards, self.shards_played)
        # torchrun's variables as the coordinator computed them (coordinator/torch_env.py); a message
        # without them (an older coordinator) still sets the rank and the world size
        env = {str(k): str(v) for k, v in dict(msg.get("env", {})).items()}
        env.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        device = os.environ.get(DEVICE)
        if device is not None:  # a device node: LOCAL_RANK is this process's device, for life
            env["LOCAL_RANK"] = device  # (devices/inventory.py), whatever the message says
        env.update(ROLE_RANK=env["RANK"], ROLE_WORLD_SIZE=env["WORLD_SIZE"])
        os.environ.update(env)
        announce_rank(self.rank)  # the agent labels this process's output lines with it from here

    def shard_steps(self, model: torch.nn.Module) -> Iterator[int]:
        """The data shards this rank plays in this step, for gradient accumulation::

            for shard in session.shard_steps(model):
                x, y = batch_for(step, shard)          # shard k: what rank k of the full job reads
                loss_fn(model(x), y).backward()

        In a job at its full size each rank plays one shard (its rank; a sharded job's: its
        ``dp_rank``). After an elastic shrink a rank plays several: the gradients of all but the
        last are accumulated locally (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``),
        the last backward reduces, and the sum is divided by the number of shards, so the global
        batch and its samples are those of the full-size job (with ``--shrink-batch drop`` a
        shrunk rank plays its own shards only, the sum divided by the shards played). In an
        elastic data-parallel job the mean is bitwise the same at every world size
        (:mod:`nonstop.train.exactsum`): each shard's gradient is kept apart and the shards are
        summed in their order."""
        if self._sync is not None and self._sync.exact and isinstance(model, DistributedDataParallel):
            return self._sync.accumulate(model)
        return accumulate(model, self.shards)

    @property
    def mesh(self) -> MeshSpec | None:
        """This generation's mesh: the job's ``--mesh``, with fewer replica groups after an
        elastic shrink (None: a data-parallel job)."""
        if self.env.mesh is None:
            return None
        spec = MeshSpec.parse(self.env.mesh)
        return spec.with_world(self.world_size) if self.world_size else spec

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the batch it reads (ranks of one TP group read the
        same); the rank itself in a data-parallel job."""
        mesh = self.mesh
        return mesh.dp_rank(self.rank) if mesh is not None else self.rank

    @property
    def dp_size(self) -> int:
        """How many different batches the job reads per step (its data-parallel degree)."""
        mesh = self.mesh
        return mesh.dp_size if mesh is not None else self.world_size
