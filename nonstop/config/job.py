"""The job's config (:class:`JobConfig`): what the job itself is (its script, its ranks and nodes,
where node 0 listens, its mesh, its job directory) and one small typed part per component that
reads it, composed by the CLI (``nonstop/cli/flags/``):

======================  =========================================================================
``config.snapshot``     :class:`~nonstop.config.snapshot.SnapshotConfig`: the memory tier
``config.persist``      :class:`~nonstop.config.snapshot.PersistConfig`: the durable tier
``config.detection``    :class:`~nonstop.config.detection.DetectionConfig`: hangs, stragglers,
                        probes, leases, quarantine
``config.replication``  :class:`~nonstop.config.replication.ReplicationConfig`: peer replicas
``config.elastic``      :class:`~nonstop.config.elastic.ElasticConfig`: shrink, grow, survivors
``config.control``      :class:`~nonstop.config.control.ControlConfig`: store, secret, TLS
``config.operations``   :class:`~nonstop.config.operations.OperationsConfig`: metrics,
                        preemption notices, a migration's swap
======================  =========================================================================

Each part validates its own fields when it is built; :class:`JobConfig` checks, at construction,
what needs several of them or the job's shape (``--replicas`` against ``--nnodes``, an etcd store
against a fixed ``--coordinator`` port, ``--min-world-size`` and ``--survivors continue`` against
the world size and the mesh). A bad value fails at start, in one line naming its flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nonstop.config.control import ControlConfig
from nonstop.config.detection import DetectionConfig
from nonstop.config.elastic import ElasticConfig
from nonstop.config.enums import ShrinkBatch, SnapshotCopies, SurvivorMode
from nonstop.config.operations import OperationsConfig
from nonstop.config.replication import ReplicationConfig
from nonstop.config.snapshot import PersistConfig, SnapshotConfig
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec

__all__ = ["JobConfig"]


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything ``nonstop run`` needs to start a job: the job itself, then its parts.

    ``script``/``script_args``: what each rank runs (``-m NAME``: a module). ``nproc_per_node``
    ranks on each of ``nnodes`` nodes, ``spares`` hot spares per node; this is node
    ``node_rank``. ``host``/``port``: where the control server binds (one node); ``coordinator``
    (HOST:PORT): where node 0 listens and the others connect. ``domain``: this node's failure
    domain (rack, zone; default: the node itself). ``data_host``: this node's data plane address
    (default: the one that reaches the coordinator). ``join_timeout_s``: how long node 0 waits for
    every node to join. ``max_restarts``: failures the job survives. ``faults``: injected faults
    (``--fail``). ``extra_env``: more environment for the workers (the log settings). ``mesh``:
    ``replicate=R,shard=S,tp=T`` (nonstop/mesh.py; None: data-parallel DDP). ``keep_groups``: a
    new generation keeps the mesh groups nothing changed (train/meshgroups.py)."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    spares: int = 0
    job_dir: Path = field(default_factory=lambda: Path(".nonstop") / "job")
    host: str = "127.0.0.1"
    port: int = 0
    max_restarts: int = 10
    faults: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    # -- many nodes ------------------------------------------------------------------
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    domain: str | None = None
    data_host: str | None = None
    join_timeout_s: float = 300.0
    mesh: str | None = None
    keep_groups: bool = True
    # -- the parts, one per component that reads them --------------------------------
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    operations: OperationsConfig = field(default_factory=OperationsConfig)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def node_copy_groups(self) -> int:
        """The copy groups a node keeps one copy each of (snapshot/nodecopy.py): a DDP job's
        ranks are one group; an HSDP job's are its shard coordinates when a node holds ranks of
        several replica groups (:meth:`MeshSpec.copy_groups_on_node`); 0: none (every rank
        keeps its own whole copy: --snapshot-copies rank, or no two ranks of a node alike)."""
        if self.snapshot.copies is not SnapshotCopies.NODE:
            return 0
        if self.mesh is None:
            return 1
        return MeshSpec.parse(self.mesh).copy_groups_on_node(self.nproc_per_node)

    @property
    def coordinator_addr(self) -> tuple[str, int]:
        if self.coordinator is None:
            return (self.host, self.port)
        host, _, port = self.coordinator.rpartition(":")
        return (host, int(port))

    @property
    def checkpoint_url(self) -> str:
        """The durable tier's root: ``--persist``, else ``<job_dir>/checkpoints``."""
        url = self.persist.url
        return url if url is not None else str(self.job_dir.resolve() / "checkpoints")

    @property
    def min_world(self) -> int:
        """The smallest world size the job may shrink to (its full size: never shrinks)."""
        return self.elastic.min_world_size or self.world_size

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})")
        if self.spares < 0:
            raise UsageError(f"--spares must be >= 0 (got {self.spares})")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in 0..65535 (got {self.port}); 0 picks a free port")
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        self._check_nodes()
        self._check_store()
        self._check_elastic()

    def _check_nodes(self) -> None:
        """The nodes, where they meet, and the replicas they hold for one another."""
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes} "
                f"(got {self.node_rank})"
            )
        if self.nnodes > 1 and self.coordinator is None:
            raise UsageError("a job of several nodes needs --coordinator HOST:PORT (node 0 listens there)")
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise UsageError(f"--coordinator must be HOST:PORT (got {self.coordinator!r})")
        replicas = self.replication.replicas
        if replicas < 0 or (self.nnodes > 1 and replicas > self.nnodes - 1):
            raise UsageError(
                f"--replicas must be in 0..{max(0, self.nnodes - 1)} (a replica lives on another node; "
                f"got {replicas})"
            )

    def _check_store(self) -> None:
        """An external store: a restarted coordinator must be found where the nodes reconnect,
        and the job secret is also the store's password."""
        if not self.control.uses_store:
            return
        if self.coordinator is None or self.coordinator_addr[1] == 0:
            raise UsageError(
                "--store etcd://... needs --coordinator HOST:PORT with a fixed port: a restarted "
                "coordinator listens where the nodes reconnect"
            )
        if self.control.secret_file is None:
            raise UsageError(
                "--store etcd://... needs --secret-file on every node: the job secret is also the "
                "etcd password (scripts/etcd.sh start DIR PORT SECRET_FILE)"
            )

    def _check_elastic(self) -> None:
        """Shrinking, survivors and the mesh against the job's world size."""
        e = self.elastic
        if not 0 <= e.min_world_size <= self.world_size:
            raise UsageError(
                f"--min-world-size must be in 0..{self.world_size} (the job's world size; 0 never "
                f"shrinks; got {e.min_world_size})"
            )
        if self.mesh is not None:
            spec = MeshSpec.parse(self.mesh)
            spec.check(world_size=self.world_size, nproc_per_node=self.nproc_per_node)
            if e.shards_per_rank != 1:
                raise UsageError(
                    "--shards-per-rank is not supported with --mesh: a sharded job's data shards are "
                    "its data-parallel ranks (replicate x shard)"
                )
            if e.min_world_size and e.min_world_size < self.world_size:
                spec.check_elastic(min_world_size=e.min_world_size)
        if e.survivors is SurvivorMode.CONTINUE:
            if self.min_world >= self.world_size:
                raise UsageError(
                    "--survivors continue needs an elastic job: set --min-world-size below the world "
                    "size (the script must read its batches through session.shard_steps)"
                )
            if self.mesh is not None and MeshSpec.parse(self.mesh).reshards:
                raise UsageError(
                    f"--survivors continue needs replica groups to go on without (--mesh {self.mesh} "
                    "has none: a shrink reshards every rank); use --mesh replicate=R with R >= 2"
                )
        if e.shrink_batch is ShrinkBatch.DROP and self.min_world >= self.world_size:
            raise UsageError(
                "--shrink-batch drop says what a shrunk job trains on: set --min-world-size below the "
                "world size too (the script must read its batches through session.shard_steps)"
            )
