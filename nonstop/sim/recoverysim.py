"""Recoveries in the simulator: the runtime's own generation machine
(:class:`~nonstop.policy.reconfiguration.Reconfiguration`), driven by a simulated executor.

The runtime feeds the machine what the ranks report and carries its actions out over the network;
here each report comes after a calibrated duration instead, in simulated time, for a job of two
ranks -- the one replaced (rank 0) and a survivor standing for every other rank (they all do the
same thing at the same time):

==========================  =======================================================================
event                       when (seconds after the plan)
==========================  =======================================================================
``Launched`` (rank 0)       ``launch_s``: a hot spare takes the rank, or a cold process starts
``FetchDone`` (rank 0)      ``fetch_s``: its node fetched the restore step from a peer's memory,
                            concurrently with the launch (None: the node holds it)
``Restored`` (each rank)    ``restore_s`` after the machine told the rank (``Reconfigure``)
``Joined`` (each rank)      ``rebuild_s`` after the machine said ``Rebuild``
``Stepped`` (each rank)     ``step_s`` after ``Resumed``
==========================  =======================================================================

So the machine decides the order -- which rank is told when, that the launch waits for the fetch
and the group for the slowest restore -- and the simulator only times it: a change to the
runtime's stages (its transition is called through its module) changes the simulated recovery.
What comes before the machine (detection, planning, a durable install) the strategy adds itself.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

from nonstop.policy import reconfiguration as recovery
from nonstop.policy.reconfiguration import Action, Reconfiguration, RecoveryEvent

__all__ = ["RecoveryCosts", "RecoveryTiming", "time_recovery"]

REPLACED, SURVIVOR = 0, 1


@dataclass(frozen=True, kw_only=True)
class RecoveryCosts:
    """Durations (seconds) at the job's scale (see the module docstring). ``launch_s`` None: no
    rank is replaced (a shrink: the survivors go on alone)."""

    launch_s: float | None
    fetch_s: float | None
    restore_s: float
    rebuild_s: float
    step_s: float

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if v is not None and (v < 0 or (name == "step_s" and v <= 0)):
                raise ValueError(f"recovery cost {name} must be >= 0 (step_s > 0), got {v}")
        if self.launch_s is None and self.fetch_s is not None:
            raise ValueError("a fetch needs a replaced rank (launch_s) to fetch for")


@dataclass(frozen=True, kw_only=True)
class RecoveryTiming:
    """One generation set up, simulated: each stage the machine logged (launch, restore, rebuild,
    resume) with its seconds, and the actions it took in order."""

    stages: tuple[tuple[str, float], ...]
    actions: tuple[str, ...]

    def stage(self, name: str) -> float:
        return dict(self.stages).get(name, 0.0)

    @property
    def pause(self) -> tuple[tuple[str, float], ...]:
        """The stages the job does not train in (``resume`` is its first step: training)."""
        return tuple((n, s) for n, s in self.stages if n != recovery.Stage.RESUME.value)


@functools.lru_cache(maxsize=256)
def time_recovery(costs: RecoveryCosts) -> RecoveryTiming:
    """Run one generation's setup through the machine in simulated time (cached: the same costs
    give the same timing)."""
    r = Reconfiguration(generation=1, world_size=2, failures=[], restore_step=0)
    r.marks["detect"] = r.marks["plan"] = 0.0
    if costs.launch_s is not None:
        r.waiting_launch.add(REPLACED)
    if costs.fetch_s is not None:
        r.waiting_fetch.add(REPLACED)
    return _SimExecutor(r, costs).run()


class _SimExecutor:
    """Carries the machine's actions out as durations on a simulated clock."""

    def __init__(self, r: Reconfiguration, costs: RecoveryCosts) -> None:
        self.r, self.k = r, costs
        self._queue: list[tuple[float, int, RecoveryEvent]] = []
        self._seq = itertools.count()
        self.stages: list[tuple[str, float]] = []
        self.actions: list[str] = []
        self.done = False

    def _at(self, ev: RecoveryEvent) -> None:
        heapq.heappush(self._queue, (ev.t, next(self._seq), ev))

    def run(self) -> RecoveryTiming:
        k = self.k
        if k.launch_s is not None:
            self._at(recovery.Launched(REPLACED, k.launch_s))
        if k.fetch_s is not None:
            self._at(recovery.FetchDone(REPLACED, k.fetch_s))
        self._do(self.r.start(0.0), 0.0)
        while self._queue and not self.done:
            t, _, ev = heapq.heappop(self._queue)
            self._do(self.r.on_event(ev), t)
        if not self.done:
            raise RuntimeError(f"the simulated recovery did not complete (stuck in {self.r.stage})")
        return RecoveryTiming(stages=tuple(self.stages), actions=tuple(self.actions))

    def _do(self, actions: list[Action], t: float) -> None:
        k = self.k
        for a in actions:
            self.actions.append(type(a).__name__)
            if isinstance(a, recovery.Reconfigure):
                self._at(recovery.Restored(a.rank, t + k.restore_s))
            elif isinstance(a, recovery.Rebuild):
                for rank in (REPLACED, SURVIVOR):
                    self._at(recovery.Joined(rank, t + k.rebuild_s))
            elif isinstance(a, recovery.Resumed):
                for rank in (REPLACED, SURVIVOR):
                    self._at(recovery.Stepped(rank, t + k.step_s))
            elif isinstance(a, recovery.StageEnded):
                self.stages.append((a.stage.value, a.seconds))
            elif isinstance(a, recovery.Finished):
                self.done = True
            # KillLaggards: no timeout is set here (timeout_s 0), so the machine never asks
