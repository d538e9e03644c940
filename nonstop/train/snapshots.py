"""A rank's snapshot slots as its training loop uses them.

:class:`LoopSnapshots` holds the rank's open :class:`~nonstop.snapshot.RankSnapshotStore`
(reopened under a new rank number when an elastic resize renumbers the rank), takes each step's
snapshot in the job's mode, fences the overlapped copy before the next optimizer step, and adds
up what the loop waited on that fence, for the step's reported stall.

Threading contract: main thread only (the training loop's); the store's background copy is the
store's own business.
"""

from __future__ import annotations

from nonstop.config import WorkerEnv
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.snapshot.store import PendingWrite
from nonstop.train.restore import open_store

__all__ = ["LoopSnapshots"]


class LoopSnapshots:
    """The rank's snapshot store while ``Session.run`` trains (see the module docstring)."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self._store: RankSnapshotStore | None = None
        self._fence_wait_s = 0.0

    def open(self, rank: int) -> None:
        """Open the slots of ``rank``, closing the ones open under another number."""
        if self._store is not None:
            self._store.close()
        self._store = open_store(self._env, rank)

    @property
    def live(self) -> RankSnapshotStore:
        assert self._store is not None, "Session.run() has not started"
        return self._store

    def take(self, step: int, capture: StateCapture) -> PendingWrite | None:
        """Snapshot the state after ``step`` steps per the job's snapshot mode."""
        mode = self._env.snapshot
        if mode == "off":  # only for measuring what snapshots cost; nothing to recover from
            return None
        deferred = capture.deferrable() if mode == "overlapped" else None
        return self.live.begin(step, capture.state(step), deferred=deferred)

    def fence(self) -> None:
        """Hold the optimizer back until the previous step's overlapped copy is done with the
        state: on the CPU a host wait; with device tensors each device's current stream waits for
        that device's copies, and the host only for CPU-resident ones still copying
        (:meth:`~nonstop.snapshot.pending.PendingWrite.fence`)."""
        pending = self.live.pending
        if pending is not None:
            before = pending.waited_s
            pending.fence()
            self._fence_wait_s += pending.waited_s - before

    def waited_s(self) -> float:
        """Seconds the loop waited on fences since the last call."""
        out, self._fence_wait_s = self._fence_wait_s, 0.0
        return out
