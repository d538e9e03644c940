"""What a worker's heartbeat says about its rank (the heartbeat thread's words, wire.Heartbeat).

Every ``heartbeat_interval_s`` the link's heartbeat thread (:mod:`nonstop.train.link`) sends the
coordinator one message composed by :meth:`HeartbeatWords.message`:

* ``coll``: the rank is in a collective -- nonstop's gradient allreduce in flight (on the host, or
  on a device: :mod:`nonstop.train.liveness`), any other collective blocked in
  ``torch.distributed``'s code (:func:`~nonstop.train.collectives.in_collective`), or started on a
  device and not completed (the flight recorder, :mod:`nonstop.train.frwatch`);
* ``idle``: seconds out of any collective without completing a step, from the later of its last
  step and the last moment it was in a collective -- exactly where the session can tell (the
  allreduce's return, :attr:`~nonstop.train.ddp.CanonicalGradSync.left_at`; the sampler of a
  sharded model's waits, :attr:`~nonstop.train.waitclock.CollectiveClock.inside_at`), else as
  this thread saw it. The progress rule blames a rank only on this word
  (:func:`nonstop.policy.decisions.find_hung_ranks`): a rank that waited seconds for a slow peer
  is not stuck in its own code when it leaves the collective;
* ``moving``: its training thread ran or waited for a CPU since the last heartbeat
  (:mod:`nonstop.train.threadprogress`): slow on a starved machine, not stuck;
* ``at``: where the training thread is while out of a collective (for a blamed rank's record).

Threading contract: :meth:`HeartbeatWords.message` runs on the heartbeat thread and is the only
writer of what it saw last (``coll``'s time); the training thread tells it of progress
(:meth:`~HeartbeatWords.stepped`, :meth:`~HeartbeatWords.progressed`) and names itself and its
collectives (:meth:`~HeartbeatWords.watch_thread`, :meth:`~HeartbeatWords.watch_collectives`);
the step number is read from the loop's :class:`~nonstop.train.position.Position`. Plain
attribute writes: the heartbeat reads whichever value is current, as it read the session's.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from nonstop.protocol.worker import HeartbeatMsg
from nonstop.train.collectives import in_collective
from nonstop.train.threadprogress import ThreadProgress

if TYPE_CHECKING:
    from nonstop.train.ddp import CanonicalGradSync
    from nonstop.train.frwatch import FlightRecorderWatch
    from nonstop.train.position import Position
    from nonstop.train.waitclock import CollectiveClock

__all__ = ["HeartbeatWords"]


class HeartbeatWords:
    """The words of one worker's heartbeat (module docstring). ``position``: where the training
        loop is (its step); until :meth:`watch_thread` names the training thread, the
        heartbeat says only ``coll``, ``step`` and ``idle``; until :meth:`watch_collectives`, ``coll``
    is what ``torch.distributed``'s code on that thread shows."""

    def __init__(self, position: Position) -> None:
        self._position = position
        self.sync: CanonicalGradSync | None = None  # a DDP model's allreduce (train/ddp.py)
        self.clock: CollectiveClock | None = None  # a sharded model's waits (train/waitclock.py)
        self.frwatch: FlightRecorderWatch | None = None  # any collective's wait on a GPU (frwatch.py)
        self.thread: int | None = None  # the training thread: its collectives and frames are watched
        self.thread_progress = ThreadProgress()  # its CPU and run-queue clocks
        self.progress_at = time.monotonic()  # when the rank last completed a step (training thread)
        self.last_step_s: float | None = None  # how long the last completed step took
        self._coll_at = 0.0  # when this thread last saw it in a collective (only this thread writes)

    def watch_thread(self, thread: int, progress: ThreadProgress) -> None:
        """The training loop runs on ``thread`` (its clocks: ``progress``): say from now on
        whether it moves and where it is."""
        self.thread, self.thread_progress = thread, progress

    def watch_collectives(
        self,
        *,
        sync: CanonicalGradSync | None,
        clock: CollectiveClock | None,
        frwatch: FlightRecorderWatch | None,
    ) -> None:
        """The model's collectives: a DDP model's allreduce (``sync``), the sampler of a sharded
        model's waits (``clock``), the flight recorder's view of a GPU's (``frwatch``)."""
        self.sync, self.clock, self.frwatch = sync, clock, frwatch

    def progressed(self, at: float | None = None) -> None:
        """The rank made progress (a generation joined, the loop started) at ``at`` (now)."""
        self.progress_at = time.monotonic() if at is None else at

    def stepped(self, at: float, step_s: float) -> None:
        """A step that took ``step_s`` completed at ``at`` (monotonic)."""
        self.progress_at, self.last_step_s = at, step_s

    def message(self) -> HeartbeatMsg:
        """The heartbeat to send now (the heartbeat thread's)."""
        sync, clock = self.sync, self.clock
        # the sync's allreduce in flight: pending on the host, or on a device (train/liveness.py);
        # any other collective: blocked in torch.distributed's code (the CPU), or started on the
        # device and not completed (the flight recorder, train/frwatch.py)
        own = sync is not None and sync.in_collective()
        now = time.monotonic()
        since_step = now - self.progress_at
        watch = self.frwatch  # (asked last: its dump is the costly answer)
        coll = (
            own
            or in_collective(self.thread)
            or (watch is not None and watch.pending(idle_s=since_step, step_s=self.last_step_s))
        )
        if coll:
            self._coll_at = now
        # idle: out of any collective without completing a step -- what the progress rule blames
        # a rank for (policy.find_hung_ranks). It runs from the later of the last step and the
        # last time the rank was in a collective, so seconds spent waiting there for a slow peer
        # are not counted as this rank's own stall.
        left = (sync.left_at if sync is not None else None) or (
            clock.inside_at if clock is not None else None
        )
        idle = round(now - max(self.progress_at, self._coll_at, left or 0.0), 3)
        moved: bool | None = None
        at: str | None = None
        if self.thread is not None:
            # moving: the training thread ran, or waited for a CPU, since the last heartbeat
            # (slow on a starved machine, not stuck: the detector's longer limit; a thread asleep
            # or blocked does neither)
            moved = self.thread_progress.moved()
            frame = sys._current_frames().get(self.thread)
            if frame is not None and not coll:  # where it is, for the failure's record if blamed
                where = "/".join(frame.f_code.co_filename.split("/")[-2:])
                at = f"{where}:{frame.f_lineno} {frame.f_code.co_name}"
        return HeartbeatMsg(coll=coll, step=self._position.step, idle_s=idle, moving=moved, at=at)
