"""Events of the memory tier: a node's snapshot memory that could not grow
(:mod:`nonstop.snapshot.space`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nonstop.runtime.events.base import Event

__all__ = ["MemoryDegraded"]


@dataclass(frozen=True, kw_only=True)
class MemoryDegraded(Event):
    """A slot of ``rank``'s ``store`` ("local": its own snapshots; "replica": another node's rank
    held here; "shared": the node's one copy of a copy group's alike state, ``rank`` -1, logged by
    each worker that met it) could not be allocated (the memory filesystem is full): the rank goes on with
    ``slots_left`` slots (0: its snapshots fail, and a recovery restores it from a replica or the
    durable tier). ``free``: bytes free in the memory filesystem then. Logged by the process that
    found it (a worker, or a node agent)."""

    kind: ClassVar[str] = "memory_degraded"
    node: str | None
    rank: int | None
    store: str | None
    slots_left: int | None
    free: int | None
    error: str | None
