"""Whether a rank is waiting in one of nonstop's own collectives on a device, seen by the heartbeat.

**Why.** The coordinator's no-progress rule blames a rank that makes no step progress unless its
heartbeat says ``coll`` (waiting in a collective: on a peer, not stuck itself). On the CPU (gloo) a
collective's future completes when the collective does, so the training thread is visibly inside
it for as long as it waits (:attr:`~nonstop.train.ddp.CanonicalGradSync.pending_since`, the frame
test of :mod:`nonstop.train.collectives`). On a device (NCCL) a collective is *enqueued*: its
future completes at once, the host runs ahead (optimizer step enqueued too) and later blocks in C
on some unrelated-looking synchronisation (``loss.item()``, a snapshot's copy) -- in the script's
own frames, with no collective pending. Every healthy rank waiting on a stalled peer would then
look stuck and be killed with it.

**How.** Around each collective nonstop itself issues on a device (the canonical DDP gradient
sync: :mod:`nonstop.train.ddp`), two device events are recorded:

* ``ready``, on the issuing stream just before the collective is enqueued: it completes once this
  rank's own work that feeds the collective (backward, the pack into the flat buffer) is done;
* ``done``, on a stream ordered after the collective and the unpack of its result: it completes
  once the collective has.

The heartbeat thread polls them (:meth:`CollectiveWatch.pending`, two ``query()`` calls, never a
wait): the rank is in a collective while ``ready`` is complete and ``done`` is not -- its own part
is finished and it waits on its peers (or the network). A rank whose own kernels are still running
before the collective (``ready`` pending) is *not* in one: a rank stuck on its own device work is
still blamed. On the CPU no event is made (:func:`device_event` returns None) and nothing changes.

The events are behind a tiny :class:`CompletionEvent` protocol (``query() -> bool``) and the watch
takes the factory that makes them, so tests drive it with fake events whose completion they set.

**Limits.** Only collectives nonstop issues are watched here. FSDP2's and tensor parallel's
collectives on NCCL are issued by ``torch.distributed`` and likewise return at enqueue; the frame
test sees a rank only while it is inside ``torch.distributed``'s Python code. Those are read from
torch's flight recorder instead (:mod:`nonstop.train.frwatch`), which sees every collective of
every process group; NCCL's own collective timeout (``NONSTOP_COLLECTIVE_TIMEOUT_S``,
:mod:`nonstop.train.backend`) remains the backstop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["CollectiveWatch", "CompletionEvent", "DeviceEvent", "EventFactory", "device_event"]

log = logging.getLogger(__name__)


class CompletionEvent(Protocol):
    """A marker in a device's work queue."""

    def query(self) -> bool:
        """True once every piece of work queued before the marker has finished. Never blocks."""
        ...


EventFactory = Callable[[torch.device], "CompletionEvent | None"]


class DeviceEvent:
    """A ``torch.Event`` recorded now on ``device``'s current stream (the stream of the calling
    thread: autograd's device thread for a comm hook, the callback's stream in a future's
    ``then``)."""

    def __init__(self, device: torch.device) -> None:
        self._index = device.index
        self._event = torch.Event(device=device)
        self._event.record(torch.accelerator.current_stream(device))

    def query(self) -> bool:
        # The heartbeat thread's current device is 0 unless set: query under the event's own
        # device, so no thread ever creates a context on a device that is not this rank's.
        with torch.accelerator.device_index(self._index):
            return bool(self._event.query())


def device_event(device: torch.device) -> CompletionEvent | None:
    """The default factory: a :class:`DeviceEvent` on a device, None on the CPU (a CPU collective
    completes before the host returns from it: ``pending_since`` says when it is in one)."""
    if device.type == "cpu":
        return None
    return DeviceEvent(device)


class CollectiveWatch:
    """The events around the newest collective nonstop issued on a device (module docstring).

    Writers (the thread issuing the collective: :meth:`before`, :meth:`after`, :meth:`clear`) and
    the reader (the heartbeat thread: :meth:`pending`) share one attribute, assigned whole: a
    ``(ready, done)`` pair or None. ``make_event``: the factory (tests pass fakes)."""

    def __init__(self, make_event: EventFactory = device_event) -> None:
        self._make = make_event
        self._ready: CompletionEvent | None = None  # writer side only, until after() publishes it
        self._pair: tuple[CompletionEvent | None, CompletionEvent] | None = None
        self._warned = False

    def before(self, device: torch.device) -> None:
        """Call on the issuing stream right before a collective on ``device`` is enqueued."""
        self._ready = self._make(device)

    def after(self, device: torch.device) -> None:
        """Call on a stream ordered after the collective (and after what consumes its result):
        from here the heartbeat sees the rank in a collective until the event is reached."""
        done = self._make(device)
        if done is not None:
            self._pair = (self._ready, done)
        self._ready = None

    def clear(self) -> None:
        """Forget the events (a new generation: an aborted group's must not count)."""
        self._pair = None
        self._ready = None

    def pending(self) -> bool:
        """True while the newest collective's own inputs are ready and the collective is not done:
        the rank waits on its peers. False on the CPU, before any collective, and when the device
        cannot answer (an error is logged once: a broken device is no reason to protect a rank)."""
        pair = self._pair
        if pair is None:
            return False
        ready, done = pair
        try:
            return not done.query() and (ready is None or ready.query())
        except Exception as e:  # a device error must not stop the heartbeat thread
            if not self._warned:
                self._warned = True
                log.warning("collective liveness: device event query failed (%s); not in a collective", e)
            return False
