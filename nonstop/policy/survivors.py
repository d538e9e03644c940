"""Survivors never wait: per failure, shrink first or replace first (a pure policy).

Two ways to recover a rank that a hot spare can take:

* **replace first** (what nonstop always did): the spare takes the rank, fetches and restores its
  state, and the whole job waits for it -- every survivor pauses for the spare's launch and
  restore, then one rebuild;
* **shrink first**: the survivors go on at once without the lost rank -- its data shards are
  played by the others (same global batch, same samples, same order: :mod:`.elastic`), the
  gradient mean bitwise that of the full job (:mod:`nonstop.train.exactsum`); or with
  ``--shrink-batch drop`` skipped while the job is shrunk (steps at full speed, fewer samples
  each) -- while the spare
  prepares in the background as a grow's joiner does (restores a survivor's committed step, warms
  up) and joins at a step boundary (:mod:`.swap`). The survivors pause for one rebuild at the
  shrink and a step-boundary swap at the grow; meanwhile the job runs at the shrunk rate.

:func:`choose` compares the two in seconds of the full job's progress lost until every rank
trains again (the step in flight is redone either way and is not counted):

* replace first: ``restore_s + rebuild_s`` -- the job stands still while the spare restores;
* shrink first: ``rebuild_s`` (the shrink) ``+ (restore_s + step_s) * (1 - rate)`` (the spare's
  prepare -- its restore and one warm-up step -- at ``rate`` of the full job's speed, the shrunk
  job's slowest rank: :func:`shrunk_rate`) ``+ swap_s`` (the grow's pause at the boundary beyond
  a step, and its rebuild).

``restore_s`` is what the last replacement measured (its launch and restore stages); before one
is measured, ``auto`` replaces first (the behaviour that needs no estimate). ``--survivors``:
``wait`` always replaces first, ``continue`` always shrinks first where the job may shrink,
``auto`` chooses. The simulator calls the same function.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nonstop.policy.elastic import played

__all__ = [
    "SurvivorChoice",
    "SurvivorCosts",
    "SurvivorMode",
    "choose",
    "costs_from_reports",
    "shrunk_rate",
]


class SurvivorMode(enum.StrEnum):
    AUTO = "auto"  # choose per failure (choose)
    WAIT = "wait"  # replace first: the survivors wait for the spare
    CONTINUE = "continue"  # shrink first wherever the job may shrink


@dataclass(frozen=True, kw_only=True)
class SurvivorCosts:
    """What the job measured, for one failure (seconds). ``restore_s`` None: not measured yet."""

    step_s: float  # the median step
    restore_s: float | None  # a replacement's launch + restore stages (the last one measured)
    rebuild_s: float  # one rebuild of the process group
    swap_s: float  # a grow's pause at its boundary beyond one step, its rebuild included


@dataclass(frozen=True, kw_only=True)
class SurvivorChoice:
    shrink_first: bool
    reason: str
    replace_s: float | None = None  # the full job's seconds lost, replacing first
    continue_s: float | None = None  # ... and shrinking first


def shrunk_rate(full: Sequence[Sequence[int]], shrunk: Sequence[Sequence[int]]) -> float:
    """The shrunk job's speed over the full job's, in samples trained per second, from the data
    shards each rank plays in each (``play_shards``, ``MeshSpec.data_shards``): a step takes as
    long as its slowest rank's micro-batches, and trains the distinct shards played (all of the
    job's, unless ``--shrink-batch drop`` skips the lost ranks' shares)."""
    if not shrunk:
        return 0.0
    return (played(shrunk) / played(full)) * (max(map(len, full)) / max(map(len, shrunk)))


def choose(
    mode: SurvivorMode,
    *,
    can_shrink: bool,
    costs: SurvivorCosts | None,
    rate: float,
) -> SurvivorChoice:
    """Shrink first or replace first, for one failure (pure).

    ``can_shrink``: the job is elastic and the shrink keeps it at or above its minimum (whole
    replica groups for a sharded job; not one that must reshard); ``rate``: :func:`shrunk_rate`."""
    if mode is SurvivorMode.WAIT:
        return SurvivorChoice(shrink_first=False, reason="--survivors wait")
    if not can_shrink:
        return SurvivorChoice(shrink_first=False, reason="the job may not shrink by these ranks")
    if mode is SurvivorMode.CONTINUE:
        return SurvivorChoice(shrink_first=True, reason="--survivors continue")
    if costs is None or costs.restore_s is None:
        return SurvivorChoice(shrink_first=False, reason="no replacement measured yet")
    replace_s = costs.restore_s + costs.rebuild_s
    continue_s = costs.rebuild_s + (costs.restore_s + costs.step_s) * (1.0 - rate) + costs.swap_s
    first = continue_s < replace_s
    return SurvivorChoice(
        shrink_first=first,
        reason=(
            f"{'shrink' if first else 'replace'} first: {continue_s:.3f}s of the job lost shrinking "
            f"first vs {replace_s:.3f}s replacing first (restore {costs.restore_s:.3f}s, step "
            f"{costs.step_s:.3f}s, shrunk rate {rate:.2f})"
        ),
        replace_s=replace_s,
        continue_s=continue_s,
    )


def costs_from_reports(
    reports: Sequence[Mapping[str, Any]],
    *,
    step_s: float | None,
    swap_ratios: Sequence[float] = (),
) -> SurvivorCosts | None:
    """The costs measured so far: the newest recovery with a replacement gives ``restore_s``
    (its launch and restore stages) and ``rebuild_s``; ``swap_ratios``: grows' and migrations'
    boundary gaps over the median step (a swap's pause beyond one step is ``ratio - 1`` steps;
    one step when none was measured). None without a median step."""
    if step_s is None or step_s <= 0:
        return None
    restore_s: float | None = None
    rebuild_s = 0.0
    for rec in reversed(reports):
        stages = rec.get("stages") or {}
        if rec.get("replacement", "none") != "none" and "launch" in stages:
            restore_s = float(stages["launch"]) + float(stages.get("restore", 0.0))
            rebuild_s = float(stages.get("rebuild", 0.0))
            break
    ratio = sorted(swap_ratios)[len(swap_ratios) // 2] if swap_ratios else 2.0
    swap_s = max(0.0, ratio - 1.0) * step_s + rebuild_s
    return SurvivorCosts(step_s=step_s, restore_s=restore_s, rebuild_s=rebuild_s, swap_s=swap_s)
