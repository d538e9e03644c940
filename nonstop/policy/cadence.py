"""How often a job snapshots: a fixed ``--snapshot-every K``, or tuned to a stall budget.

Every snapshot stalls the training loop a little (the capture's start, and the wait for its
overlapped copy before the next optimizer step: ``snap_s`` in each step's report). With
``--snapshot-budget F`` the job spends at most the fraction F of its training time on that stall:
the coordinator (:class:`CadenceTuner`) measures the stall per snapshot and the step time over
every rank's reports, and snapshots every K-th step, K the smallest that keeps the stall within
the budget (:func:`choose_every`; never below ``--snapshot-every``, never above
:data:`MAX_EVERY`, nor wider than ``--snapshot-max-age`` seconds of training: the committed step,
which persists, peer replicas and ``nonstop persist`` follow, and the step a failure no rescue
saves goes back to, is never older than that). Failures between two snapshots are rescued
(:mod:`nonstop.policy.rescue`: the survivors write the state after their last completed step), so
a larger K costs only where a rescue cannot be made (the failed step had already written the
state), as CheckFreq tunes its checkpoint frequency to an overhead budget.

Every rank must snapshot the same steps (a recovery restores the newest step *every* rank holds),
so the interval changes only at a step announced ahead: a :class:`Cadence` says "from step
``since`` on, every ``every``-th step counting from ``since``". The coordinator sends the new one to
every member a ``CadenceMsg(every=K, since=S)`` with ``S`` a few steps beyond the newest
step any rank reported, and to each rank that joins later; a rank applies it at the first step
``>= S`` (:meth:`Cadence.due`). A rank that heard it late snapshots a few steps under the old
interval: recoveries then find a slightly older common step, never a wrong one.

A wider interval is safe only where a rescue can replace a lost rank: its replacement takes the
rescued state of a survivor holding the same shards (any rank of a data-parallel job, one of its
copy group in another replica group of an HSDP job) only when their state outside the replicated
tensors -- RNGs, extras, ``state=`` objects -- is alike. So every rank reports the digest of that
state with the first step it completes in each generation from step :data:`SKIP` on (``rest``: the
same step on every rank of a generation), and the tuner widens the interval only when every rank's
digest is of one step and every copy group has two ranks or more and one digest
(:attr:`CadenceTuner.refusal` says why not otherwise: a script that seeds each rank differently,
an FSDP job without replicas). Otherwise a node lost between two snapshots would take the whole
job back to the older one.

Pure except for :class:`CadenceTuner`'s bookkeeping (no I/O, no clock): the simulator uses
:func:`choose_every` with its calibrated stall and step time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_BUDGET", "MAX_AGE_S", "MAX_EVERY", "Cadence", "CadenceTuner", "choose_every"]

# the widest interval a budget may choose: a failure a rescue cannot save redoes at most this many
# steps less one
MAX_EVERY = 128
# the default --snapshot-max-age: at most this many seconds of steps between two snapshots
MAX_AGE_S = 600.0
# the default --snapshot-budget: the snapshots' stall costs at most 0.01 % of the training time. At
# the simulator's calibration (16,384 GPUs, llama3 failures) it picks K = 87 and an ETTR of 0.9976,
# against 0.9891 every step and torchft-like's 0.9975; 0.0002 and 0.0005 gave 0.9975 and 0.9972
# (BENCHMARKS.md). Where a rescue cannot replace a lost rank (ranks unalike, one model copy) the
# tuner keeps --snapshot-every, so the default never trades a lost step for the stall; the
# committed step (persists, peer replicas) is at most MAX_AGE_S old. 0 keeps --snapshot-every.
DEFAULT_BUDGET = 1e-4
WINDOW = 16  # complete steps (every rank reported) per measurement
SKIP = 4  # the job's first steps (slot allocation, warm-up) are not measured
CHANGE = 0.25  # a new interval is announced when it differs by more than this fraction (or 1 step)


@dataclass(frozen=True)
class Cadence:
    """From step ``since`` on, snapshot every ``every``-th step counting from ``since``."""

    every: int = 1
    since: int = 0

    def __post_init__(self) -> None:
        if self.every < 1 or self.since < 0:
            raise ValueError(f"a cadence needs every >= 1 and since >= 0 (got {self.every}, {self.since})")

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` is snapshotted (``step >= since``)."""
        return (step - self.since) % self.every == 0


def choose_every(
    stall_s: float,
    step_s: float,
    *,
    budget: float,
    floor: int = 1,
    most: int = MAX_EVERY,
    max_age_s: float | None = None,
) -> int:
    """The smallest interval K in ``floor..most`` whose stall, ``stall_s`` per snapshot, costs at
    most ``budget`` of the training time (``stall_s / K <= budget * step_s``), and whose K steps
    take at most ``max_age_s`` (None: no bound); ``floor`` wins over both bounds."""
    if budget <= 0 or step_s <= 0:
        raise ValueError(f"choose_every needs budget > 0 and step_s > 0 (got {budget}, {step_s})")
    if max_age_s is not None:
        most = min(most, math.floor(max_age_s / step_s + 1e-9))
    if stall_s <= 0:
        return floor
    return max(floor, min(most, math.ceil(stall_s / (budget * step_s) - 1e-9)))


class CadenceTuner:
    """The coordinator's side of ``--snapshot-budget`` (see the module docstring): fed every
    rank's step reports (:meth:`on_step`), it returns a new :class:`Cadence` to announce when the
    measured stall calls for another interval."""

    def __init__(
        self,
        *,
        budget: float,
        floor: int = 1,
        most: int = MAX_EVERY,
        max_age_s: float | None = None,
        copy_group: Callable[[int], int] | None = None,
    ) -> None:
        """``max_age_s``: the interval's steps take at most this long (:func:`choose_every`).
        ``copy_group``: rank -> the ranks holding the same shards (an HSDP job's
        :meth:`~nonstop.mesh.MeshSpec.copy_group`); None: every rank holds the same state."""
        if budget <= 0:
            raise ValueError(f"a snapshot budget must be > 0 (got {budget})")
        self.budget, self.floor, self.most, self.max_age_s = budget, floor, most, max_age_s
        self._copy_group = copy_group or (lambda rank: 0)
        self._rests: dict[int, tuple[int, str]] = {}  # rank -> (step, its digest): Step.rest
        self.refusal: str | None = None  # why the interval may not widen, once known
        self.current = Cadence(every=floor)
        # step -> [slowest step_s, largest snap_s, ranks reported, snapshotted]
        self._open: dict[int, list[float]] = {}
        self._closed: list[tuple[float, float, bool]] = []
        self._newest = 0
        self.measured: tuple[float, float] | None = None  # the last (stall per snapshot, step s)

    def on_step(
        self,
        *,
        step: int,
        step_s: float,
        snap_s: float,
        snapped: bool,
        world_size: int,
        rank: int = 0,
        rest: str | None = None,
    ) -> Cadence | None:
        """One rank's report of ``step`` (``rest``: its digest, once); the cadence to announce
        now, if any."""
        self._newest = max(self._newest, step)
        if rest is not None:
            self._rests[rank] = (step, rest)
        if step < max(SKIP, self.current.since + 1):  # (a measurement starts under the new cadence)
            return None
        row = self._open.setdefault(step, [0.0, 0.0, 0.0, 0.0])
        row[0], row[1], row[2] = max(row[0], step_s), max(row[1], snap_s), row[2] + 1
        row[3] = max(row[3], float(snapped))
        if row[2] >= world_size:
            self._closed.append((row[0], row[1], bool(row[3])))
            del self._open[step]
        for old in [s for s in self._open if s < self._newest - 4 * WINDOW]:  # a rank that never reported
            del self._open[old]
        if len(self._closed) < WINDOW:
            return None
        return self._decide(world_size)

    def adopt(self, running: Cadence) -> bool:
        """A restarted coordinator's fresh tuner takes the interval a reconnecting rank says it
        runs (``cadence`` in its hello's ``resume``: heard from the coordinator before, whose
        tuner had checked the ranks could stand in for each other). Only a wider one is taken --
        it arms the rescues (a failure before the next announcement would otherwise go back to
        the last snapshot, up to K - 1 steps) -- and only within this job's bounds. True when
        taken."""
        if running.every <= self.current.every or running.every > self.most:
            return False
        self.current = running
        self._open.clear()
        self._closed.clear()
        return True

    def _alike(self, world_size: int) -> str | None:
        """None when every rank has a stand-in for a rescue, else why not (module docstring);
        ``""``: not known yet (a rank has not reported this generation's digest)."""
        reports = [self._rests.get(rank) for rank in range(world_size)]
        if any(r is None for r in reports) or len({r[0] for r in reports if r is not None}) > 1:
            return ""
        groups: dict[int, set[str]] = {}
        members: dict[int, int] = {}
        for rank, report in enumerate(reports):
            assert report is not None
            g = self._copy_group(rank)
            groups.setdefault(g, set()).add(report[1])
            members[g] = members.get(g, 0) + 1
        if any(n < 2 for n in members.values()):
            return "a rank's shards have no other copy (no replicas): nothing could stand in for it"
        if any(len(d) > 1 for d in groups.values()):
            return (
                "the ranks' RNGs, extras or state= objects differ (seeded per rank?): a rank lost "
                "between two snapshots could not take a survivor's state"
            )
        return None

    def _decide(self, world_size: int) -> Cadence | None:
        closed, self._closed = self._closed, []
        snapshots = sum(1 for *_, snapped in closed if snapped)
        if snapshots == 0:
            return None
        stall = sum(snap for _, snap, _ in closed) / snapshots  # a snapshot's stall lands over 2 steps
        step_s = statistics.median(s for s, _, _ in closed)
        if step_s <= 0:
            return None
        self.measured = (stall, step_s)
        every = choose_every(
            stall, step_s, budget=self.budget, floor=self.floor, most=self.most, max_age_s=self.max_age_s
        )
        cur = self.current.every
        if every > cur and self.refusal is None:
            why = self._alike(world_size)
            if why == "":
                return None  # (measured again once every rank's digest is in)
            self.refusal = why
        if every > cur and self.refusal is not None:
            return None  # (kept where it is)
        if abs(every - cur) < max(1.0, CHANGE * cur):
            return None
        margin = max(2, math.ceil(0.5 / step_s))  # the announcement reaches every rank first
        self.current = Cadence(every=every, since=self._newest + margin)
        self._open.clear()
        return self.current
