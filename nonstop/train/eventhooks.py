"""The worker's side of the event hook: :meth:`Session.on_event <nonstop.train.session.Session.on_event>`.

A training script hands a callback (a logger's: :mod:`nonstop.loggers`) the job's events -- the
lines the coordinator writes to ``events.jsonl`` (failures, recoveries with their MTTR and
stages, generations, shrinks and grows, migrations, persists ...) as typed
:class:`~nonstop.events.Event` objects, plus ``committed``
(:class:`~nonstop.events.hook.Committed`) when the committed step moves. Only a process
that subscribed receives them (typically rank 0's); they come over its authenticated control
channel (:mod:`nonstop.coordinator.event_feed` sends them).

Delivery contract (:class:`EventHooks`):

* The link's reader thread hands each event to :meth:`EventHooks.put`, which only appends it to a
  bounded queue (``max_pending``): when it is full the **oldest** event is dropped and counted
  (:attr:`EventHooks.dropped`; the coordinator's side drops and counts too). Nothing here ever
  blocks the training step or the control channel.
* ``deliver="thread"`` (the default): one thread (``nonstop-events``) calls the callbacks, in the
  order the events came, one event at a time. A slow callback delays only later events.
  ``deliver="step"``: the training loop calls them on its own thread between two steps
  (:meth:`EventHooks.deliver_pending`), for a logger that is not thread-safe or that must log
  in step with the script; a slow callback then costs training time.
* A callback that raises is logged (the first few times) and delivery goes on.
* At the end of :meth:`Session.run` the queue is flushed for up to :data:`FLUSH_S` seconds; events the
  coordinator logs after it released the workers (``job_done``, ``job_end``) never arrive.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from nonstop import events as ev
from nonstop.errors import UsageError
from nonstop.events import hook as _hook  # noqa: F401  (registers the hook's kinds)
from nonstop.protocol.worker import EventMsg

__all__ = ["DELIVERY", "FLUSH_S", "EventCallback", "EventHooks"]

log = logging.getLogger(__name__)

EventCallback = Callable[[ev.Event], Any]
DELIVERY = ("thread", "step")
FLUSH_S = 2.0  # how long Session.run waits at the end for the callbacks to take what is queued


@dataclass(frozen=True)
class _Hook:
    callback: EventCallback
    kinds: frozenset[str] | None


class EventHooks:
    """The callbacks of one worker process and the events waiting for them (see the module
    docstring). :meth:`add` on the main thread; :meth:`put` from the link's reader thread."""

    def __init__(self) -> None:
        self._hooks: tuple[_Hook, ...] = ()
        self._queue: collections.deque[EventMsg] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False
        self.deliver: str | None = None
        self.max_pending = 1024
        self.dropped = 0  # events dropped because the queue was full
        self.delivered = 0  # events handed to the callbacks
        self._errors = 0

    @property
    def active(self) -> bool:
        return bool(self._hooks)

    def add(
        self, callback: EventCallback, *, kinds: Iterable[str] | None, deliver: str, max_pending: int
    ) -> list[str] | None:
        """Register ``callback`` for ``kinds`` (None: all); return the kinds to subscribe to (the
        union over every callback; None: all). Every callback of a process shares one delivery
        mode and queue: a second ``deliver`` different from the first is a :class:`UsageError`."""
        if not callable(callback):
            raise UsageError("Session.on_event: give a callable, called with each event")
        if deliver not in DELIVERY:
            raise UsageError(
                f"Session.on_event: deliver must be one of {', '.join(DELIVERY)}, not {deliver!r}"
            )
        if max_pending < 1:
            raise UsageError("Session.on_event: max_pending must be at least 1")
        if self.deliver is not None and deliver != self.deliver:
            raise UsageError(f"Session.on_event: this process delivers events by {self.deliver!r} already")
        wanted = None if kinds is None else frozenset([kinds] if isinstance(kinds, str) else kinds)
        with self._cv:
            self.max_pending = max(max_pending, self.max_pending) if self._hooks else max_pending
            self.deliver = deliver
            self._hooks = (*self._hooks, _Hook(callback, wanted))
        if deliver == "thread" and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nonstop-events", daemon=True)
            self._thread.start()
        if any(h.kinds is None for h in self._hooks):
            return None
        return sorted(set().union(*(h.kinds or () for h in self._hooks)))

    # -- the reader thread -------------------------------------------------------------------
    def put(self, msg: EventMsg) -> None:
        """Queue one ``event`` message; drops the oldest when the queue is full. Never blocks."""
        with self._cv:
            if len(self._queue) >= self.max_pending:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped in (1, 100, 10_000):
                    log.warning("%d nonstop event(s) dropped: the event callbacks are too slow", self.dropped)
            self._queue.append(msg)
            self._cv.notify_all()

    # -- delivery ----------------------------------------------------------------------------
    def deliver_pending(self) -> int:
        """``deliver="step"``: call the callbacks with every queued event, on this thread; how
        many events were delivered. A no-op in thread mode."""
        if self.deliver != "step":
            return 0
        n = 0
        while True:
            with self._cv:
                if not self._queue:
                    return n
                msg = self._queue.popleft()
            self._call(msg)
            n += 1

    def flush(self, timeout_s: float) -> bool:
        """Deliver what is queued (step mode: now, on this thread; thread mode: wait for the
        thread up to ``timeout_s``); whether the queue is empty."""
        self.deliver_pending()
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cv.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
                while not self._queue:
                    self._cv.wait()
                msg = self._queue.popleft()
                self._busy = True
            self._call(msg)

    def _call(self, msg: EventMsg) -> None:
        event = ev.decode(dict(msg.event))
        for hook in self._hooks:
            if hook.kinds is not None and event.event not in hook.kinds:
                continue
            try:
                hook.callback(event)
            except Exception:
                self._errors += 1
                if self._errors <= 3:
                    log.exception("an event callback raised (on %s); delivery goes on", event.event)
        self.delivered += 1
