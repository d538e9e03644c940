"""The clock the coordinator's operations read (issue 46: "the clock comes in"): an operation is
given a :class:`Clock` instead of calling :mod:`time` itself, so a test drives its timeouts with a
fake one (``tests/coord_fakes.FakeClock``) and no sleep.

``monotonic()`` is for durations and deadlines (:func:`time.monotonic`); ``wall()`` for times
other processes compare with ours, such as a stage's end logged against workers' reports
(:func:`time.time`). The coordinator's assembly (:mod:`nonstop.coordinator.assembly`) gives each
operation the same :data:`SYSTEM_CLOCK`, and the loop (:mod:`.loop`) reads it too. Every
operation reads it but these, which keep :mod:`time`: the status server's threads
(:mod:`.status_server`) and the status board they share with the loop (:class:`.metrics.StatusBoard`:
real waits between threads), :meth:`.event_feed.EventFeed.flush` (a real wait for its sender thread)
and the persist rounds' :class:`.persistence.ClusterPersister` (it takes a clock, but the launcher
builds it before the assembly: the system one). :class:`.view.WorkerRecord`'s times are whatever
clock made them (no default reads :mod:`time`).
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    """What an operation reads the time through."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (durations, deadlines)."""
        ...

    def wall(self) -> float:
        """Unix time (what other processes' timestamps are compared with)."""
        ...


class SystemClock:
    """The real clock: :func:`time.monotonic` and :func:`time.time`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


SYSTEM_CLOCK: Clock = SystemClock()
"""The one real clock, the default of every operation that takes a :class:`Clock`."""
