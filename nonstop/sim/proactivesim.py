"""nonstop's proactive moves in the simulator, decided by the runtime's own pure policies.

Two kinds of move ahead of trouble, each a live migration (the boundary-swap machine's pause,
timed at the job's scale by :mod:`nonstop.sim.swapsim`: what the simulator charges a planned
swap), each decided as the coordinator decides it (:mod:`nonstop.coordinator.health`), through
the runtime's modules so that a test that monkeypatches them sees the simulation change:

* **a fail-slow rank** (:meth:`ProactiveMoves.on_slow`): the runtime's detector
  (:class:`~nonstop.policy.straggler.StragglerTracker`, replayed by
  :func:`~nonstop.sim.failslow.detection_steps`) says after how many slow steps it flags the
  rank, and its verdict (the rank's and its peers' compute times) goes to
  :func:`~nonstop.policy.proactive.decide_migration` with the run's remaining steps (what the
  coordinator passes: the workers' announced length less the steps done; the runtime does not
  know how long a slowdown will last), the migration's cost (the planned swap's pause) and
  whether another node has an idle hot spare. ``StragglerConfig.mode``: ``off`` never detects,
  ``warn`` detects but never moves (the slowdown runs its course), ``migrate`` moves;
* **a degraded node before its failure** (:meth:`ProactiveMoves.on_warning`): with
  ``StragglerConfig.on_degraded == "drain"``, the coordinator drains a node whose probe says
  degraded when another node has an idle hot spare; the failure that would have followed is
  graded by :func:`~nonstop.policy.grading.grade_failure` with the degraded verdict, and a node
  it would send elsewhere (``replace_elsewhere`` / ``quarantine_node``) is drained -- in time if
  the signal's lead covers the plan and the joiner's preparation. A drained node's failure is a
  planned live migration: nothing rolled back, no restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nonstop.policy import grading
from nonstop.policy import proactive as proactive_policy
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.grading import FailureSignal, Grade
from nonstop.policy.straggler import StragglerConfig, StragglerVerdict
from nonstop.sim import failslow
from nonstop.sim.api import JobSpec, SlowResponse
from nonstop.sim.swapsim import SwapTiming

__all__ = ["NO_PROACTIVE", "PROACTIVE", "ProactiveMoves"]

PROACTIVE = StragglerConfig(mode="migrate", on_degraded="drain")  # the simulator's nonstop default
NO_PROACTIVE = StragglerConfig(mode="warn", on_degraded="warn")  # the runtime's default: detect only


@dataclass(kw_only=True)
class ProactiveMoves:
    """The decisions (see the module docstring) for one job: ``step_s`` its step, ``horizon_s``
    the run's length, ``cost_s`` the planned swap's pause (the migration's cost the policy
    weighs), ``prepare_s`` the joiner's preparation while the job trains, ``plan_s`` the plan."""

    config: StragglerConfig
    quarantine: QuarantinePolicy
    step_s: float
    horizon_s: float
    num_nodes: int
    cost_s: float
    prepare_s: float
    plan_s: float

    def __post_init__(self) -> None:
        self._flagged: dict[float, tuple[int, StragglerVerdict] | None] = {}

    @classmethod
    def for_job(
        cls,
        config: StragglerConfig,
        quarantine: QuarantinePolicy,
        job: JobSpec,
        swap: SwapTiming,
        cost_s: float,
        plan_s: float,
    ) -> ProactiveMoves:
        """For ``job``, whose planned migration is ``swap`` (its preparation) costing ``cost_s``."""
        return cls(
            config=config,
            quarantine=quarantine,
            step_s=job.step_s,
            horizon_s=job.horizon_s,
            num_nodes=job.num_nodes,
            cost_s=cost_s,
            prepare_s=swap.prepare_s,
            plan_s=plan_s,
        )

    def detection(self, factor: float) -> tuple[int, StragglerVerdict] | None:
        """The runtime detector's answer for a rank ``factor`` x slower (cached per run)."""
        key = round(factor, 3)
        if key not in self._flagged:
            self._flagged[key] = failslow.detection_steps(self.config, key, step_s=self.step_s)
        return self._flagged[key]

    def on_slow(self, *, now: float, factor: float, has_target: bool) -> SlowResponse:
        if self.config.mode == "off":
            return SlowResponse(reason="no detection (--straggler off)")
        found = self.detection(factor)
        if found is None:
            return SlowResponse(reason=f"{factor:.2f}x: below the detector's factor {self.config.factor:g}")
        steps, verdict = found
        detect_s = steps * self.step_s * factor  # the slow steps take factor x as long
        if self.config.mode != "migrate":
            return SlowResponse(detect_after_s=detect_s, reason="flagged, not moved (--straggler warn)")
        remaining = max(0, int((self.horizon_s - now - detect_s) / self.step_s))
        decision = proactive_policy.decide_migration(
            compute_s=verdict.compute_s,
            peers_s=verdict.peers_s,
            remaining_steps=remaining,
            migration_cost_s=self.cost_s,
            has_target=has_target,
        )
        return SlowResponse(
            detect_after_s=detect_s,
            migrate=decision.migrate,
            prepare_s=self.prepare_s,
            pause_s=self.cost_s,
            reason=decision.reason,
        )

    def on_warning(self, *, cause: Any, lead_s: float, has_target: bool) -> bool:
        """Whether the node was drained before its failure (see the module docstring)."""
        if self.config.on_degraded != "drain" or not has_target:
            return False
        signal = FailureSignal(kind=cause.kind, probe="degraded", others_usable=self.num_nodes - 1)
        graded = grading.grade_failure(signal, self.quarantine)
        if graded.grade not in (Grade.REPLACE_ELSEWHERE, Grade.QUARANTINE_NODE):
            return False
        return lead_s >= self.plan_s + self.prepare_s

    def describe(self) -> dict[str, Any]:
        return {
            "straggler_mode": self.config.mode,
            "on_degraded": self.config.on_degraded,
            "detect_factor": self.config.factor,
            "detect_window": self.config.window,
            "detect_needed": self.config.needed,
            "migration_cost_s": self.cost_s,
            "migration_prepare_s": self.prepare_s,
        }
