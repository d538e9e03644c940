"""The coordinator's side of persist rounds (a job of several nodes): start the next round when
one is due, watch the one in flight, and make the final step durable before the nodes are
released. The rounds themselves (:class:`~nonstop.runtime.persistence.ClusterPersister`) open a
checkpoint, have each node write its ranks, and commit.

Threading: the coordinator's thread only. The final persist is an operation like the rest:
:meth:`PersistOps.final_tick` starts it and watches it, turn by turn of the coordinator's loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nonstop.runtime.phase import JobPhase, Op

if TYPE_CHECKING:
    from nonstop.runtime.coordinator import Coordinator

__all__ = ["PersistOps"]

log = logging.getLogger(__name__)


class PersistOps:
    """Persist rounds as the job runs and as it ends (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self._final_step: int | None = None  # the final persist's step, once started
        self._final_deadline = 0.0
        self._final_over = False

    def tick(self) -> None:
        """Check the persist round in flight; start the next one when due (RUNNING only)."""
        rounds = self.c.rounds
        if rounds is None or self.c.store.awaiting:
            return
        rounds.check(set(self.c.view.alive_nodes()))
        if self.c.may_start(Op.PERSIST) and len(self.c.view.latest_step) == self.c.view.world_size:
            if rounds.wanted(self.c.committed()):
                rounds.start(self.c.committed(), self.c.view.placement())

    def final_tick(self) -> bool:
        """After the job ended, before the nodes are released: make the newest step every rank
        holds durable (the final step of a finished job, else the committed step), waiting at
        most ``persist_timeout_s``. Called once per loop turn; True once nothing is left to wait
        for (persisted, failed, timed out, or nothing to persist)."""
        rounds = self.c.rounds
        if self._final_over:
            return True
        if self._final_step is None:
            step = self._start_final()
            if step is None:
                return self._end_final()
            self._final_step = step
            self._final_deadline = time.monotonic() + self.c.config.persist_timeout_s
        assert rounds is not None
        rounds.check(set(self.c.view.alive_nodes()))
        if rounds.round is not None and time.monotonic() < self._final_deadline:
            return False
        if rounds.round is not None:
            rounds.abort(f"the final persist did not finish in {self.c.config.persist_timeout_s:g}s")
        if rounds.last_step != self._final_step:
            log.warning("final persist of step %d failed: %s", self._final_step, rounds.last_error)
        return self._end_final()

    def _start_final(self) -> int | None:
        """Start the final persist round; its step, or None when there is nothing to persist."""
        rounds = self.c.rounds
        if rounds is None or len(self.c.view.latest_step) < self.c.view.world_size:
            return None
        if any(not self.c.view.nodes[n].alive for n in self.c.view.placement()):
            return None  # a rank's memory is gone with its node: the last committed checkpoint stands
        step = (
            min(self.c.view.latest_step.values())
            if self.c.view.phase is JobPhase.DONE
            else self.c.committed()
        )
        if rounds.round is not None and rounds.round.step != step:
            rounds.abort(f"superseded by the final persist of step {step}")
        if rounds.round is None and rounds.last_step != step:
            rounds.request()
            rounds.start(step, self.c.view.placement())
        return step

    def _end_final(self) -> bool:
        self._final_over = True
        self.c.clients.answer_persists()
        return True
