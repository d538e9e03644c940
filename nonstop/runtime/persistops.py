"""The coordinator's side of persist rounds (a job of several nodes): start the next round when
one is due, watch the one in flight, and make the final step durable before the nodes are
released. The rounds themselves (:class:`~nonstop.runtime.persistence.ClusterPersister`) open a
checkpoint, have each node write its ranks, and commit.

Threading: the coordinator's thread only; :meth:`PersistOps.final` serves events while it waits.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from nonstop.runtime.phase import TICK_S, JobPhase, Op

if TYPE_CHECKING:
    from nonstop.runtime.coordinator import Coordinator

__all__ = ["PersistOps"]

log = logging.getLogger(__name__)


class PersistOps:
    """Persist rounds as the job runs and as it ends (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c

    def tick(self) -> None:
        """Check the persist round in flight; start the next one when due (RUNNING only)."""
        rounds = self.c.rounds
        if rounds is None or self.c.store.awaiting:
            return
        rounds.check(set(self.c.view.alive_nodes()))
        if self.c.may_start(Op.PERSIST) and len(self.c.view.latest_step) == self.c.view.world_size:
            if rounds.wanted(self.c.committed()):
                rounds.start(self.c.committed(), self.c.view.placement())

    def final(self) -> None:
        """Before the nodes are released: make the newest step every rank holds durable (the
        final step of a finished job, else the committed step), waiting at most persist_timeout_s."""
        rounds = self.c.rounds
        if rounds is None or len(self.c.view.latest_step) < self.c.view.world_size:
            return
        if any(not self.c.view.nodes[n].alive for n in self.c.view.placement()):
            return  # a rank's memory is gone with its node: the last committed checkpoint stands
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
        deadline = time.monotonic() + self.c.config.persist_timeout_s
        while rounds.round is not None and time.monotonic() < deadline:
            self.c.pump_events(TICK_S)
            rounds.check(set(self.c.view.alive_nodes()))
        if rounds.round is not None:
            rounds.abort(f"the final persist did not finish in {self.c.config.persist_timeout_s:g}s")
        if rounds.last_step != step:
            log.warning("final persist of step %d failed: %s", step, rounds.last_error)
        self.c.clients.answer_persists()
