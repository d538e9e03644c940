"""Settling a sharded job's mesh groups after a failure, so survivors keep the untouched ones.

On a recovery, a survivor found in a step severs only its mesh groups that contain a lost rank
(:meth:`~nonstop.train.meshgroups.MeshGroups.sever` with ``lost``; the default group always
goes). The groups left open may still hold it: its main thread can be blocked in a collective on
one of them that a live peer will never join, because that peer left its step on a severed
group first. gloo cannot cancel the wait, and the peer, parked at the next generation's
agreement, sends no FIN. So each survivor, once its main thread has left the step, *posts* the
final sequence number of every group it left open (:func:`post`), and a watcher thread on each
survivor still in a step (:class:`Settling`) reads its peers' posts: a group on which this rank
has issued a collective that a peer, gone from its step, never issued (:func:`verdict`) is
severed at once. The chain unwinds one post at a time: each rank freed posts in turn. Whatever is
still in a step after :data:`SETTLE_S` has every open group severed (today's behaviour: all built
again). The next generation's agreement (:func:`~nonstop.train.meshgroups.agree`) keeps a group
only when its members' sequence numbers are equal, so what is kept has no collective waiting on
anyone.

Posts go through the new generation's rendezvous keys (the coordinator's, fenced by generation):
``nonstop/settle/<group token>/<position>`` holds ``seq + 1`` (``add``: a read of a key not yet
posted returns 0 without waiting).

Threading: :class:`Settling` runs one daemon thread; :func:`post` is called by the main thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nonstop.protocol.worker import LeaveMsg, ReconfigureMsg
from nonstop.train.meshgroups import GroupClaim, OpenGroup

__all__ = ["SETTLE_S", "Settling", "Verdict", "lost_ranks", "post", "verdict"]

log = logging.getLogger(__name__)

SETTLE_S = 3.0  # a survivor still in its step this long after the recovery severs every group
POLL_S = 0.01


class Verdict(enum.Enum):
    SEVER = "sever"  # this rank issued a collective a peer, gone from its step, never issued
    MATCHED = "matched"  # every peer posted, and issued all this rank issued: nothing waits here
    WAIT = "wait"  # some peer is still in its step


def verdict(own: int, posted: Sequence[int | None]) -> Verdict:
    """``own``: this rank's sequence number on a group; ``posted``: each other member's final
    one (None: not posted yet). Pure."""
    if any(p is not None and p < own for p in posted):
        return Verdict.SEVER
    if all(p is not None for p in posted):
        return Verdict.MATCHED
    return Verdict.WAIT


def lost_ranks(order: ReconfigureMsg | LeaveMsg) -> list[int] | None:
    """The ranks a recovery's reconfigure (or a failure's leave) says failed (in the numbering of
    the generation the survivors are in), or None: not a recovery that names them (sever
    everything)."""
    if not order.recovery or order.lost is None:
        return None
    return list(order.lost)


def _key(token: str, position: int) -> str:
    return f"nonstop/settle/{token}/{position}"


def post(store: Any, claims: Sequence[GroupClaim]) -> None:
    """Main thread, the step left: post this rank's final sequence number on each group it
    parked open, for peers still blocked on one (a failed post only costs them the timeout)."""
    for c in claims:
        store.add(_key(c.token, c.group_rank), c.seq + 1)


class Settling:
    """One recovery's watcher on one survivor: sever each open group that a peer's post shows
    can no longer complete, while ``in_step()``; all of them after ``limit_s``. ``severed``: the
    dims it severed, and why, for the log and the tests."""

    def __init__(
        self,
        store: Any,
        groups: Sequence[OpenGroup],
        in_step: Callable[[], bool],
        *,
        limit_s: float = SETTLE_S,
        poll_s: float = POLL_S,
    ) -> None:
        self._store = store
        self._groups = list(groups)
        self._in_step = in_step
        self._limit_s = limit_s
        self._poll_s = poll_s
        self.severed: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, name="nonstop-settle", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        deadline = time.monotonic() + self._limit_s
        try:
            while self._groups and self._in_step():
                if time.monotonic() > deadline:
                    self._sever_all(f"still in the step {self._limit_s:.0f} s after the recovery")
                    return
                for g in list(self._groups):
                    own = g.seq()
                    posted = [self._read(g, p) for p in range(g.size) if p != g.position]
                    if verdict(own, posted) is Verdict.SEVER:
                        low = min(p for p in posted if p is not None)
                        self._sever(g, f"a peer left it at sequence {low}, this rank is at {own}")
                time.sleep(self._poll_s)
        except Exception as e:  # the store is gone (a newer generation): keep nothing uncertain
            if self._in_step():
                self._sever_all(f"settling failed: {e}")

    def _read(self, g: OpenGroup, position: int) -> int | None:
        value = int(self._store.add(_key(g.token, position), 0))
        return value - 1 if value else None

    def _sever(self, g: OpenGroup, why: str) -> None:
        log.info("severing the %s group: %s", g.dim, why)
        g.sever()
        self.severed[g.dim] = why
        self._groups.remove(g)

    def _sever_all(self, why: str) -> None:
        for g in list(self._groups):
            self._sever(g, why)
