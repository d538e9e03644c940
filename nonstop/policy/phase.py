"""The job's phase, its legal transitions, and which background operation may start when (pure).

::

    starting --> reconfiguring <--> running --> finishing --> done
         \\______________\\______________\\___________\\______> failed

* **starting**: nodes join, the first processes launch; the first generation is planned once
  every member connected.
* **reconfiguring**: a generation is being set up (a recovery, a boundary swap, a restarted
  coordinator's resync); it stays so until every rank restored and joined the process group.
* **running**: training. The new generation's first step may still be pending (``RESUMING``).
* **finishing**: every rank reported its last step; processes are told to finish.
* **done** / **failed**: terminal.

Background operations (replication rounds, persist rounds, migrations, grows) start only in a
phase that allows them and when nothing they conflict with is under way (:func:`may_start`).
This one table replaces the guards each operation used to carry; the simulator asks it too.
"""

from __future__ import annotations

import enum
from collections.abc import Set

__all__ = [
    "BLOCKED_BY",
    "TICK_S",
    "Busy",
    "JobPhase",
    "Op",
    "PHASE_ALLOWS",
    "TRANSITIONS",
    "legal",
    "may_start",
]


TICK_S = 0.005  # the coordinator's loop waits at most this long for an event before its periodic checks


class JobPhase(enum.StrEnum):
    STARTING = "starting"
    RECONFIGURING = "reconfiguring"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobPhase.DONE, JobPhase.FAILED)

    @property
    def is_ending(self) -> bool:
        """Nothing new starts: the job finishes or has ended."""
        return self in (JobPhase.FINISHING, JobPhase.DONE, JobPhase.FAILED)


TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.STARTING: frozenset({JobPhase.RECONFIGURING, JobPhase.FAILED}),
    # a failure during a reconfiguration starts the next generation: reconfiguring again
    JobPhase.RECONFIGURING: frozenset({JobPhase.RECONFIGURING, JobPhase.RUNNING, JobPhase.FAILED}),
    JobPhase.RUNNING: frozenset({JobPhase.RECONFIGURING, JobPhase.FINISHING, JobPhase.FAILED}),
    JobPhase.FINISHING: frozenset({JobPhase.DONE, JobPhase.FAILED}),
    JobPhase.DONE: frozenset(),
    JobPhase.FAILED: frozenset(),
}


def legal(old: JobPhase, new: JobPhase) -> bool:
    """Whether the job may go from ``old`` to ``new``."""
    return new in TRANSITIONS[old]


class Op(enum.StrEnum):
    """Background operations that start on their own while the job trains."""

    REPLICATE = "replicate"  # a replication round: the newest step of every rank to its holders
    PERSIST = "persist"  # a persist round: the committed step to the durable tier
    MIGRATE = "migrate"  # the next queued live migration
    GROW = "grow"  # an elastic grow back towards the full world size


class Busy(enum.StrEnum):
    """What may be under way while the job runs, and blocks some operations."""

    RESUMING = "resuming"  # a new generation's first step is pending (the critical path)
    SWAPPING = "swapping"  # ranks pause at a boundary step or swap (a migration's or a grow's)
    MIGRATING = "migrating"  # a migration is in flight or queued
    GROWING = "growing"  # a grow is in flight
    RESYNCING = "resyncing"  # a restarted coordinator waits for nodes to reconnect
    ENDING = "ending"  # some ranks already reported their last step


PHASE_ALLOWS: dict[JobPhase, frozenset[Op]] = {
    JobPhase.STARTING: frozenset(),
    JobPhase.RECONFIGURING: frozenset(),
    JobPhase.RUNNING: frozenset(Op),
    JobPhase.FINISHING: frozenset(),
    JobPhase.DONE: frozenset(),
    JobPhase.FAILED: frozenset(),
}

BLOCKED_BY: dict[Op, frozenset[Busy]] = {
    # a round during a pause or the first step doubles that step on a small host; the paused
    # step is held in memory anyway
    Op.REPLICATE: frozenset({Busy.RESUMING, Busy.SWAPPING, Busy.RESYNCING}),
    Op.PERSIST: frozenset({Busy.RESYNCING}),
    Op.MIGRATE: frozenset({Busy.RESUMING, Busy.RESYNCING, Busy.GROWING}),
    Op.GROW: frozenset(
        {Busy.RESUMING, Busy.SWAPPING, Busy.MIGRATING, Busy.GROWING, Busy.RESYNCING, Busy.ENDING}
    ),
}


def may_start(op: Op, phase: JobPhase, busy: Set[Busy]) -> bool:
    """Whether ``op`` may start now: the phase allows it and nothing blocking it is under way."""
    return op in PHASE_ALLOWS[phase] and not (BLOCKED_BY[op] & busy)
