"""Where a rank is in its job: the generation it plays, the step it is at, whether it is done.

One :class:`Position` per worker, held by :class:`~nonstop.train.session.Session` and given to the
collaborators that move it (:class:`~nonstop.train.rejoin.Rejoin`: a restore sets the step, a
reconfigure the generation) or report it (:class:`~nonstop.train.heartbeat.HeartbeatWords`; the
resume point a reconnecting link sends, :mod:`nonstop.train.link`).

Threading contract: the main thread (the training loop's) alone writes it; the link's heartbeat
and reader threads read it (each field is one attribute: a reader sees the old value or the new).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Position"]


@dataclass
class Position:
    """``generation``: the generation this rank plays (0 until its first); ``step``: the number
    of steps its state has completed (the next step's index); ``done``: it reported its last
    step (a restarted coordinator asks)."""

    generation: int = 0
    step: int = 0
    done: bool = False
