"""What a worker's heartbeat says about its rank (the heartbeat thread's words, wire.Heartbeat).

Every ``heartbeat_interval_s`` the link's heartbeat thread (:mod:`nonstop.train.link`) sends the
coordinator one message composed here, read-only on the session:

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
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from nonstop.control.channel import Message
from nonstop.train.collectives import in_collective

if TYPE_CHECKING:
    from nonstop.train.ddp import CanonicalGradSync
    from nonstop.train.frwatch import FlightRecorderWatch
    from nonstop.train.threadprogress import ThreadProgress
    from nonstop.train.waitclock import CollectiveClock

__all__ = ["HeartbeatWords"]


class HeartbeatWords:
    """The session's heartbeat message (module docstring); a mixin of
    :class:`~nonstop.train.session.Session`, whose attributes these are."""

    _sync: CanonicalGradSync | None
    _clock: CollectiveClock | None
    _frwatch: FlightRecorderWatch | None
    _last_step_s: float | None
    _train_thread: int | None
    _train_progress: ThreadProgress
    _progress_at: float  # when the rank last completed a step (the training thread writes it)
    _coll_at: float  # when this thread last saw it in a collective (only this thread writes it)
    _step: int

    def _heartbeat_msg(self) -> Message:
        # the sync's allreduce in flight: pending on the host, or on a device (train/liveness.py);
        # any other collective: blocked in torch.distributed's code (the CPU), or started on the
        # device and not completed (the flight recorder, train/frwatch.py)
        own = self._sync is not None and self._sync.in_collective()
        now = time.monotonic()
        since_step = now - self._progress_at
        watch = self._frwatch  # (asked last: its dump is the costly answer)
        coll = (
            own
            or in_collective(self._train_thread)
            or (watch is not None and watch.pending(idle_s=since_step, step_s=self._last_step_s))
        )
        if coll:
            self._coll_at = now
        # idle: out of any collective without completing a step -- what the progress rule blames
        # a rank for (policy.find_hung_ranks). It runs from the later of the last step and the
        # last time the rank was in a collective, so seconds spent waiting there for a slow peer
        # are not counted as this rank's own stall.
        left = (self._sync.left_at if self._sync is not None else None) or (
            self._clock.inside_at if self._clock is not None else None
        )
        idle = round(now - max(self._progress_at, self._coll_at, left or 0.0), 3)
        msg: Message = {"t": "hb", "coll": coll, "step": self._step, "idle": idle}
        if self._train_thread is not None:
            # moving: the training thread ran, or waited for a CPU, since the last heartbeat
            # (slow on a starved machine, not stuck: the detector's longer limit; a thread asleep
            # or blocked does neither)
            moved = self._train_progress.moved()
            if moved is not None:
                msg["moving"] = moved
            frame = sys._current_frames().get(self._train_thread)
            if frame is not None and not coll:  # where it is, for the failure's record if blamed
                where = "/".join(frame.f_code.co_filename.split("/")[-2:])
                msg["at"] = f"{where}:{frame.f_lineno} {frame.f_code.co_name}"
        return msg
