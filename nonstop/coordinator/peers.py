"""What one coordinator operation sees of another: small Protocols, so that an operation is
given only the peers it calls (and a unit test gives it fakes of those alone).

Each Protocol names the few methods or fields one operation uses of a peer; the peer is the real
operation in the coordinator (:mod:`nonstop.coordinator.loop` wires them), a fake in a test.
Threading: the coordinator's thread only, like the operations.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from nonstop.policy.phase import Busy
from nonstop.protocol.worker import CadenceMsg, ResumeMsg

if TYPE_CHECKING:
    from nonstop.control.channel import Channel
    from nonstop.coordinator.failures import ProcessEnd
    from nonstop.coordinator.view import NodeRecord, WorkerRecord
    from nonstop.policy.boundary_swap import Joiner
    from nonstop.policy.decisions import FailureKind
    from nonstop.policy.grading import Graded
    from nonstop.policy.planning import Inventory, Shrink
    from nonstop.policy.reconfiguration import Failure, Reconfiguration, RecoveryEvent
    from nonstop.policy.survivors import SurvivorChoice

__all__ = [
    "FailureGrader",
    "Mover",
    "NodeHistory",
    "PersistAnswers",
    "Recovery",
    "SwapGuard",
    "UnderWay",
    "FetchWaiter",
    "ReshardNeeds",
    "Launcher",
    "RestorePlans",
    "ResizePlans",
    "RankShards",
    "SwapsDone",
    "SpareSupply",
    "BoundarySources",
    "CadenceResume",
    "GrowJoiners",
    "NodeLoss",
    "PersistNow",
    "Resync",
    "SwapGenerations",
    "SwapRecord",
    "SwapShards",
    "ExitSink",
    "NodeStore",
    "FetchesInFlight",
    "RoundReset",
    "ResumePoint",
    "DurableInstall",
    "LaunchWatch",
    "FirstConnects",
    "WorkerResumes",
]


class UnderWay(Protocol):
    """An operation that may hold back others while it has something under way."""

    def busy(self) -> set[Busy]: ...


class PersistAnswers(Protocol):
    """The clients waiting for a persist (``nonstop persist``)."""

    def answer_persists(self) -> None: ...


class Mover(Protocol):
    """Live migrations as a policy that asks for one sees them (:mod:`nonstop.coordinator.swaps`)."""

    @property
    def moving(self) -> bool:
        """A migration or grow is under way or queued (one move at a time)."""
        ...

    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        """Queue moving ``rank`` to ``target`` (None: the policy picks); an error message when the
        request cannot be honoured."""
        ...


class SwapGuard(Protocol):
    """A boundary swap as a failure sees it: a joiner's exit, or any failure, may end it."""

    def on_exit(self, sid: int, *, member: bool, how: str) -> None: ...

    def abort(self, why: str, *, failed: Collection[int] = ()) -> None: ...


class FailureGrader(Protocol):
    """Grades a failure (:mod:`nonstop.coordinator.health`)."""

    def grade(
        self,
        *,
        rank: int | None,
        spawn_id: int | None,
        node: str,
        kind: FailureKind,
        returncode: int | None,
        exception: str | None,
        step: int | None = None,
    ) -> Graded: ...


class NodeHistory(Protocol):
    """The nodes as a failure sees them (:mod:`nonstop.coordinator.node_agents`): a process
    failure counts against its node; a node graded bad is quarantined."""

    def node_failed(self, name: str) -> None: ...

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None: ...


class Recovery(Protocol):
    """The generations as failures see them (:mod:`nonstop.coordinator.generations`)."""

    def recover(self, failures: list[Failure]) -> None:
        """Recover ``failures``: the next generation, or the one being planned or set up re-planned."""
        ...

    def in_training(self) -> bool:
        """The members train: the job runs, or its new generation has resumed."""
        ...

    def rebuilding(self) -> set[int]:
        """The ranks still rebuilding their groups in the generation being set up."""
        ...


class FetchWaiter(Protocol):
    """The generation being set up as the restore sources see it
    (:mod:`nonstop.coordinator.generation_setup`): whose fetches count, and where one that
    finished is reported."""

    @property
    def reconf(self) -> Reconfiguration | None:
        """The generation being set up; None between setups."""
        ...

    def report(self, event: RecoveryEvent) -> None: ...


class ReshardNeeds(Protocol):
    """The job's size as a reshard's fetches see it (:mod:`nonstop.coordinator.resizing`)."""

    def needed_on(self, node: str, old_world: int) -> set[int]:
        """The old ranks whose step ``node``'s ranks cut their new shards from."""
        ...


class Launcher(Protocol):
    """The setup of a generation as its planner sees it
    (:class:`~nonstop.coordinator.generation_setup.GenerationSetup`)."""

    @property
    def reconf(self) -> Reconfiguration | None:
        """The generation being set up; None between setups."""
        ...

    def abandon(self) -> None:
        """A newer generation opens: the one being set up is dropped."""
        ...

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        """Log the planned generation ``r`` and start its setup."""
        ...

    def report(self, event: RecoveryEvent) -> None: ...

    def in_training(self) -> bool: ...

    def rebuilding(self) -> set[int]: ...


class RestorePlans(Protocol):
    """The restore sources as a generation's planner sees them
    (:mod:`nonstop.coordinator.restore_sources`)."""

    def new_generation(self, generation: int) -> None:
        """Fence the older generations' fetches and install."""
        ...

    def restore_from_durable(self, done: Callable[[int | None], None]) -> None:
        """Install the newest durable checkpoint that loads everywhere; ``done(step or None)``."""
        ...

    def plan_fetches(self, r: Reconfiguration, step: int, avail: Inventory) -> dict[int, str]:
        """Fetch ``step`` to each node that plays a rank without holding it; rank -> whence."""
        ...

    def plan_reshard(
        self, r: Reconfiguration, step: int, avail: Inventory, old_world: int
    ) -> dict[str, dict[int, str]]:
        """Gather every old rank's ``step`` a node's ranks reshard from; node -> old rank -> slots."""
        ...


class ResizePlans(Protocol):
    """The job's size as a generation's planner sees it (:mod:`nonstop.coordinator.resizing`)."""

    @property
    def reshards(self) -> bool:
        """A resize cuts every rank's shards anew (a sharded job without replicas)."""
        ...

    def survivor_choice(self, missing: Sequence[int]) -> SurvivorChoice: ...

    def shrink(self, shrink: Shrink, why: str, *, shrink_first: bool = False) -> dict[int, int]:
        """Apply a planned shrink to the view; new rank -> the old rank whose memory it restores."""
        ...

    def reshard_source(self, step: int | None, old_world: int) -> dict[str, Any] | None:
        """Where a resharded generation reads the old ranks' state (None: the job has failed)."""
        ...


class RankShards(Protocol):
    """What a rank is told of the job's size when it joins a generation
    (:mod:`nonstop.coordinator.resizing`)."""

    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]: ...

    def reshard_for(self, reshard: dict[str, Any], rank: int) -> dict[str, Any]: ...


class SwapsDone(Protocol):
    """The swaps as a generation's setup sees them (:mod:`nonstop.coordinator.swaps`): a swap
    waits for the generation it opened to be set up."""

    def on_generation_done(self, generation: int) -> None: ...


class SpareSupply(Protocol):
    """The node agents as a generation's setup sees them (:mod:`nonstop.coordinator.node_agents`):
    the spares a generation used are replaced."""

    def replenish_spares(self) -> None: ...


class NodeLoss(Protocol):
    """The node agents as an operation that ends a node sees them (:mod:`nonstop.coordinator.
    node_agents`): a drained node released, a node whose lease ended lost."""

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None: ...


class PersistNow(Protocol):
    """A job of several nodes' persist rounds as a preempted node asks for one
    (:class:`~nonstop.coordinator.persistence.ClusterPersister`)."""

    def request(self) -> int:
        """Ask for a persist of the newest committed step; a ticket."""
        ...


class GrowJoiners(Protocol):
    """The job's size as a grow that starts sees it (:mod:`nonstop.coordinator.resizing`)."""

    @property
    def reshards(self) -> bool:
        """A resize cuts every rank's shards anew (so no joiner fetches one source's boundary)."""
        ...

    def joiners(self, idle: Mapping[int, str], target: int) -> list[Joiner]:
        """The idle spares (spawn id -> node) a grow to ``target`` ranks brings in."""
        ...


class SwapShards(Protocol):
    """The job's size as a swap's joiners and its generation see it (:mod:`nonstop.coordinator.
    resizing`)."""

    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]: ...

    def data_shards(self, world_size: int) -> tuple[tuple[int, ...], ...]: ...

    def reshard_at_boundary(self, r: Reconfiguration, step: int, old_world: int) -> None: ...


class BoundarySources(Protocol):
    """Where a swap's joiners read their boundary (:mod:`nonstop.coordinator.restore_sources`)."""

    def fetch_early(
        self, target: str, rank: int, step: int, source: str, *, as_rank: int, base: int | None = None
    ) -> int:
        """A boundary fetch asked before the swap's generation exists; its request id."""
        ...

    def fetch_for(
        self,
        r: Reconfiguration,
        rank: int,
        step: int,
        source: str,
        kind: str,
        *,
        src_rank: int | None = None,
        base: int | None = None,
        early: int | None = None,
    ) -> str:
        """A fetch generation ``r`` waits for before ``rank`` restores (``early``: adopt that one)."""
        ...

    def drop_early(self, req: int) -> None:
        """A swap that asked for boundary fetch ``req`` ended: a late answer is ignored."""
        ...


class SwapGenerations(Protocol):
    """The generations as a swap sees them (:mod:`nonstop.coordinator.generations`): the swap
    opens its generation, builds it at the boundary and launches it."""

    def open_generation(self) -> None: ...

    def boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration: ...

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None: ...


class Resync(Protocol):
    """The generations as a restarted coordinator sees them: a recovery interrupted by the
    restart is redone from the nodes' inventories (:meth:`~nonstop.coordinator.generations.
    Generations.begin`)."""

    def begin(self, failures: list[Failure], *, inventory_needed: bool = False) -> None: ...


class CadenceResume(Protocol):
    """The workers' protocol as a reconnected member's resume point reaches it
    (:meth:`~nonstop.coordinator.workers.WorkerProtocol.resumed_cadence`)."""

    def resumed_cadence(self, said: CadenceMsg | None) -> None: ...


class SwapRecord(Protocol):
    """The swaps as the store's record sees them (:mod:`nonstop.coordinator.swaps`)."""

    def record(self) -> dict[str, Any]:
        """The migration queue and the swap in flight (JSON types)."""
        ...

    def requeue(self, rec: dict[str, Any], now: float) -> None:
        """Queue again the migrations a dead coordinator's record had queued."""
        ...


class ExitSink(Protocol):
    """The failures as the node agents see them (:mod:`nonstop.coordinator.failures`): a process
    ended (its agent said so, or its node was lost); handled at the failures' next tick."""

    def on_exit(self, ex: ProcessEnd) -> None: ...


class NodeStore(Protocol):
    """Store mode as the node agents see it (:mod:`nonstop.coordinator.store_sync`): an agent
    reattaching to a restarted coordinator, and a quarantined node's lease ended in the store."""

    def reattach(self, node: NodeRecord, chan: Channel) -> None: ...

    def revoke(self, node: NodeRecord) -> None: ...


class FetchesInFlight(Protocol):
    """The restore fetches in flight (:mod:`nonstop.coordinator.restore_sources`), which a node's
    loss does not answer as lost: they end with their generation."""

    @property
    def waiting_fetch(self) -> Collection[int]:
        """The request ids of the fetches in flight."""
        ...


class RoundReset(Protocol):
    """The replication rounds as a node's loss sees them (:mod:`nonstop.coordinator.replication`):
    its holders or senders may be gone, so the round starts over."""

    def reset(self) -> None: ...


class ResumePoint(Protocol):
    """The generations as the job's start sees them (:mod:`nonstop.coordinator.generations`): the
    resumed checkpoint to install first, a resumed checkpoint of another size the first
    generation reshards from, and the first generation's beginning."""

    @property
    def initial_step(self) -> int | None:
        """The resumed durable checkpoint's step (None: a fresh start, or it is installed)."""
        ...

    def reshard_first(self, source: dict[str, Any]) -> None:
        """The first generation's ranks cut their shards out of ``source`` (``url``, ``step``,
        ``world``: a checkpoint of another size); nothing is installed on the nodes."""
        ...

    def begin(self, failures: list[Failure]) -> None:
        """Open the next generation and plan it (the first: ``failures`` empty)."""
        ...


class DurableInstall(Protocol):
    """The restore sources as the job's start sees them (:mod:`nonstop.coordinator.restore_sources`)."""

    def install_durable(
        self,
        steps: list[int],
        placement: dict[str, list[int]],
        url: str,
        done: Callable[[int | None], None],
    ) -> None:
        """Install the first of ``steps`` that loads on every node (``placement``: node -> its
        ranks) from ``url``; ``done(step or None)`` once it is known."""
        ...


class LaunchWatch(Protocol):
    """The generation being set up as the workers' protocol sees it
    (:mod:`nonstop.coordinator.generations`): what a connecting process and a joining rank
    report to it."""

    @property
    def reconf(self) -> Reconfiguration | None:
        """The generation being set up; None between setups."""
        ...

    def report(self, event: RecoveryEvent) -> None: ...


class FirstConnects(Protocol):
    """The job's start as the workers' protocol sees it (:mod:`nonstop.coordinator.job_start`)."""

    def connected(self) -> None:
        """A first process connected: the first generation begins once every member has."""
        ...


class WorkerResumes(Protocol):
    """Store mode as the workers' protocol sees it (:mod:`nonstop.coordinator.store_sync`): a
    worker reconnected to a restarted coordinator, saying where it is."""

    def on_worker_resumed(self, w: WorkerRecord, resume: ResumeMsg) -> None: ...
