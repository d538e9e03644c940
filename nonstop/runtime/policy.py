"""Pure decision policies of the control plane.

Nothing here does I/O or reads a clock: callers pass ``now`` and observations,
and get decisions back. The runtime and (later) the simulator call the same
functions, so they cannot disagree.
"""

from __future__ import annotations

import enum
import signal
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nonstop.config import DetectorConfig

__all__ = [
    "FailureKind",
    "RankObservation",
    "RecoveryPlan",
    "ReplacementSource",
    "classify_exit",
    "committed_step",
    "find_hung_ranks",
    "median_step_time",
    "plan_recovery",
]


class FailureKind(enum.StrEnum):
    """Why a rank stopped. The recovery path is the same for all three today;
    the kind feeds failure grading (restart in place vs replace vs quarantine)."""

    KILLED = "kill"  # died of a signal nobody in nonstop sent
    HANG = "hang"  # no heartbeat / no progress; nonstop killed it
    EXIT = "exit"  # exited on its own before the job finished
    ERROR = "error"  # raised an exception that was not a peer's failure


class ReplacementSource(enum.StrEnum):
    SPARE = "spare"  # a pre-warmed process already connected and waiting
    COLD = "cold"  # a new process (pays interpreter + torch import)


@dataclass(frozen=True, kw_only=True)
class RankObservation:
    """What the coordinator last saw of the worker playing a rank (monotonic seconds)."""

    last_heartbeat: float
    last_progress: float
    collective_pending: bool
    stepped: bool  # has completed at least one step in this generation


def classify_exit(returncode: int, *, killed_for_hang: bool) -> FailureKind:
    if killed_for_hang:
        return FailureKind.HANG
    if returncode < 0:
        return FailureKind.KILLED
    return FailureKind.EXIT


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def committed_step(complete_steps: Mapping[int, Sequence[int]], world_size: int) -> int | None:
    """Newest step whose snapshot is complete for every rank ``0..world_size-1``.

    ``complete_steps[rank]`` lists the steps with a complete snapshot of that
    rank. Returns None if no step is complete everywhere.
    """
    common: set[int] | None = None
    for rank in range(world_size):
        have = set(complete_steps.get(rank, ()))
        common = have if common is None else common & have
    return max(common) if common else None


def median_step_time(step_times: Sequence[float]) -> float | None:
    return statistics.median(step_times) if step_times else None


def find_hung_ranks(
    observations: Mapping[int, RankObservation],
    *,
    now: float,
    median_step_s: float | None,
    config: DetectorConfig,
) -> dict[int, str]:
    """Ranks to declare hung, with the reason.

    * heartbeat silent for ``heartbeat_timeout_s``: the process is stopped or
      wedged with the GIL held (a rank blocked in a collective still beats).
    * no step progress for ``max(hang_factor * median, hang_min_s)`` while no
      collective is pending on that rank: it is stuck in its own code; its
      peers waiting in the allreduce for it are not blamed.
    """
    hung: dict[int, str] = {}
    for rank, obs in observations.items():
        silent = now - obs.last_heartbeat
        if silent > config.heartbeat_timeout_s:
            hung[rank] = f"no heartbeat for {silent:.2f}s"
            continue
        if not obs.stepped or median_step_s is None:
            limit = config.startup_grace_s
        else:
            limit = max(config.hang_factor * median_step_s, config.hang_min_s)
        stalled = now - obs.last_progress
        if stalled > limit and not obs.collective_pending:
            hung[rank] = f"no step progress for {stalled:.2f}s (limit {limit:.2f}s)"
    return hung


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """Who plays each failed rank and which step every rank returns to."""

    restore_step: int | None
    replacements: dict[int, ReplacementSource]
    spares_used: tuple[int, ...]


def plan_recovery(
    *,
    failed_ranks: Sequence[int],
    idle_spares: Sequence[int],
    complete_steps: Mapping[int, Sequence[int]],
    world_size: int,
) -> RecoveryPlan:
    """Give each failed rank a hot spare (in order) or a cold process, and pick
    the committed step as the restore point for every rank."""
    replacements: dict[int, ReplacementSource] = {}
    used: list[int] = []
    spares = list(idle_spares)
    for rank in sorted(set(failed_ranks)):
        if spares:
            used.append(spares.pop(0))
            replacements[rank] = ReplacementSource.SPARE
        else:
            replacements[rank] = ReplacementSource.COLD
    return RecoveryPlan(
        restore_step=committed_step(complete_steps, world_size),
        replacements=replacements,
        spares_used=tuple(used),
    )
