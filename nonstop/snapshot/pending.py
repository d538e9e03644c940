"""A snapshot write in flight, and the background copier that finishes it.

:class:`PendingWrite` is what :meth:`~nonstop.snapshot.store.RankSnapshotStore.begin` returns:
the handle on a snapshot whose bulk (the *deferred* tensors: parameters and optimizer state)
may still be copying. :class:`Copier` is the store's one background thread that does those
copies in order, and on CUDA issues the device-to-host copies on a side stream per device
(:mod:`nonstop.snapshot.device`).

Threading contract: a store owns one :class:`Copier`; only the store's caller thread submits
to it. Jobs run one at a time, in submission order, on the copier's thread; each job's
``complete`` (the COMPLETE header write) runs there after its copies, then the write's
completion callbacks, then whoever ``wait()``-s is released. With device copies, a job's
deferred device copies are issued first, paced (:class:`~nonstop.snapshot.device.DeviceCopies`),
then its host (CPU-resident) copies run, then every device's event is synchronized: the slot is
COMPLETE only once every device's copies have landed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from nonstop.errors import SnapshotError
from nonstop.snapshot.device import (
    COPIES_IN_FLIGHT,
    DEVICE_COPY_CHUNK,
    DeviceCopies,
    Pairs,
    SideStreams,
    fence_streams,
)

log = logging.getLogger(__name__)

__all__ = ["Copier", "CopyJob", "PendingWrite"]


class PendingWrite:
    """A snapshot whose bulk copy may still be running (see :meth:`RankSnapshotStore.begin`).

    ``fence()`` must be called before anything changes the deferred tensors (the
    optimizer step); ``wait()`` before the state is restored or the store closed.
    Both are idempotent and cheap once the write is complete.
    """

    def __init__(self, step: int, nbytes: int) -> None:
        self.step = step
        self.nbytes = nbytes
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._error: BaseException | None = None
        # the write's device copies (None: none), their events once issued
        self._device_copies: DeviceCopies | None = None
        self._issued = threading.Event()  # every device copy is issued (or the write failed)
        self._host_copied = threading.Event()  # the copier's host copies are done (or failed)
        self.waited_s = 0.0  # host time callers spent blocked on this write
        self.begun_at = time.perf_counter()
        self.picked_up_s: float | None = None  # from begin until the copier took the write up

    def timeline(self) -> dict[str, float] | None:
        """Where a paced write's device copies spent their time, for a step that waited on the
        fence (None: no device copies issued by the copier): ``picked_up_s`` from ``begin`` to
        the copier thread taking the write up, ``issue_s`` the issue of every batch
        (``batches`` of them), ``landing_s`` the part of it waiting for the oldest batch to
        land. None until every batch is issued. A GIL-starved copier shows ``issue_s`` far above
        ``landing_s``; a late one, a large ``picked_up_s``; a busy copy engine, ``landing_s``
        near ``issue_s``."""
        copies = self._device_copies
        if copies is None or self.picked_up_s is None or not copies.batches or not self._issued.is_set():
            return None
        return {
            "picked_up_s": self.picked_up_s,
            "batches": float(copies.batches),
            "issue_s": copies.issue_s,
            "landing_s": copies.landing_s,
        }

    def done(self) -> bool:
        return self._done.is_set()

    def on_complete(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the snapshot is COMPLETE (now, if it already is); not on failure.
        It runs on the copier thread, before ``wait()`` returns to anyone."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        if self._error is None:
            fn()

    def _finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            callbacks, self._callbacks = self._callbacks, []
        self._host_copied.set()
        self._issued.set()
        if error is None:
            for fn in callbacks:
                try:
                    fn()
                except Exception:  # a callback must not lose the snapshot
                    log.exception("snapshot completion callback failed")
        self._done.set()

    def _block(self, event: threading.Event) -> None:
        if not event.is_set():
            t0 = time.monotonic()
            event.wait()
            self.waited_s += time.monotonic() - t0

    def wait(self) -> None:
        """Block until the snapshot is COMPLETE in its slot; re-raise a copy failure."""
        self._block(self._done)
        if self._error is not None:
            raise SnapshotError(f"snapshot of step {self.step} failed: {self._error}") from self._error

    def fence(self) -> None:
        """Make later changes to the deferred tensors wait for their copy.

        CPU: blocks until the copy is done. With device copies: the host waits until the copier
        has issued the last of them (paced copies: the tail of the snapshot's copy), then each
        device's current stream waits for that device's copies (a device-side wait), and the host
        for the copier's CPU-resident deferred copies (usually none: small ones were copied by
        ``begin``). A failed copy is not raised here (``wait()`` raises it)."""
        copies = self._device_copies
        if copies is not None and not self._done.is_set():
            self._block(self._issued)
            fence_streams(copies.events)
            self._block(self._host_copied)
            return
        self.wait()


CopyJob = tuple[Pairs, Callable[[], None], PendingWrite]
"""(host destination/source tensor pairs to copy, the call that marks the slot COMPLETE, its write)."""


class Copier:
    """The background copy thread of one rank's store (started on the first job) and its side
    streams, one per device (created on the first device copy)."""

    def __init__(
        self, rank: int, *, device_chunk: int = DEVICE_COPY_CHUNK, device_depth: int = COPIES_IN_FLIGHT
    ) -> None:
        self.rank = rank
        self.device_chunk = device_chunk  # 0: a write's device copies all issued by begin
        self.device_depth = device_depth  # batches a device has queued at most
        self._jobs: queue.Queue[CopyJob | None] | None = None
        self._thread: threading.Thread | None = None
        self._streams = SideStreams()

    def start_device_copies(self, now: Pairs, later: Pairs) -> DeviceCopies:
        """Issue device-to-host copies on each source device's side stream, ordered after that
        device's current stream's work (:meth:`.device.SideStreams.start`). Each device's current
        stream waits for its ``now`` copies at once (the next forward may change those tensors);
        the ``later`` ones are left to this copier's thread, paced (unless ``device_chunk`` is 0).
        The events of the result (one per device, once issued) mark the end of all its copies,
        for :meth:`PendingWrite.fence` and for the COMPLETE header."""
        return self._streams.start(now, later, chunk=self.device_chunk)

    def submit(self, job: CopyJob) -> None:
        if self._thread is None:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._loop, name=f"nonstop-snap-r{self.rank}", daemon=True)
            self._thread.start()
        assert self._jobs is not None
        self._jobs.put(job)

    def _loop(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, complete, pending = job
            pending.picked_up_s = time.perf_counter() - pending.begun_at
            try:
                copies = pending._device_copies
                if copies is not None:  # first: the fence and the device wait for these
                    copies.issue(self.device_chunk, self.device_depth)  # (none left: begin issued all)
                    pending._issued.set()
                self._copy_pairs(pairs)
                pending._host_copied.set()
                if copies is not None:
                    for event in copies.events.values():
                        event.synchronize()
                complete()
            except BaseException as e:  # reported to whoever waits on the write
                pending._finish(e)
            else:
                pending._finish()

    @staticmethod
    def _copy_pairs(pairs: Pairs) -> None:
        for dst, t in pairs:
            dst.copy_(t)

    def close(self) -> None:
        """Finish the jobs submitted and stop the thread (a later submit starts a new one)."""
        if self._jobs is not None:
            self._jobs.put(None)
            assert self._thread is not None
            self._thread.join()
            self._jobs, self._thread = None, None
