"""A snapshot write in flight, and the background copier that finishes it.

:class:`PendingWrite` is what :meth:`~nonstop.snapshot.store.RankSnapshotStore.begin` returns:
the handle on a snapshot whose bulk (the *deferred* tensors: parameters and optimizer state)
may still be copying. :class:`Copier` is the store's one background thread that does those
copies in order, and on CUDA issues the device-to-host copies on a side stream.

Threading contract: a store owns one :class:`Copier`; only the store's caller thread submits
to it. Jobs run one at a time, in submission order, on the copier's thread; each job's
``complete`` (the COMPLETE header write) runs there after its copies, then the write's
completion callbacks, then whoever ``wait()``-s is released.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nonstop.errors import SnapshotError

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
        self._cuda_event: Any = None  # torch.cuda.Event recorded after the device copies
        self.waited_s = 0.0  # host time callers spent blocked on this write

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
        if error is None:
            for fn in callbacks:
                try:
                    fn()
                except Exception:  # a callback must not lose the snapshot
                    log.exception("snapshot completion callback failed")
        self._done.set()

    def wait(self) -> None:
        """Block until the snapshot is COMPLETE in its slot; re-raise a copy failure."""
        if not self._done.is_set():
            t0 = time.monotonic()
            self._done.wait()
            self.waited_s += time.monotonic() - t0
        if self._error is not None:
            raise SnapshotError(f"snapshot of step {self.step} failed: {self._error}") from self._error

    def fence(self) -> None:
        """Make later changes to the deferred tensors wait for their copy.

        CPU: blocks until the copy is done. CUDA: makes the current stream wait
        for the side stream's copies (no host wait)."""
        if self._cuda_event is not None and not self._done.is_set():
            torch.cuda.current_stream().wait_event(self._cuda_event)
            return
        self.wait()


CopyJob = tuple[list[tuple[torch.Tensor, torch.Tensor]], Callable[[], None], PendingWrite]
"""(destination/source tensor pairs to copy, the call that marks the slot COMPLETE, its write)."""


class Copier:
    """The background copy thread of one rank's store (started on the first job) and its CUDA
    side stream (created on the first device copy)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._jobs: queue.Queue[CopyJob | None] | None = None
        self._thread: threading.Thread | None = None
        self._side_stream: Any = None

    def start_device_copies(
        self, now: list[tuple[torch.Tensor, torch.Tensor]], later: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Any:
        """Issue device-to-host copies on a side stream, ordered after the current stream's
        work. The current stream waits for the ``now`` copies at once (a device-side
        dependency: the next forward may change those tensors); the returned event marks
        the end of all copies, for :meth:`PendingWrite.fence`."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side = self._side_stream
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for dst, t in now:
                dst.copy_(t, non_blocking=True)
            volatile_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            volatile_done.record(side)
            for dst, t in later:
                dst.copy_(t, non_blocking=True)
            all_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            all_done.record(side)
        main.wait_event(volatile_done)
        return all_done

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
            try:
                self._copy_pairs(pairs)
                if pending._cuda_event is not None:
                    pending._cuda_event.synchronize()
                complete()
            except BaseException as e:  # reported to whoever waits on the write
                pending._finish(e)
            else:
                pending._finish()

    @staticmethod
    def _copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, t in pairs:
            dst.copy_(t)

    def close(self) -> None:
        """Finish the jobs submitted and stop the thread (a later submit starts a new one)."""
        if self._jobs is not None:
            self._jobs.put(None)
            assert self._thread is not None
            self._thread.join()
            self._jobs, self._thread = None, None
