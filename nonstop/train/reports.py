"""What the coordinator hears of each completed step, and the snapshot it waits for.

:class:`StepReports` takes a completed step: it snapshots the state after it when due (the
schedule is :class:`~nonstop.train.snapshots.LoopSnapshots`'s: ``--snapshot-every``, an interval a
``--snapshot-budget`` tuned, the run's last step, a swap's boundary) and sends the step's report
(``wire.StepDone``): at once for a step not snapshotted (``snapped: False``, progress only), else
once its snapshot is complete -- a step counts as committed only then. With a budget, the report
of the first snapshotted-or-not step past :data:`~nonstop.policy.cadence.SKIP` of each generation
carries the digest of the state outside the replicated tensors (``rest``: may a survivor stand in
for a replaced rank, :mod:`nonstop.train.rescue`).

Threading contract: :meth:`StepReports.completed` on the main thread (the training loop's); the
report of a snapshotted step is sent from the snapshot's copier thread once it completes
(``send_quietly``).
"""

from __future__ import annotations

import functools
import time

from nonstop.policy import cadence
from nonstop.protocol.worker import StepMsg
from nonstop.snapshot import StateCapture
from nonstop.train.link import CoordinatorLink
from nonstop.train.rescue import rest_digest
from nonstop.train.snapshots import LoopSnapshots

__all__ = ["StepReports"]


class StepReports:
    """Snapshot and report each completed step (module docstring), over ``link``, into
    ``snaps``; ``snapshot_budget``: the job's ``--snapshot-budget`` (0: none, no digests)."""

    def __init__(self, *, link: CoordinatorLink, snaps: LoopSnapshots, snapshot_budget: float) -> None:
        self._link = link
        self._snaps = snaps
        self._budget = snapshot_budget
        self._rest_gen: int | None = None  # the generation whose digest this rank reported

    def completed(
        self,
        step: int,
        *,
        generation: int,
        capture: StateCapture,
        step_s: float,
        wait_s: float,
        loss: float | None,
        num_steps: int | None,
        since: float,
    ) -> None:
        """The state after ``step`` steps (``capture``) is the live one: snapshot it when due and
        report it. ``step_s``: how long the step took, ``wait_s`` of it in collectives;
        ``since``: when the loop took the step as completed (monotonic: the report's ``snap_s``
        counts from there); ``num_steps``: the run's length (None: unknown)."""
        snaps, link = self._snaps, self._link
        final = num_steps is not None and step >= num_steps
        due = snaps.due(step, final=final, pause_at=link.pause_at)
        snap = snaps.take(step, capture, generation) if due else None
        # Stall: time the loop spent on this snapshot now, plus what the step just run
        # waited for the previous snapshot's background copy.
        stall_s = time.monotonic() - since + snaps.waited_s()
        rest = None
        if self._budget > 0 and step >= cadence.SKIP and self._rest_gen != generation:
            rest = rest_digest(capture.head())  # once a generation (policy/cadence.py)
            self._rest_gen = generation
        report = StepMsg(
            gen=generation,
            step=step,
            step_s=step_s,
            # issue 21: seconds of the step spent waiting in the gradient allreduce (step_s minus
            # this is the rank's own compute: the coordinator's fail-slow detection compares it)
            wait_s=round(wait_s, 6),
            snap_s=stall_s,
            of=num_steps,  # issue 21: the run's length (the proactive policy's remaining steps)
            nbytes=snap.nbytes if snap is not None else 0,
            loss=loss,
            snapped=due,  # not: progress only, the committed step stays where it is
            rest=rest,
        ).encode()
        # with overlapped capture the snapshot is complete when the background copy finishes
        if snap is None:
            link.send(report)
        else:
            snap.on_complete(functools.partial(link.send_quietly, report))
