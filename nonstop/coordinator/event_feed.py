"""The coordinator's side of the event hook (``Session.on_event``): the job's events, forwarded to
the worker processes that asked for them over their control channel.

A worker subscribes with ``subscribe {kinds}`` (``kinds``: the event kinds it wants, or null for
all); the subscription belongs to that process (its spawn id) and ends with its channel. A worker
that reconnects to a restarted coordinator (store mode) subscribes again, so a subscription
survives coordinator restarts; events logged while no coordinator ran are not replayed.

Each event is sent as ``event {event: LINE}`` (``LINE``: the log line, ``Event.to_json()``), in
the order the log got them. Besides the log's events the feed sends ``committed`` (a
:class:`~nonstop.events.hook.Committed`) when the committed step moved, at most once per
``committed_every_s``.

Threading: :meth:`EventFeed.on_event` runs on whichever thread logs the event (an
:class:`~nonstop.events.log.EventLog` subscriber: the coordinator's loop, persisters'
threads) and only appends to a bounded queue; :meth:`subscribe` and :meth:`tick` run on the
coordinator's thread. One sender thread (``nonstop-event-feed``, started by the first
subscription) does the sends, so a subscriber that reads slowly, or a process stopped mid-read,
never holds the coordinator: the queue fills and further events are dropped and counted
(:attr:`dropped`). A send that fails ends that subscription.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from nonstop import events as ev
from nonstop.control.channel import Message
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.errors import ControlError
from nonstop.events.hook import Committed
from nonstop.protocol.worker import EventMsg

__all__ = ["EventFeed"]

log = logging.getLogger(__name__)


class _Sender(Protocol):
    """What the feed sends on: a worker's control channel."""

    @property
    def closed(self) -> bool: ...

    def send(self, msg: Message) -> None: ...


@dataclass(frozen=True)
class _Subscription:
    chan: _Sender
    kinds: frozenset[str] | None  # None: every kind

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds


class EventFeed:
    """Forwards events to subscribed workers (see the module docstring). ``max_pending``: events
    queued for the sender thread at most; ``committed_every_s``: the least time between two
    ``committed`` events; ``clock``: what that interval and those events' times are read through
    (:mod:`.clock`; tests give a fake one). :meth:`flush` waits on the real clock (a wait for the
    sender thread)."""

    def __init__(
        self,
        *,
        max_pending: int = 4096,
        committed_every_s: float = 1.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.max_pending = max_pending
        self.committed_every_s = committed_every_s
        self.clock = clock
        self._subs: dict[int, _Subscription] = {}  # spawn id -> its subscription
        self._queue: collections.deque[tuple[int, _Subscription, Message]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._sending = False
        self._last_committed: tuple[int, int] | None = None  # (step, generation) last sent
        self._committed_at = float("-inf")
        self.dropped = 0  # events not sent because the queue was full
        self.sent = 0

    @property
    def subscribers(self) -> tuple[int, ...]:
        """The spawn ids subscribed now."""
        return tuple(self._subs)

    # -- the coordinator's thread ------------------------------------------------------------
    def subscribe(self, spawn_id: int, chan: _Sender, kinds: Iterable[str] | None) -> None:
        """Send ``spawn_id``'s process (on ``chan``) the events of ``kinds`` (None: all) from now on;
        replaces its earlier subscription (a reconnect's, on its new channel)."""
        sub = _Subscription(chan, None if kinds is None else frozenset(kinds))
        with self._cv:  # copy on write: on_event reads the dict without the lock
            self._subs = {**self._subs, spawn_id: sub}
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="nonstop-event-feed", daemon=True)
            self._thread.start()

    def unsubscribe(self, spawn_id: int, sub: _Subscription | None = None) -> None:
        """End ``spawn_id``'s subscription (only if it is still ``sub``, when given)."""
        with self._cv:
            if spawn_id in self._subs and (sub is None or self._subs[spawn_id] is sub):
                self._subs = {k: v for k, v in self._subs.items() if k != spawn_id}

    def tick(self, *, committed: int, generation: int, world_size: int) -> None:
        """The committed step now: a ``committed`` event when it moved and the interval passed."""
        if not self._subs or (committed, generation) == self._last_committed:
            return
        now = self.clock.monotonic()
        if now - self._committed_at < self.committed_every_s:
            return
        self._committed_at, self._last_committed = now, (committed, generation)
        self.on_event(
            Committed(ts=self.clock.wall(), step=committed, generation=generation, world_size=world_size)
        )

    # -- any thread --------------------------------------------------------------------------
    def on_event(self, event: ev.Event) -> None:
        """Queue ``event`` for every subscriber that wants its kind (an EventLog subscriber: never
        blocks, never raises)."""
        subs = self._subs  # read once: replaced whole on change
        if not subs:
            return
        line: Message = EventMsg(event=event.to_json()).encode()
        with self._cv:
            for sid, sub in subs.items():
                if not sub.wants(event.event):
                    continue
                if len(self._queue) >= self.max_pending:
                    self.dropped += 1
                    if self.dropped in (1, 100, 10_000):
                        log.warning(
                            "event feed: %d event(s) dropped (subscribers read too slowly)", self.dropped
                        )
                    continue
                self._queue.append((sid, sub, line))
            self._cv.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every queued event was sent (or dropped); whether it was."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then stop the sender thread."""
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    # -- the sender thread -------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                self._sending = False
                self._cv.notify_all()
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                sid, sub, msg = self._queue.popleft()
                self._sending = True
            if self._subs.get(sid) is not sub:
                continue  # unsubscribed, or subscribed again on another channel
            try:
                if sub.chan.closed:
                    raise ControlError("closed")
                sub.chan.send(msg)
                self.sent += 1
            except (ControlError, OSError):
                self.unsubscribe(sid, sub)  # its process is gone; a new one subscribes anew
