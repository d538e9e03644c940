"""How long a sharded model's step waits in collectives, measured by sampling (issue 21).

The coordinator's fail-slow detection compares each rank's own **compute time**, ``step_s -
wait_s`` (:mod:`nonstop.policy.straggler`): in a synchronous job every rank's step takes as
long as the slowest one's, and only the time outside collectives tells the straggler (computes
long, waits little) from its peers (compute as usual, wait for it). A data-parallel model's wait
is stamped exactly around nonstop's gradient allreduce (:class:`~nonstop.train.ddp.CanonicalGradSync`).
A sharded model (FSDP2, HSDP, tensor parallel) communicates from ``torch.distributed``'s own
code -- all-gathers before each layer's forward and backward, reduce-scatters after -- with no
place for a stamp around each, so :class:`CollectiveClock` samples instead: a daemon thread
looks every ``period_s`` at the training thread's innermost frame
(:func:`~nonstop.train.collectives.in_collective`, the test the hang detection already uses)
and charges the time since its previous look to "in a collective" when it is there.

:class:`CollectiveWaits` is what the training loop asks: the stamped wait of a DDP model, else a
clock's.

Contract: :meth:`CollectiveClock.take_wait_s` returns the seconds charged since its previous
call (the session calls it as a step starts and as it ends). The estimate's error per step is
about ``period_s`` per collective the sample grid straddles, far below the seconds a fail-slow
rank adds. A look the OS runs late charges at most two periods: a starved sampler under-counts
waits, every rank's alike, and never turns compute into wait. The sampler costs one
``sys._current_frames()`` per period (5 ms: ~200 looks a second, a few microseconds each). On a
device (NCCL) a collective returns at enqueue and the wait happens on the device, unseen here
(the limits in :mod:`nonstop.train.liveness`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from nonstop.train.collectives import in_collective

if TYPE_CHECKING:
    from nonstop.train.ddp import CanonicalGradSync

__all__ = ["PERIOD_S", "CollectiveClock", "CollectiveWaits"]

PERIOD_S = 0.005


class CollectiveClock:
    """Time thread ``thread_id`` spends inside ``torch.distributed``, by sampling (module docstring)."""

    def __init__(self, thread_id: int, *, period_s: float = PERIOD_S) -> None:
        if period_s <= 0:
            raise ValueError(f"period_s must be positive (got {period_s})")
        self.thread_id = thread_id
        self.period_s = period_s
        self._lock = threading.Lock()
        self._wait_s = 0.0
        # the last look that found the thread inside a collective (monotonic; None: none yet),
        # read by the heartbeat thread: a rank's "idle" runs from the later of this and its step
        self.inside_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nonstop-waitclock", daemon=True)
        self._thread.start()

    def take_wait_s(self) -> float:
        """Seconds charged to collectives since the previous call."""
        with self._lock:
            out, self._wait_s = self._wait_s, 0.0
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def look(self, since_s: float, inside: bool) -> None:
        """One look: ``since_s`` seconds after the previous one the thread is ``inside`` a
        collective or not. At most two periods are charged: a look delayed by the training
        thread holding the GIL (Python compute, never a wait: a collective's wait releases it)
        charges no more."""
        if inside:
            with self._lock:
                self._wait_s += min(since_s, 2 * self.period_s)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            inside = in_collective(self.thread_id)
            if inside:
                self.inside_at = now
            self.look(now - last, inside)
            last = now


class CollectiveWaits:
    """The training thread's seconds in collectives, from its model's source: a data-parallel
    model's allreduce, stamped (``sync``), else a :class:`CollectiveClock` sampling ``thread``
    (started here, stopped by :meth:`close`). Main thread only; the heartbeat thread reads
    ``sync`` and ``clock`` (:mod:`nonstop.train.heartbeat`)."""

    def __init__(self, sync: CanonicalGradSync | None, thread: int) -> None:
        self.sync = sync
        self.clock = CollectiveClock(thread) if sync is None else None

    def take_wait_s(self) -> float:
        """Seconds in collectives since the last call."""
        src = self.sync if self.sync is not None else self.clock
        return src.take_wait_s() if src is not None else 0.0

    def close(self) -> None:
        if self.clock is not None:
            self.clock.close()
            self.clock = None
