"""The accelerator side of capture: side streams and events per device, page-locked slot memory,
and the device RNG. Everything here is a no-op, and never initialises CUDA, on a process whose
state is on the CPU.

**Streams and events** (:class:`SideStreams`). A device-to-host copy runs on the current stream of
the *source tensor's* device, whatever the current device is. So the deferred copies are grouped
by device, and for each device d: d's side stream (one per device, made once with
``torch.cuda.Stream(device=d)``) waits for d's current stream (the step that produced the
tensors), d's copies are issued on it, and an event is recorded on it after them. The snapshot
is COMPLETE only when every device's event has completed (:class:`~.pending.Copier` synchronizes
each), and :func:`fence_streams` makes each device's current stream wait for that device's event,
so the optimizer's kernels on d start only after d's copies: a device-side dependency, no host
wait.

**Paced copies** (:class:`DeviceCopies`). A GPU's copy engine runs device-to-host copies in the
order they were queued, whatever their stream: a snapshot of several GB queued at once would hold
back every small copy the training loop makes meanwhile -- a ``loss.item()`` after the optimizer
step waits for the whole snapshot (measured on an H200: the step took as long as with a synchronous
snapshot). So only the copies the next forward may change (``now``) are issued by ``begin``; the
deferred ones are issued by the copier thread :data:`DEVICE_COPY_CHUNK` bytes at a time with at
most :data:`COPIES_IN_FLIGHT` batches queued per device, so another stream's copy waits behind a
few milliseconds of the snapshot at most. The fence then waits on the host until the last batch is
issued (the tail of the copy), and makes the stream wait for it. Measured after the pacing (H200,
BENCHMARKS.md "On a GPU"): most steps pay nothing, but 3 in 10 still waited for a whole copy --
why is not known yet. Each write records where its paced copies spent their time
(:meth:`~nonstop.snapshot.pending.PendingWrite.timeline`: the copier's pick-up, its issue, the
part of it waiting for batches to land), and the queue depth is a store parameter
(``device_depth``), so that a GPU run can tell a copier starved of the GIL between its batches
(the copy engine idles) from a busy copy engine (``benchmarks/bench_gpu_capture.py``).

**CPU-resident deferred tensors** in a write that also has device copies (Adam's ``step``, kept on
the CPU for device parameters unless ``capturable``): the optimizer changes them from the host, so
a stream dependency does not hold them. Those of at most :data:`SMALL_HOST_COPY` bytes are copied
at once by ``begin`` (a scalar costs less than waking a thread); larger ones go to the copier
thread and the fence waits for them on the host (:meth:`~.pending.PendingWrite.fence`).

**Page-locked slots** (:class:`HostRegistration`). Copies into pageable memory are synchronous
(the driver stages them): the slot's data area is registered with ``cudaHostRegister`` when the
slot is sized for a state with device tensors (``prefault``, or the first write into that slot),
never inside later writes. Registration goes in chunks of :data:`REGISTER_CHUNK` bytes, and a
device copy is split at chunk edges (:func:`split_at`) so that every copy lands in one registered
range. Every return code is checked; a failure clears CUDA's per-thread last error
(``cudaGetLastError``, else the next kernel launch check of this thread reports it as its own),
logs one warning with the code per process, undoes the chunks already registered and leaves the
slot pageable (copies stay correct, only slower).

**Device RNG** (:func:`device_rng_state` / :func:`set_device_rng_state`): the generator of the
rank's current device, captured only when CUDA (or another accelerator torch knows) is available
*and* initialised, restored onto the current device of a process that has one.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "COPIES_IN_FLIGHT",
    "DEVICE_COPY_CHUNK",
    "REGISTER_CHUNK",
    "SMALL_HOST_COPY",
    "DeviceCopies",
    "HostRegistration",
    "Pairs",
    "SideStreams",
    "cuda_ready",
    "cut",
    "device_rng_state",
    "fence_streams",
    "set_device_rng_state",
    "split_at",
]

DEVICE_COPY_CHUNK = 64 << 20
"""Bytes of deferred device-to-host copies issued at a time (see "Paced copies"): ~1 ms of PCIe."""

COPIES_IN_FLIGHT = 2
"""Batches of :data:`DEVICE_COPY_CHUNK` a device has queued at most (the next is issued as the
oldest lands: the copy engine never idles, and a stream's own copy waits behind at most this)."""

SMALL_HOST_COPY = 64 << 10
"""A CPU-resident deferred tensor of a write with device copies is copied at once up to this size."""

REGISTER_CHUNK = 256 << 20
"""Bytes per ``cudaHostRegister`` call. Pinning runs at a few GB/s, so one call stays under ~0.1 s,
and a slot of tens of GB is not one driver call that either pins everything or fails late; the
size is a multiple of the slot alignment (64 B) and of every element size, so a copy split at a
chunk edge splits between elements."""

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
"""(destination in slot memory, source tensor) pairs."""


def cuda_ready() -> bool:
    """CUDA is usable and already initialised in this process (this never initialises it)."""
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


# -- streams and events ------------------------------------------------------------------------
class SideStreams:
    """One store's side streams, one per device (made on first use). Caller's thread only, except
    :meth:`DeviceCopies.issue` on the copier thread while the write it belongs to is in flight."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def start(self, now: Pairs, later: Pairs, *, chunk: int = 0) -> DeviceCopies:
        """Order each device's side stream after that device's current stream's work, and issue
        the device-to-host copies of ``now`` (device tensors into slot memory) on it; each device's
        current stream waits at once for its ``now`` copies (the next forward may change those
        tensors). The ``later`` copies are issued here too when ``chunk`` is 0; else they are left
        in the returned :class:`DeviceCopies` for the copier thread to issue paced (see "Paced
        copies" in the module docstring)."""
        groups: dict[torch.device, tuple[Pairs, Pairs]] = {}
        for i, pairs in enumerate((now, later)):
            for dst, src in pairs:
                groups.setdefault(src.device, ([], []))[i].append((dst, src))
        copies = DeviceCopies()
        for dev, (dev_now, dev_later) in groups.items():
            side = self._streams.get(dev)
            if side is None:
                side = self._streams[dev] = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
            main = torch.cuda.current_stream(dev)
            side.wait_stream(main)
            volatile_done = None
            with torch.cuda.device(dev), torch.cuda.stream(side):
                for dst, src in dev_now:
                    dst.copy_(src, non_blocking=True)
                if dev_now:
                    volatile_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    volatile_done.record(side)
                if chunk <= 0 or not dev_later:
                    for dst, src in dev_later:
                        dst.copy_(src, non_blocking=True)
                    all_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    all_done.record(side)
                    copies.events[dev] = all_done
                else:
                    copies.todo[dev] = (side, cut(dev_later, chunk))
            if volatile_done is not None:
                main.wait_event(volatile_done)
        return copies


class DeviceCopies:
    """The device-to-host copies of one write: per device, the event recorded after all its copies
    (``events``), and the copies not issued yet (``todo``: its side stream and the pieces, each at
    most the pacing chunk). :meth:`issue` runs on the copier thread."""

    def __init__(self) -> None:
        self.events: dict[torch.device, Any] = {}
        self.todo: dict[torch.device, tuple[Any, Pairs]] = {}
        # what :meth:`issue` did, for a step that waited to say why (PendingWrite.timeline): batches
        # issued, its seconds in all, and the part spent waiting for the oldest batch to land
        self.batches = 0
        self.issue_s = 0.0
        self.landing_s = 0.0

    @property
    def issued(self) -> bool:
        return not self.todo

    def issue(self, chunk: int, depth: int = COPIES_IN_FLIGHT) -> None:
        """Issue ``todo`` about ``chunk`` bytes at a time per device, the devices in turn, with at
        most ``depth`` batches per device in flight (the host waits for the oldest before it issues
        more); fills ``events``. Its side streams already wait for the step that produced the
        tensors (:meth:`SideStreams.start`), and a stream runs in order: each device's last batch's
        event marks the end of all its copies.

        Timed (``batches``, ``issue_s``, ``landing_s``): the time not spent waiting for a batch to
        land is this thread's own -- Python, and the GIL it waits for while the training loop
        holds it; a copy engine starved that way idles while the issue lasts."""
        t0 = time.perf_counter()
        queues = {dev: (side, list(reversed(pairs))) for dev, (side, pairs) in self.todo.items()}
        inflight: collections.deque[Any] = collections.deque()
        while queues:
            for dev in list(queues):
                side, stack = queues[dev]
                size = 0
                with torch.cuda.device(dev), torch.cuda.stream(side):
                    while stack and size < chunk:
                        dst, src = stack.pop()
                        dst.copy_(src, non_blocking=True)
                        size += dst.numel() * dst.element_size()
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(side)
                inflight.append(event)
                self.batches += 1
                if not stack:
                    del queues[dev]
                    self.events[dev] = event
            while len(inflight) > depth * max(1, len(queues)):
                t1 = time.perf_counter()
                inflight.popleft().synchronize()
                self.landing_s += time.perf_counter() - t1
        self.todo = {}
        self.issue_s += time.perf_counter() - t0


def cut(pairs: Pairs, chunk: int) -> Pairs:
    """``pairs`` with every contiguous copy of more than ``chunk`` bytes cut into pieces of at most
    ``chunk`` bytes (whole elements); a copy into memory registered in chunks is already cut at
    their edges (:meth:`HostRegistration.pieces`), and ``chunk`` divides those."""
    out: Pairs = []
    for dst, src in pairs:
        size = dst.element_size()
        if dst.numel() * size <= chunk or not (dst.is_contiguous() and src.is_contiguous()):
            out.append((dst, src))
            continue
        step = max(1, chunk // size)
        flat_dst, flat_src = dst.view(-1), src.reshape(-1)
        out += [(flat_dst[i : i + step], flat_src[i : i + step]) for i in range(0, dst.numel(), step)]
    return out


def fence_streams(events: dict[torch.device, Any]) -> None:
    """Make each device's current stream wait for that device's copies (``events``)."""
    for dev, event in events.items():
        torch.cuda.current_stream(dev).wait_event(event)


def split_at(dst: torch.Tensor, src: torch.Tensor, base: int, chunk: int) -> Pairs:
    """(dst, src) cut where ``dst`` (memory from ``base`` on, registered in ``chunk``-byte pieces)
    crosses a chunk edge, so each copy lands in one registered range; whole when it does not
    cross one or either side is not contiguous."""
    start = dst.data_ptr() - base
    nbytes = dst.numel() * dst.element_size()
    if nbytes == 0 or start // chunk == (start + nbytes - 1) // chunk:
        return [(dst, src)]
    if not (dst.is_contiguous() and src.is_contiguous()):
        return [(dst, src)]
    flat_dst, flat_src, size = dst.view(-1), src.reshape(-1), dst.element_size()
    out: Pairs = []
    lo = 0
    while lo < dst.numel():
        edge = (start + lo * size) // chunk * chunk + chunk
        hi = min(dst.numel(), (edge - start) // size)
        out.append((flat_dst[lo:hi], flat_src[lo:hi]))
        lo = hi
    return out


# -- page-locked memory ------------------------------------------------------------------------
_warned: set[int] = set()


@functools.cache
def _libcudart_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the libcudart torch loaded (never loads another copy: its error
    state would be another one)."""
    for name in (None, "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL) if name else ctypes.CDLL(None)
            fn = lib.cudaGetLastError
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        return lambda: int(fn())
    return None


def _clear_last_error(cudart: Any) -> int | None:
    """Clear this thread's CUDA last error; return it (None when it cannot be reached)."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        return int(get())
    fn = _libcudart_last_error()
    return fn() if fn is not None else None


def _failed(what: str, rc: int, cudart: Any) -> None:
    cleared = _clear_last_error(cudart)
    if rc in _warned:
        return
    _warned.add(rc)
    note = "" if cleared is not None else " (CUDA's last error could not be cleared)"
    log.warning(
        "%s failed with CUDA error %d; snapshot copies into this memory stay pageable "
        "(correct, slower)%s", what, rc, note,
    )  # fmt: skip


class HostRegistration:
    """One host range page-locked with ``cudaHostRegister`` in :data:`REGISTER_CHUNK` pieces, all
    or nothing (see the module docstring). Not thread-safe: its slot's owner thread only."""

    def __init__(self) -> None:
        self.base = 0
        self.chunk = REGISTER_CHUNK
        self._chunks: list[int] = []
        self._refused: tuple[int, int] | None = None  # the range the driver refused: not retried

    @property
    def active(self) -> bool:
        return bool(self._chunks)

    def covers(self, ptr: int, size: int) -> bool:
        return self.active and self.base == ptr and size <= len(self._chunks) * self.chunk

    def register(self, ptr: int, size: int) -> bool:
        """Page-lock ``size`` bytes at ``ptr`` (undoing a registration of another range first);
        False, the range pageable, when the driver refuses (logged once per error code; the same
        range is not tried again)."""
        if self.covers(ptr, size):
            return True
        if self._refused == (ptr, size):
            return False
        self.unregister()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self.base, self.chunk = ptr, REGISTER_CHUNK
        for off in range(0, size, self.chunk):
            rc = int(cudart.cudaHostRegister(ptr + off, min(self.chunk, size - off), 0))
            if rc != 0:
                _failed(f"cudaHostRegister of {size} bytes (at offset {off})", rc, cudart)
                self.unregister()
                self._refused = (ptr, size)
                return False
            self._chunks.append(ptr + off)
        return True

    def unregister(self) -> None:
        """Undo the registration (the memory must hold no copy in flight)."""
        if not self._chunks:
            return
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for ptr in self._chunks:
            rc = int(cudart.cudaHostUnregister(ptr))
            if rc != 0:
                _failed("cudaHostUnregister", rc, cudart)
        self._chunks = []

    def pieces(self, dst: torch.Tensor, src: torch.Tensor) -> Pairs:
        """The copies of ``src`` into ``dst`` (in this range), cut at chunk edges."""
        if not self._chunks:
            return [(dst, src)]
        return split_at(dst, src, self.base, self.chunk)


# -- the device RNG ------------------------------------------------------------------------------
def _accelerator() -> tuple[str, Any] | None:
    """(device type, torch's module for it) of this process's accelerator when it is available
    and initialised; None otherwise (the CPU, or nothing has touched the device yet)."""
    if torch.cuda.is_available():
        return ("cuda", torch.cuda) if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is None:
        return None
    mod = torch.get_device_module(acc.type)
    initialised = getattr(mod, "is_initialized", None)
    if initialised is None or not initialised() or not hasattr(mod, "get_rng_state"):
        return None
    return acc.type, mod


def device_rng_state() -> dict[str, Any] | None:
    """The RNG state of the rank's current accelerator device, or None (see the module doc)."""
    found = _accelerator()
    if found is None:
        return None
    kind, mod = found
    index = int(mod.current_device())
    return {"type": kind, "index": index, "state": mod.get_rng_state(index)}


def set_device_rng_state(saved: dict[str, Any]) -> None:
    """Restore ``saved`` (from :func:`device_rng_state`) onto this process's current device of
    that type (the rank's device now, which may be another index than at capture); nothing on a
    process without one (logged)."""
    found = _accelerator()
    if found is None or found[0] != saved["type"]:
        log.info(
            "snapshot holds a %s RNG state; this process has no such device: not restored", saved["type"]
        )
        return
    mod = found[1]
    mod.set_rng_state(saved["state"].clone(), int(mod.current_device()))
