"""What one coordinator operation sees of another: small Protocols, so that an operation is
given only the peers it calls (and a unit test gives it fakes of those alone).

Each Protocol names the few methods or fields one operation uses of a peer; the peer is the real
operation in the coordinator (:mod:`nonstop.coordinator.loop` wires them), a fake in a test.
Threading: the coordinator's thread only, like the operations.
"""

from __future__ import annotations

from typing import Protocol

from nonstop.policy.phase import Busy

__all__ = ["Mover", "PersistAnswers", "UnderWay"]


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
