"""The recovery state machine.

Every membership change is a **reconfiguration** to a new generation. The
first one starts the job; every later one is a recovery caused by one or more
failures. A reconfiguration moves through named stages, each timed::

    DETECT -> PLAN -> LAUNCH -> RESTORE -> REBUILD -> RESUME -> DONE

* DETECT  fault (injected timestamp, when known) -> the coordinator declares it
* (REPLAN time lost to a reconfiguration that another failure interrupted)
* PLAN    pick the committed step and who replaces each failed rank
* LAUNCH  replacements exist and are connected (a hot spare: immediate;
          a cold process: interpreter + torch import), and every node that
          lacks a rank's restore step in its memory has fetched it from a peer
* RESTORE every rank has loaded the committed step from snapshot memory
* REBUILD every rank is in the new process group (survivors kept their processes)
* RESUME  every rank has completed one step in the new generation

A failure during a reconfiguration starts a new one (the generation goes up)
that inherits the earlier failures; :func:`next_stage` is the pure transition.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Failure", "Reconfiguration", "Stage", "next_stage"]


class Stage(enum.StrEnum):
    DETECT = "detect"
    PLAN = "plan"
    LAUNCH = "launch"
    RESTORE = "restore"
    REBUILD = "rebuild"
    RESUME = "resume"
    DONE = "done"

    @property
    def is_terminal(self) -> bool:
        return self is Stage.DONE


def next_stage(stage: Stage, *, launched: bool, restored: bool, ready: bool, stepped: bool) -> Stage:
    """The stage after ``stage`` given what every rank has reported (pure)."""
    if stage is Stage.LAUNCH and launched:
        stage = Stage.RESTORE
    if stage is Stage.RESTORE and restored:
        stage = Stage.REBUILD
    if stage is Stage.REBUILD and ready:
        stage = Stage.RESUME
    if stage is Stage.RESUME and stepped:
        stage = Stage.DONE
    return stage


@dataclass(kw_only=True)
class Failure:
    """One failed worker. Times are wall-clock (``time.time()``)."""

    kind: str
    rank: int
    spawn_id: int
    detail: str
    detected_at: float
    step: int
    fault_at: float | None = None  # when the fault was injected, if it was


@dataclass(kw_only=True)
class Reconfiguration:
    """One generation being set up. ``marks[stage]`` is when that stage ended."""

    generation: int
    world_size: int
    failures: list[Failure]
    restore_step: int | None = None
    replacements: dict[int, str] = field(default_factory=dict)
    # a world-size change renumbered these ranks: new rank -> the rank whose own memory it restores
    from_rank: dict[int, int] = field(default_factory=dict)
    # the world size changed: these ranks' slots may hold another numbering's state; they rewrite them
    fresh: set[int] = field(default_factory=set)
    # a swap at a boundary (migration, grow): a rank paused there keeps its live state, no restore
    live: bool = False
    lost_steps: int = 0
    replans: int = 0
    stage: Stage = Stage.PLAN
    waiting_launch: set[int] = field(default_factory=set)
    waiting_fetch: set[int] = field(default_factory=set)  # ranks whose snapshot is being fetched
    restored: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    stepped: set[int] = field(default_factory=set)
    marks: dict[str, float] = field(default_factory=dict)
    deadline: float = 0.0  # wall time by which RESTORE/REBUILD must finish

    def advance(self) -> Stage:
        everyone = set(range(self.world_size))
        self.stage = next_stage(
            self.stage,
            launched=not self.waiting_launch and not self.waiting_fetch,
            restored=self.restored >= everyone,
            ready=self.ready >= everyone,
            stepped=self.stepped >= everyone,
        )
        return self.stage

    def report(self) -> list[dict[str, Any]]:
        """One record per failure: detection, each stage, MTTR and lost steps (seconds).

        The stages of a failure add up to its MTTR: ``replan`` is the time spent in
        reconfigurations that a later failure interrupted (0 without one); the
        other stages are those of the reconfiguration that completed.
        """
        m = self.marks
        out = []
        for f in self.failures:
            start = f.fault_at if f.fault_at is not None else f.detected_at
            stages = {
                "detect": f.detected_at - start,
                # time lost to reconfigurations that a later failure interrupted
                "replan": m["detect"] - f.detected_at,
                "plan": m["plan"] - m["detect"],
                "launch": m["launch"] - m["plan"],
                "restore": m["restore"] - m["launch"],
                "rebuild": m["rebuild"] - m["restore"],
                "resume": m["resume"] - m["rebuild"],
            }
            out.append(
                {
                    "kind": f.kind,
                    "rank": f.rank,
                    "step": f.step,
                    "detail": f.detail,
                    "detect_s": f.detected_at - start,
                    "stages": stages,
                    "training_again_s": m["rebuild"] - start,
                    "mttr_s": m["resume"] - start,
                    "lost_steps": self.lost_steps,
                    "restore_step": self.restore_step,
                    "replacement": self.replacements.get(f.rank, "none"),
                    "generation": self.generation,
                    "replans": self.replans,
                }
            )
        return out
