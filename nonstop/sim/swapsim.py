"""Live migrations and elastic grows in the simulator: the runtime's own boundary-swap machine
(:class:`~nonstop.policy.boundary_swap.BoundarySwap`), driven by a simulated executor.

The runtime feeds the machine real events and carries its actions out over the network; here
each action takes a calibrated duration instead, in simulated time:

=====================  ============================================================================
action                 duration
=====================  ============================================================================
``Fetch`` (prepare)    a rank's whole state from a peer's memory (``fetch_s``)
``Prepare``            the joiner restores it from its node's memory and runs its sandboxed warm-up
                       step (``restore_s + step_s``); the job trains meanwhile
``Fetch`` (catch-up)   a compressed delta against the step held (``delta_fetch_s``) or the whole step
``Pause {at: S}``      the job trains on until every rank completed the boundary step S
``Fetch`` (boundary)   asked when the source rank completed S; the swap waits for what is left of it
``SwapNow``            the joiner restores S (``restore_s``), the group is rebuilt at the job's scale
                       (``rebuild_s``), plus the per-swap cost measured on a real job that the parts
                       above do not explain (``extra_pause_s``)
=====================  ============================================================================

So the machine decides -- how many catch-up rounds, whether the boundary comes as a delta, how far
ahead the boundary lies -- and the simulator only times its decisions: a change to the runtime's
swap (its policies are called through their modules) changes the simulated pause too.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nonstop.policy import boundary_swap as swap_machine
from nonstop.policy.boundary_swap import Action, BoundarySwap, Joiner, SwapKind
from nonstop.policy.migration import CatchUp, Transfer

__all__ = ["SwapCosts", "SwapTiming", "time_swap"]

START_STEP = 100  # the step the job has reached when the swap starts (any will do: times are relative)


@dataclass(frozen=True, kw_only=True)
class SwapCosts:
    """Durations (seconds) of a swap's actions at the job's scale (see the module docstring)."""

    step_s: float
    fetch_s: float
    delta_fetch_s: float
    restore_s: float
    rebuild_s: float
    extra_pause_s: float = 0.0

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if v < 0 or (name == "step_s" and v <= 0):
                raise ValueError(f"swap cost {name} must be >= 0 (step_s > 0), got {v}")


@dataclass(frozen=True, kw_only=True)
class SwapTiming:
    """One swap, simulated: ``prepare_s`` from the start until every rank stopped at the boundary
    (the job trains meanwhile), ``pause_s`` from then until the new generation trains (the job
    waits; beyond the step itself), that pause by stage, and what the machine decided."""

    prepare_s: float
    pause_s: float
    stages: tuple[tuple[str, float], ...]
    boundary_steps_ahead: int
    catchup_rounds: int
    swap_delta: bool | None
    actions: tuple[str, ...]


def time_swap(kind: SwapKind, costs: SwapCosts, *, joiners: int = 1, swap_mode: str = "auto") -> SwapTiming:
    """Run one migration (one joiner) or grow (``joiners``) through the machine in simulated time."""
    world = 2  # the source rank and one other: every rank pauses at the same instant here
    if kind is SwapKind.MIGRATION:
        js = [Joiner(sid=100, rank=1, node="target")]
        m = BoundarySwap(
            kind=kind,
            joiners=js,
            world_size=world,
            new_world_size=world,
            source_rank=1,
            source_node="source",
            prepare_step=START_STEP - 1,
            started=0.0,
            reason="drain",
            leaver_sid=1,
            catch=CatchUp(),
            swap_mode=swap_mode,
        )
    else:
        js = [Joiner(sid=100 + i, rank=world + i, node=f"joiner{i}") for i in range(joiners)]
        m = BoundarySwap(
            kind=kind,
            joiners=js,
            world_size=world,
            new_world_size=world + joiners,
            source_rank=0,
            source_node="source",
            prepare_step=START_STEP - 1,
            started=0.0,
        )
    return _SimExecutor(m, costs).run()


class _SimExecutor:
    """Carries the machine's actions out as durations on a simulated clock."""

    def __init__(self, m: BoundarySwap, costs: SwapCosts) -> None:
        self.m, self.k = m, costs
        self.t = 0.0
        self._queue: list[tuple[float, int, Callable[[], list[Action]]]] = []
        self._seq = itertools.count()
        self.actions: list[str] = []
        self.paused_at: float | None = None
        self.boundary_ready: float | None = None
        self.pause: tuple[tuple[str, float], ...] = ()
        self.done = False

    def step(self) -> int:
        """The newest step every rank completed by now (they train until they pause)."""
        return START_STEP - 1 + int(self.t / self.k.step_s)

    def _at(self, t: float, event: Callable[[], list[Action]]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), event))

    def _progress(self) -> dict[str, Any]:
        s = self.step()
        return {"latest": {r: s for r in range(self.m.world_size)}, "committed": s, "now": self.t}

    def run(self) -> SwapTiming:
        self._do(self.m.start())
        while self._queue and not self.done:
            self.t, _, event = heapq.heappop(self._queue)
            self._do(event())
        if self.paused_at is None or not self.done:
            raise RuntimeError(f"the swap did not complete in simulation ({self.m.phase}: {self.m.error})")
        c = self.m.catch
        return SwapTiming(
            prepare_s=self.paused_at,
            pause_s=sum(s for _, s in self.pause),
            stages=self.pause,
            boundary_steps_ahead=(self.m.boundary or 0) - (START_STEP - 1),
            catchup_rounds=c.rounds if c is not None else 0,
            swap_delta=c.swap_delta if c is not None else None,
            actions=tuple(self.actions),
        )

    def _do(self, actions: list[Action]) -> None:
        m, k = self.m, self.k
        for a in actions:
            self.actions.append(a.kind if isinstance(a, swap_machine.Emit) else type(a).__name__)
            if isinstance(a, swap_machine.Fetch):
                self._fetch(a)
            elif isinstance(a, swap_machine.Prepare):
                self._at(self.t + k.restore_s + k.step_s, self._restored(a.sid))
            elif isinstance(a, swap_machine.Pause):
                at = a.at
                done_at = (at - (START_STEP - 1)) * k.step_s  # when every rank completed step S

                def paused(at: int = at) -> list[Action]:
                    self.paused_at = self.t
                    out = m.on_paused(m.source_rank, at, self.t)  # the source first: its fetch starts
                    for r in range(m.world_size):
                        if r != m.source_rank:
                            out += m.on_paused(r, at, self.t)
                    return out

                self._at(max(self.t, done_at), paused)
            elif isinstance(a, swap_machine.SwapNow):
                assert self.boundary_ready is not None
                self.pause = (
                    ("fetch", max(0.0, self.boundary_ready - self.t)),
                    ("restore", k.restore_s),
                    ("rebuild", k.rebuild_s + k.extra_pause_s),
                )
                m.generation = 1
                back = self.t + sum(s for _, s in self.pause) + k.step_s
                self._at(back, lambda: m.on_generation_done(median_step_s=k.step_s, now=self.t))
            elif isinstance(a, swap_machine.Finished):
                if not a.ok:
                    raise RuntimeError(f"the simulated swap aborted: {a.error}")
                self.done = True

    def _restored(self, sid: int) -> Callable[[], list[Action]]:
        return lambda: self.m.on_restored(sid, **self._progress())

    def _fetch(self, a: swap_machine.Fetch) -> None:
        m, k = self.m, self.k
        seconds = k.delta_fetch_s if a.base is not None else k.fetch_s
        if a.purpose == "boundary":
            self.boundary_ready = self.t + seconds
        elif a.purpose == "prepare":
            sid = a.sid
            self._at(self.t + seconds, lambda: m.on_prepare_fetched(sid, True, None, self.t))
        else:  # a catch-up: its measure feeds swap_as_delta as the runtime's does
            wire = seconds / k.fetch_s if k.fetch_s > 0 else 1.0
            t = Transfer(raw_bytes=1_000_000, wire_bytes=max(1, int(1_000_000 * wire)), seconds=seconds)
            delta = a.base is not None
            self._at(self.t + seconds, lambda: m.on_catchup_fetched(True, t, delta=delta, **self._progress()))
