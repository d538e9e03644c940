"""Whether a thread got anywhere between two looks: its CPU clock, and its wait for a CPU.

The heartbeat thread asks this of the training thread (:class:`ThreadProgress`), and says
``moving`` when the thread either ran or waited on the kernel's run queue since the heartbeat
before: slow, on a starved machine, rather than stuck. The detector then gives a rank with no
step progress its longer limit (:func:`nonstop.policy.decisions.find_hung_ranks`).

* **Ran**: its CPU-time clock (``pthread_getcpuclockid``) advanced by more than
  :data:`MOVING_CPU_S`.
* **Waited for a CPU**: the run-queue delay the kernel keeps for it (the second field of
  ``/proc/self/task/<tid>/schedstat``, nanoseconds spent runnable but not running) advanced by
  more than :data:`MOVING_WAIT_S`. On a machine with more runnable threads than cores, a thread
  that wakes from a sleep, or that waits for the GIL (which wakes it every switch interval to ask
  for it), can spend seconds there having used almost no CPU -- the case the CPU clock alone
  misses. A thread asleep or blocked on a socket or lock forever does neither.

Either reading may be missing (another platform, a kernel without schedstat): it is then left out,
and with neither the thread's progress is unknown (None).
"""

from __future__ import annotations

import threading
import time

__all__ = ["MOVING_CPU_S", "MOVING_WAIT_S", "ThreadProgress", "own_cpu_clock", "run_queue_s"]

MOVING_CPU_S = 0.001
"""CPU seconds a thread must have used between two looks to count as moving."""

MOVING_WAIT_S = 0.001
"""Seconds a thread must have waited on the run queue between two looks to count as moving."""


def own_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock, for another thread to read; None where the platform
    has none (``pthread_getcpuclockid`` is POSIX). Taken on the thread itself: reading it later
    from elsewhere goes to the kernel, which refuses a clock whose thread is gone (a
    ``pthread_t`` passed later could name freed memory)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def cpu_s(clock: int | None) -> float | None:
    """Seconds on ``clock`` (from :func:`own_cpu_clock`), None if it cannot be read."""
    if clock is None:
        return None
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


def run_queue_s(tid: int | None) -> float | None:
    """Seconds thread ``tid`` of this process (a native id) has spent runnable but not running,
    from the kernel's schedstat; None where there is none, or the thread is gone."""
    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class ThreadProgress:
    """A thread's clocks, read by another thread (:meth:`moved`, one caller at a time)."""

    def __init__(self, clock: int | None = None, tid: int | None = None) -> None:
        self._clock = clock
        self._tid = tid
        self._last: tuple[float | None, float | None] | None = None

    @classmethod
    def of_this_thread(cls) -> ThreadProgress:
        """The calling thread's clocks (taken on the thread itself: see :func:`own_cpu_clock`)."""
        return cls(own_cpu_clock(), threading.get_native_id())

    def _read(self) -> tuple[float | None, float | None]:
        return cpu_s(self._clock), run_queue_s(self._tid)

    def moved(self) -> bool | None:
        """Whether the thread ran or waited for a CPU since the last call (False on the first
        call: nothing to compare with); None when neither clock can be read."""
        now = self._read()
        if now == (None, None):
            return None
        last, self._last = self._last, now
        if last is None:
            return False
        ran = now[0] is not None and last[0] is not None and now[0] - last[0] > MOVING_CPU_S
        waited = now[1] is not None and last[1] is not None and now[1] - last[1] > MOVING_WAIT_S
        return ran or waited
