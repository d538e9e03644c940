"""Proactive action: move a rank before it costs more than the move (pure; no I/O, no clock).

A flagged straggler (:mod:`nonstop.policy.straggler`) slows every step of a synchronous job by
what it computes beyond its peers. Doing nothing costs that excess on every remaining step; a
live migration (:mod:`nonstop.policy.migration`: a hot spare restores the rank while the job
trains, then a swap at a step boundary, no rollback) costs one pause of about a step or two plus
the joiner's preparation competing for the machine. :func:`decide_migration` compares the two:

    cost of doing nothing  = excess_s x remaining_steps         (excess_s = compute_s - peers_s)
    cost of migrating      = migration_cost_s (measured from the last migration's pause when
                             there was one, else the configured conservative constant)

and migrates when doing nothing costs more than ``margin`` x the migration, and only when a
node other than the straggler's has an idle hot spare (the existing machinery's requirement).
With the run's length unknown (a worker that does not say), the remaining steps are taken as
unbounded: a persistent straggler always costs more than one move in a long run.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MigrationDecision", "decide_migration", "measured_migration_cost"]

MARGIN = 2.0  # doing nothing must cost this many times the move: a move is not free of risk


@dataclass(frozen=True, kw_only=True)
class MigrationDecision:
    migrate: bool
    reason: str
    expected_loss_s: float | None  # cost of doing nothing (None: unbounded, the run's length unknown)
    cost_s: float  # the migration's cost used


def decide_migration(
    *,
    compute_s: float,
    peers_s: float,
    remaining_steps: int | None,
    migration_cost_s: float,
    has_target: bool,
    margin: float = MARGIN,
) -> MigrationDecision:
    """Whether to migrate a straggler computing ``compute_s`` per step where its peers compute
    ``peers_s``, with ``remaining_steps`` left (None: unknown), a live migration costing
    ``migration_cost_s`` seconds, and ``has_target``: some other node has an idle hot spare."""
    excess = max(0.0, compute_s - peers_s)
    loss = None if remaining_steps is None else excess * max(0, remaining_steps)
    if not has_target:
        return MigrationDecision(
            migrate=False,
            reason="no other node has an idle hot spare",
            expected_loss_s=loss,
            cost_s=migration_cost_s,
        )
    if excess <= 0:
        return MigrationDecision(
            migrate=False, reason="not slower than its peers", expected_loss_s=loss, cost_s=migration_cost_s
        )
    if loss is None:
        return MigrationDecision(
            migrate=True,
            reason=f"{excess:.3f}s lost per step for an unknown number of steps",
            expected_loss_s=None,
            cost_s=migration_cost_s,
        )
    if loss > margin * migration_cost_s:
        why = f"{excess:.3f}s x {remaining_steps} steps = {loss:.1f}s > {margin:g} x {migration_cost_s:.1f}s"
        return MigrationDecision(migrate=True, reason=why, expected_loss_s=loss, cost_s=migration_cost_s)
    why = f"{loss:.1f}s left to lose <= {margin:g} x the move's {migration_cost_s:.1f}s"
    return MigrationDecision(migrate=False, reason=why, expected_loss_s=loss, cost_s=migration_cost_s)


def measured_migration_cost(
    max_step_gap_s: float | None, median_step_s: float | None, default_s: float
) -> float:
    """A finished migration's cost: its pause beyond an ordinary step (the longest step gap at
    the boundary minus the median step), or ``default_s`` when it measured nothing. Never below
    one median step: the joiner's preparation also costs the machine something."""
    if max_step_gap_s is None or median_step_s is None:
        return default_s
    return max(max_step_gap_s - median_step_s, median_step_s)
