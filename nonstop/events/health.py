"""Events of the job's health (issue 21): fail-slow ranks, graded failures, probe verdicts, and
the proactive moves they lead to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nonstop.events.base import Event

__all__ = ["FailureGraded", "HealthVerdict", "ProactiveDecision", "Straggler", "StragglerCleared"]


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """``rank`` computes ``factor`` x its peers' median (its compute time: the step outside the
    gradient allreduce), slow in ``steps`` of the last ``window`` steps, judged at ``step``;
    ``spawn_id`` and ``node``: the process playing it (policy/straggler.py)."""

    kind: ClassVar[str] = "straggler"
    rank: int | None
    factor: float | None
    steps: int | None
    window: int | None
    step: int | None
    compute_s: float | None
    peers_s: float | None
    spawn_id: int | None
    node: str | None


@dataclass(frozen=True, kw_only=True)
class StragglerCleared(Event):
    """``rank`` is no longer flagged (its pace is back, or another process plays it)."""

    kind: ClassVar[str] = "straggler_cleared"
    rank: int | None
    step: int | None


@dataclass(frozen=True, kw_only=True)
class ProactiveDecision(Event):
    """The proactive policy (policy/proactive.py) on a flagged ``rank``: ``migrate`` or not, why,
    the expected cost of doing nothing (None: unbounded) and the move's cost, in seconds."""

    kind: ClassVar[str] = "proactive"
    rank: int | None
    migrate: bool
    reason: str
    expected_loss_s: float | None
    cost_s: float | None


@dataclass(frozen=True, kw_only=True)
class FailureGraded(Event):
    """A failure of ``rank`` on ``node`` graded (policy/grading.py): restart_in_place,
    replace_elsewhere, quarantine_node or fail_job, and why."""

    kind: ClassVar[str] = "failure_graded"
    rank: int | None
    spawn_id: int | None
    node: str | None
    grade: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class HealthVerdict(Event):
    """Node ``node``'s health probe changed its verdict: healthy, degraded or failing (``probe``:
    which probe; ``detail``: what it saw)."""

    kind: ClassVar[str] = "health"
    node: str | None
    verdict: str
    probe: str | None
    detail: str | None
