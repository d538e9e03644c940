"""What one coordinator operation sees of another: small Protocols, so that an operation is
given only the peers it calls (and a unit test gives it fakes of those alone).

Each Protocol names the few methods or fields one operation uses of a peer; the peer is the real
operation in the coordinator (:mod:`nonstop.coordinator.loop` wires them), a fake in a test.
Threading: the coordinator's thread only, like the operations.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from nonstop.policy.phase import Busy

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from nonstop.control.channel import Channel
    from nonstop.coordinator.failures import Exit
    from nonstop.coordinator.view import NodeRecord, WorkerRecord
    from nonstop.policy.decisions import FailureKind
    from nonstop.policy.grading import Graded
    from nonstop.policy.reconfiguration import Failure, Reconfiguration, RecoveryEvent

__all__ = [
    "FailureGrader",
    "Mover",
    "NodeHistory",
    "PersistAnswers",
    "Recovery",
    "SwapGuard",
    "UnderWay",
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


class ExitSink(Protocol):
    """The failures as the node agents see them (:mod:`nonstop.coordinator.failures`): a process
    ended (its agent said so, or its node was lost); handled at the failures' next tick."""

    def on_exit(self, ex: Exit) -> None: ...


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

    def on_worker_resumed(self, w: WorkerRecord, resume: dict[str, Any]) -> None: ...
