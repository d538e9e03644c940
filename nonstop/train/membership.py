"""What a worker plays in the current generation: its rank, the world size, its data shards and
its coordinates on the mesh (what a training script reads every step, through
:class:`~nonstop.train.session.Session`'s properties).

A generation's ``reconfigure`` message sets them (:meth:`Membership.apply`), and the worker's
environment follows: torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ... as :mod:`nonstop.coordinator.torch_env` defines them), as
does the label the node agent puts on its output lines.

Threading contract: :meth:`Membership.apply` on the main thread only (the training loop's, between
steps); the attributes may be read from any thread.
"""

from __future__ import annotations

import os

from nonstop.devices.inventory import DEVICE
from nonstop.mesh import MeshSpec
from nonstop.protocol.worker import ReconfigureMsg
from nonstop.workerlog import announce_rank

__all__ = ["Membership"]


class Membership:
    """Rank, world size, shards and mesh coordinates of this process in its generation.

    ``mesh``: the job's ``--mesh`` (None: a data-parallel job). Until the first :meth:`apply` the
    process is a spare: rank 0 of a world of size 0, playing no shard."""

    def __init__(self, mesh: str | None) -> None:
        self._mesh = MeshSpec.parse(mesh) if mesh is not None else None
        self.rank = 0
        self.world_size = 0
        self.shards: tuple[int, ...] = ()
        self.num_shards = 0  # the job's
        # the shards the generation plays, the gradient mean's divisor: the job's, or fewer while
        # a shrink drops the lost ranks' shares (--shrink-batch drop); a step trains
        # shards_played micro-batches of the global batch
        self.shards_played = 0

    def apply(self, msg: ReconfigureMsg) -> None:
        """Take the rank, world size and data shards of the generation ``msg`` (a reconfigure)
        starts, and set this process's environment to match."""
        self.rank = msg.rank
        self.world_size = msg.world_size
        self.shards = msg.shards if msg.shards is not None else (self.rank,)
        self.num_shards = msg.num_shards if msg.num_shards is not None else self.world_size
        self.shards_played = msg.divisor if msg.divisor is not None else self.num_shards
        # torchrun's variables as the coordinator computed them (coordinator/torch_env.py); a message
        # without them (an older coordinator) still sets the rank and the world size
        env = dict(msg.env)
        env.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size))
        device = os.environ.get(DEVICE)
        if device is not None:  # a device node: LOCAL_RANK is this process's device, for life
            env["LOCAL_RANK"] = device  # (devices/inventory.py), whatever the message says
        env.update(ROLE_RANK=env["RANK"], ROLE_WORLD_SIZE=env["WORLD_SIZE"])
        os.environ.update(env)
        announce_rank(self.rank)  # the agent labels this process's output lines with it from here

    @property
    def mesh(self) -> MeshSpec | None:
        """This generation's mesh: the job's ``--mesh``, with fewer replica groups after an
        elastic shrink (None: a data-parallel job)."""
        if self._mesh is None:
            return None
        return self._mesh.with_world(self.world_size) if self.world_size else self._mesh

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
