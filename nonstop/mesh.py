"""The job's device mesh: ``--mesh replicate=R,shard=S,tp=T`` (any subset), pure.

A sharded job declares how its ranks form a mesh. The dims always nest in one order, outermost
first -- ``replicate`` (HSDP's replica groups), ``shard`` (FSDP's shard groups), ``tp`` (tensor
parallel) -- and ranks are numbered row-major over the dims given, so a TP group is ``T``
consecutive ranks and a shard group ``S x T`` consecutive ones::

    replicate=2,shard=2     rank = 2*r + s          ranks {0,1} and {2,3} shard, {0,2} and {1,3} replicate
    shard=2,tp=2            rank = 2*s + t          TP groups {0,1}, {2,3}

A node plays consecutive ranks (``nproc_per_node`` of them), so a TP group stays within a node
exactly when ``T`` divides ``nproc_per_node``; :meth:`MeshSpec.check` refuses a mesh that breaks
that, or whose product is not the world size, with one line that says what to change.

The coordinator fixes rank <-> coordinates with this numbering for the life of the job (a
replacement plays the same coordinates); the worker builds a ``torch.distributed.device_mesh.
DeviceMesh`` with these dim names (:func:`nonstop.train.sharded.build_mesh`).

**Elastic** (``--min-world-size``): with ``replicate`` of 2 or more what shrinks and grows is a
whole replica group (``S x T`` consecutive ranks, one full copy of the sharded state): every rank
that stays keeps its ``shard`` and ``tp`` coordinates, so its own shards are still its state.
Without replicas (``shard`` of 2 or more) it is a TP group (``T`` ranks), and the state is
resharded over the shard groups that stay (:attr:`MeshSpec.reshards`). A smaller generation's
mesh is the job's with that dim cut (:meth:`MeshSpec.with_world`). The data shards are the
full-size job's data-parallel indices (``replicate x shard``): the groups that stay play the
dropped groups' batches by gradient accumulation (:meth:`MeshSpec.data_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nonstop.errors import UsageError
from nonstop.policy.elastic import play_shards

__all__ = ["DIMS", "MeshSpec"]

DIMS = ("replicate", "shard", "tp")  # outermost first
_EXAMPLE = "e.g. --mesh shard=4 or --mesh replicate=2,shard=2 or --mesh shard=2,tp=2"


@dataclass(frozen=True)
class MeshSpec:
    """The mesh's dims in nesting order (only those given), each with its size."""

    dims: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """``"replicate=2,shard=2"`` -> the spec; a malformed one raises :class:`UsageError`."""
        sizes: dict[str, int] = {}
        for part in (p.strip() for p in text.split(",")):
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or not name:
                raise UsageError(f"--mesh: {part!r} is not NAME=SIZE ({_EXAMPLE})")
            if name not in DIMS:
                raise UsageError(f"--mesh: unknown dim {name!r}; the dims are {', '.join(DIMS)} ({_EXAMPLE})")
            if name in sizes:
                raise UsageError(f"--mesh: dim {name!r} is given twice")
            try:
                size = int(value)
            except ValueError:
                raise UsageError(f"--mesh: the size of {name!r} must be an integer (got {value!r})") from None
            if size < 1:
                raise UsageError(f"--mesh: the size of {name!r} must be at least 1 (got {size})")
            sizes[name] = size
        return cls.of(sizes)

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> MeshSpec:
        unknown = set(sizes) - set(DIMS)
        if unknown or not sizes:
            raise ValueError(f"a mesh needs one or more of {DIMS}, got {sorted(sizes)}")
        return cls(tuple((d, int(sizes[d])) for d in DIMS if d in sizes))

    def __str__(self) -> str:
        return ",".join(f"{d}={n}" for d, n in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, n in self.dims)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def size(self, dim: str) -> int:
        """The size of ``dim`` (1 when the mesh does not have it)."""
        return dict(self.dims).get(dim, 1)

    def check(self, *, world_size: int, nproc_per_node: int) -> None:
        """Refuse a mesh the job cannot run (one line, what to change)."""
        if self.world_size != world_size:
            raise UsageError(
                f"--mesh {self} has {self.world_size} ranks but the job has {world_size} "
                "(nnodes x nproc-per-node): make the product of the sizes equal the world size"
            )
        tp = self.size("tp")
        if nproc_per_node % tp != 0:
            raise UsageError(
                f"--mesh {self}: a tensor-parallel group of {tp} ranks would span nodes of "
                f"{nproc_per_node} processes; tp must divide --nproc-per-node"
            )

    def coords(self, rank: int) -> dict[str, int]:
        """Rank -> its index along every dim (row-major)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size}")
        out: dict[str, int] = {}
        for name, size in reversed(self.dims):
            rank, out[name] = divmod(rank, size)
        return {d: out[d] for d in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in self.dims:
            i = coords.get(name, 0)
            if not 0 <= i < size:
                raise ValueError(f"index {i} is outside dim {name} of size {size}")
            rank = rank * size + i
        return rank

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The ranks along ``dim`` that share every other coordinate with ``rank``."""
        c = self.coords(rank)
        return [self.rank_of({**c, dim: i}) for i in range(self.size(dim))]

    def changed_groups(self, moved: Iterable[int]) -> list[tuple[str, tuple[int, ...]]]:
        """The groups ``(dim, ranks)`` that a generation must build when the ranks ``moved`` are
        played by new processes at a step boundary (a migration, a spare that joins): those with
        a moved rank in them. Every other group is kept, its members unchanged
        (:mod:`nonstop.train.meshgroups`); the simulator charges the rebuild of these only."""
        out: set[tuple[str, tuple[int, ...]]] = set()
        for rank in moved:
            for dim in self.names:
                out.add((dim, tuple(self.group_of(rank, dim))))
        return sorted(out)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index (replicate x shard): ranks of one TP group read the same batch."""
        c = self.coords(rank)
        return c.get("replicate", 0) * self.size("shard") + c.get("shard", 0)

    @property
    def dp_size(self) -> int:
        return self.size("replicate") * self.size("shard")

    # -- one copy per node of what replica groups hold alike (snapshot/nodecopy.py) ----------------
    def copy_group(self, rank: int) -> int:
        """The copy group of ``rank``: its index within its replica group (its coordinates other
        than ``replicate``). Ranks of one copy group in different replica groups hold the same
        shards -- bitwise, when the model replicates along ``replicate`` (HSDP) -- and keep
        the same copy group when an elastic resize renumbers them (whole replica groups go)."""
        return rank % (self.world_size // self.size("replicate"))

    def copy_groups_on_node(self, nproc_per_node: int) -> int:
        """How many copy groups a node of ``nproc_per_node`` consecutive ranks holds two ranks or
        more of -- each kept once by a node copy -- or 0 when it holds none twice (a replica group
        fills the node or more, the usual HSDP layout: every rank keeps its own whole snapshot).
        Keeping a copy per group there too would let a twin node's replica holder take the shards
        from its own memory, but a lost-node test failed under load in that configuration
        (survivors' collectives failing before the node's loss was declared; cause not found):
        not enabled."""
        per_replica = self.world_size // self.size("replicate")
        if self.size("replicate") < 2 or nproc_per_node <= per_replica:
            return 0
        return per_replica

    # -- elastic: whole replica groups, or shard groups with a reshard ------------------------------
    @property
    def elastic_dim(self) -> str | None:
        """The dim an elastic job resizes: ``replicate`` when the job has 2 or more replica
        groups (whole copies of the state come and go; nothing is resharded), else ``shard``
        when it has 2 or more (the state is resharded over fewer shard groups), else None."""
        if self.size("replicate") >= 2:
            return "replicate"
        return "shard" if self.size("shard") >= 2 else None

    @property
    def reshards(self) -> bool:
        """Whether a resize cuts every rank's shards anew (the elastic dim is ``shard``)."""
        return self.elastic_dim == "shard"

    @property
    def group_size(self) -> int:
        """Ranks that come and go together: a replica group (``shard x tp``), or without
        replicas a TP group (``tp``)."""
        dim = self.elastic_dim or "replicate"
        return self.world_size // self.size(dim)

    def with_world(self, world_size: int) -> MeshSpec:
        """The mesh of a generation of ``world_size`` ranks: the job's with its elastic dim cut
        to fit (``world_size`` must be a whole number of groups, at most the job's)."""
        if world_size == self.world_size:
            return self
        unit, dim = self.group_size, self.elastic_dim
        if dim is None or world_size % unit or not 0 < world_size < self.world_size:
            raise ValueError(
                f"a generation of {world_size} ranks does not fit --mesh {self}: an elastic sharded "
                f"job runs whole groups of {unit} ranks along {dim or 'replicate or shard'}, at most "
                f"{self.world_size // unit}"
            )
        return MeshSpec(tuple((d, world_size // unit if d == dim else n) for d, n in self.dims))

    def data_shards(self, world_size: int, *, drop: bool = False) -> tuple[tuple[int, ...], ...]:
        """The data shards (the full-size job's data-parallel indices) each rank of a generation
        of ``world_size`` ranks plays: one at full size (its ``dp_rank``); after a shrink the
        groups that stay play the dropped groups' batches too (contiguous, balanced): a replica
        group those of every group it stands for, at its own ``shard`` index; without replicas
        a shard index those of the shard indices it stands for. Ranks of one TP group play the
        same shards. ``drop`` (``--shrink-batch drop``): each rank plays only the index at its own
        coordinates; the dropped groups' batches are skipped while the job is shrunk."""
        now = self.with_world(world_size)
        shard = self.size("shard")
        groups = play_shards(self.size("replicate"), self.size("replicate"), now.size("replicate"), drop=drop)
        shards = play_shards(shard, shard, now.size("shard"), drop=drop)
        out = []
        for r in range(world_size):
            c = now.coords(r)
            mine = groups[c.get("replicate", 0)]
            out.append(tuple(g * shard + s for g in mine for s in shards[c.get("shard", 0)]))
        return tuple(out)

    def check_elastic(self, *, min_world_size: int) -> None:
        """Refuse an elastic setting this mesh cannot follow (one line, what to change)."""
        if self.elastic_dim is None:
            raise UsageError(
                f"--min-world-size with --mesh {self}: an elastic sharded job shrinks by whole replica "
                "groups (replicate=2 or more) or shard groups (shard=2 or more); this mesh has neither, "
                "so it keeps its size (spares and the durable tier recover it)"
            )
        unit = self.group_size
        if min_world_size % unit:
            what = "replica groups" if self.elastic_dim == "replicate" else "tensor-parallel groups"
            raise UsageError(
                f"--min-world-size {min_world_size} with --mesh {self}: it must be a whole number of "
                f"{what} of {unit} ranks (e.g. --min-world-size {unit})"
            )
