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

:class:`Reconfiguration` is a pure state machine from LAUNCH on: :meth:`~Reconfiguration.start`
and :meth:`~Reconfiguration.on_event` take one event (what a rank reported, or a clock tick; the
time comes with it, from the caller) and return the :data:`Action` s to carry out -- tell a rank
its new generation, rebuild the group, log a stage, resume, kill the ranks a stage waits for too
long, finish. It never does I/O: the coordinator's :class:`~nonstop.coordinator.generations.
Generations` executes the actions, and the simulator (:mod:`nonstop.sim.recoverysim`) replays the
same machine with calibrated durations. Planning (who plays which rank, which step) comes before
it and is :func:`~nonstop.policy.planning.plan_generation`'s, pure too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, TypeAlias

__all__ = [
    "Action",
    "Failure",
    "FetchDone",
    "Finished",
    "Joined",
    "KillLaggards",
    "Launched",
    "Rebuild",
    "Reconfiguration",
    "Reconfigure",
    "RecoveryEvent",
    "Restored",
    "Resumed",
    "Stage",
    "StageEnded",
    "Stepped",
    "Tick",
    "next_stage",
]


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


# -- events (what the machine is told; each carries its wall-clock time) ----------------------------
@dataclass(frozen=True)
class Launched:
    """Rank ``rank``'s process is up and connected (a cold process started, a spare took over)."""

    rank: int
    t: float


@dataclass(frozen=True)
class FetchDone:
    """Rank ``rank``'s node now holds its restore step (fetched from a peer's memory)."""

    rank: int
    t: float


@dataclass(frozen=True)
class Restored:
    """Rank ``rank`` loaded its restore step."""

    rank: int
    t: float


@dataclass(frozen=True)
class Joined:
    """Rank ``rank`` is in the new generation's process group (it reported ready)."""

    rank: int
    t: float


@dataclass(frozen=True)
class Stepped:
    """Rank ``rank`` completed a step in the new generation (or its last one)."""

    rank: int
    t: float


@dataclass(frozen=True)
class Tick:
    """Time passed (timeouts are judged on it)."""

    t: float


RecoveryEvent: TypeAlias = Launched | FetchDone | Restored | Joined | Stepped | Tick


# -- actions (what the executor carries out) -------------------------------------------------------
@dataclass(frozen=True)
class Reconfigure:
    """Tell rank ``rank`` its new generation (rank, world, restore step, shards...)."""

    rank: int


@dataclass(frozen=True)
class Rebuild:
    """Every rank restored: every member joins the new process group."""


@dataclass(frozen=True)
class StageEnded:
    """Stage ``stage`` ended at ``t`` after ``seconds`` (log it)."""

    stage: Stage
    seconds: float
    t: float


@dataclass(frozen=True)
class Resumed:
    """The new group is built: the job trains again (the first step may still be pending)."""

    t: float


@dataclass(frozen=True)
class KillLaggards:
    """A stage overran its timeout: kill the ranks it still waits for (they are recovered)."""

    ranks: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class Finished:
    """Every rank stepped: the generation is set up. ``reports``: one record per failure."""

    reports: tuple[dict[str, Any], ...]


Action: TypeAlias = Reconfigure | Rebuild | StageEnded | Resumed | KillLaggards | Finished

_ORDER = (Stage.LAUNCH, Stage.RESTORE, Stage.REBUILD, Stage.RESUME, Stage.DONE)
_PREVIOUS = {
    Stage.LAUNCH: "plan",
    Stage.RESTORE: "launch",
    Stage.REBUILD: "restore",
    Stage.RESUME: "rebuild",
    Stage.DONE: "resume",
}


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
    # the node to replace it elsewhere than: its failure was graded replace_elsewhere (policy/grading.py)
    avoid_node: str | None = None


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
    # a sharded job resumed at another size: {url, step, world} of the checkpoint every rank reshards
    reshard: dict[str, Any] | None = None
    lost_steps: int = 0  # committed steps the restore went back past (a durable fallback)
    redone_steps: int = 0  # steps completed past the restored one (--snapshot-every K: < K)
    replans: int = 0
    stage: Stage = Stage.PLAN
    waiting_launch: set[int] = field(default_factory=set)
    waiting_fetch: set[int] = field(default_factory=set)  # ranks whose snapshot is being fetched
    restored: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)
    stepped: set[int] = field(default_factory=set)
    marks: dict[str, float] = field(default_factory=dict)
    deadline: float = 0.0  # wall time by which RESTORE/REBUILD must finish (0: not set yet)
    timeout_s: float = 0.0  # how long RESTORE and REBUILD may each take (0: forever)
    told: set[int] = field(default_factory=set)  # ranks told their new generation
    # survivors (ranks that kept their process): wall time of each one's last step before the
    # failure, and the gap to its first step in this generation (the survivor gap)
    survivors_since: dict[int, float] = field(default_factory=dict)
    survivor_gaps: dict[int, float] = field(default_factory=dict)

    # -- the machine ---------------------------------------------------------------------------------
    def start(self, t: float) -> list[Action]:
        """Launch the generation (``marks["plan"]`` set, ``waiting_launch``/``waiting_fetch``
        filled): every rank that is up and holds its restore step is told its new generation."""
        self.stage = Stage.LAUNCH
        out: list[Action] = [a for rank in range(self.world_size) for a in self._tell(rank)]
        return out + self._advance(t)

    def on_event(self, ev: RecoveryEvent) -> list[Action]:
        """One event in, the actions to carry out (pure). Events of a stage already passed, or
        after DONE, change nothing."""
        if self.stage is Stage.DONE:
            return []
        out: list[Action] = []
        if isinstance(ev, Launched):
            self.waiting_launch.discard(ev.rank)
            out += self._tell(ev.rank)
        elif isinstance(ev, FetchDone):
            self.waiting_fetch.discard(ev.rank)
            out += self._tell(ev.rank)
        elif isinstance(ev, Restored):
            self.restored.add(ev.rank)
        elif isinstance(ev, Joined):
            self.ready.add(ev.rank)
        elif isinstance(ev, Stepped):
            if ev.rank not in self.stepped and ev.rank in self.survivors_since:
                self.survivor_gaps[ev.rank] = ev.t - self.survivors_since[ev.rank]
            self.stepped.add(ev.rank)
        elif isinstance(ev, Tick):
            return self._check_timeout(ev.t)
        return out + self._advance(ev.t)

    def _tell(self, rank: int) -> list[Action]:
        if (
            self.stage is Stage.PLAN
            or rank in self.told
            or rank in self.waiting_launch
            or rank in self.waiting_fetch
            or not 0 <= rank < self.world_size
        ):
            return []
        self.told.add(rank)
        return [Reconfigure(rank)]

    def _check_timeout(self, t: float) -> list[Action]:
        """RESTORE and REBUILD each get ``timeout_s``; one kill round per period."""
        if self.stage not in (Stage.RESTORE, Stage.REBUILD) or self.timeout_s <= 0:
            return []
        if self.deadline == 0.0:
            self.deadline = t + self.timeout_s
            return []
        if t <= self.deadline:
            return []
        self.deadline = t + self.timeout_s
        waiting = self.restored if self.stage is Stage.RESTORE else self.ready
        laggards = tuple(sorted(set(range(self.world_size)) - waiting))
        return [KillLaggards(laggards, f"stage {self.stage} timed out")] if laggards else []

    def _advance(self, t: float) -> list[Action]:
        before = self.stage
        after = self.advance()
        if after is before:
            return []
        self.deadline = 0.0  # each stage gets its own timeout
        out: list[Action] = []
        for s in _ORDER[_ORDER.index(before) : _ORDER.index(after)]:
            self.marks[s.value] = t
            out.append(StageEnded(s, t - self.marks[_PREVIOUS[s]], t))
        if before not in (Stage.REBUILD, Stage.RESUME) and after in (Stage.REBUILD, Stage.RESUME, Stage.DONE):
            out.append(Rebuild())
        if after in (Stage.RESUME, Stage.DONE) and before is not Stage.RESUME:
            out.append(Resumed(t))
        if after is Stage.DONE:
            out.append(Finished(tuple(self.report()) if self.failures else ()))
        return out

    def advance(self) -> Stage:
        """The stage after what every rank reported (no actions; :meth:`on_event` uses it)."""
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
                    # the longest a surviving rank went between two completed steps
                    "survivor_gap_s": max(self.survivor_gaps.values(), default=None),
                    "mttr_s": m["resume"] - start,
                    "lost_steps": self.lost_steps,
                    "redone_steps": self.redone_steps,
                    "restore_step": self.restore_step,
                    "replacement": self.replacements.get(f.rank, "none"),
                    "generation": self.generation,
                    "replans": self.replans,
                }
            )
        return out
