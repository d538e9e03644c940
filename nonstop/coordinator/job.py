"""The job's life as every operation sees it: its phase and the legal moves between phases,
what background operation may start now, the committed step, failing and finishing.

:class:`JobLife` is the one place that changes the job's phase. What may start depends on what
is under way: each operation that can block another says so itself (its ``busy()``, registered
with :meth:`JobLife.busy_from`), so no rule here reads another operation's fields.

Threading: the coordinator's thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from nonstop import events as ev
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.view import JobView
from nonstop.events.log import EventLog
from nonstop.policy.phase import Busy, JobPhase, Op, legal, may_start
from nonstop.protocol.worker import AbortMsg, FinishMsg

__all__ = ["JobLife"]


class JobLife:
    """The phase, the job's error, and the committed step (see the module docstring).
    ``replicating``: the job replicates to peers (its committed step is the replicated one)."""

    def __init__(self, *, view: JobView, events: EventLog, io: Executor, replicating: bool) -> None:
        self.view = view
        self.events = events
        self.io = io
        self.replicating = replicating
        self.error: str | None = None
        self.usage_error = False  # error is the training script's mistake (nonstop run exits 2)
        self._busy: list[Callable[[], set[Busy]]] = []
        self._before_finish: list[Callable[[], None]] = []

    def busy_from(self, *sources: Callable[[], set[Busy]]) -> None:
        """Count what each of ``sources`` says is under way in :meth:`may_start`."""
        self._busy.extend(sources)

    def before_finish(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when every rank has its final step, before the members are released."""
        self._before_finish.append(hook)

    @property
    def phase(self) -> JobPhase:
        return self.view.phase

    def set_phase(self, new: JobPhase) -> None:
        assert legal(self.view.phase, new), f"the job cannot go from {self.view.phase} to {new}"
        self.view.phase = new

    def busy(self) -> set[Busy]:
        """What is under way now that may block a background operation (``phase.may_start``)."""
        out: set[Busy] = {Busy.ENDING} if self.view.done_ranks else set()
        for source in self._busy:
            out |= source()
        return out

    def may_start(self, op: Op) -> bool:
        return may_start(op, self.view.phase, self.busy())

    def committed(self) -> int:
        """The committed step: what is replicated to peers (with replication), else in memory."""
        v = self.view
        if self.replicating and v.replicated_step is not None:
            return v.replicated_step
        return min((v.latest_step.get(rank, 0) for rank in range(v.world_size)), default=0)

    def fail(self, error: str, *, usage: bool = False) -> None:
        """End the job as failed with ``error`` (``usage``: the script's mistake, exit 2). The
        first cause stands: a job already ended is left as it is."""
        if self.view.phase.is_terminal:
            return
        self.error = error
        self.usage_error = usage
        self.set_phase(JobPhase.FAILED)
        self.events.emit(ev.JobFailed(error=error))
        for w in self.view.workers.values():
            self.io.send(w, AbortMsg(error=error).encode())

    def finish(self) -> None:
        """Every rank has the final step snapshotted: release members and spares."""
        for hook in self._before_finish:
            hook()
        self.set_phase(JobPhase.FINISHING)
        self.events.emit(
            ev.Finish(step=min(self.view.latest_step.values(), default=0), generation=self.view.generation)
        )
        for w in self.view.workers.values():
            self.io.send(w, FinishMsg().encode())
