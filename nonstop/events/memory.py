"""Events of the memory tier: a node's snapshot memory that could not grow
(:mod:`nonstop.snapshot.space`), and the snapshot interval a stall budget tuned
(:mod:`nonstop.policy.cadence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from nonstop.events.base import OPTIONAL, Event

__all__ = ["MemoryDegraded", "SnapshotCadence"]


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


@dataclass(frozen=True, kw_only=True)
class SnapshotCadence(Event):
    """``--snapshot-budget``: from step ``since`` on the job snapshots every ``every``-th step,
    for a measured stall of ``stall_s`` per snapshot and a median step of ``step_s`` (the
    smallest interval whose stall costs at most ``budget`` of the training time). ``refused``:
    the interval stays ``every`` although the stall calls for a wider one, and why (a rank lost
    between two snapshots could not take a survivor's rescued state). ``stall_s`` and ``step_s``
    None: a restarted coordinator took the interval up from its reconnecting ranks."""

    kind: ClassVar[str] = "snapshot_cadence"
    every: int | None
    since: int | None
    stall_s: float | None
    step_s: float | None
    budget: float | None
    refused: str | None = field(default=None, metadata=OPTIONAL)
