"""A fake CUDA for testing the snapshot path's device code on a machine without a GPU.

:class:`FakeCuda` replaces what the code under test calls in ``torch.cuda`` (``Stream``,
``Event``, ``current_stream``, ``stream``, ``device``, ``is_available``, ``is_initialized``,
``cudart`` ...) with a model of CUDA's ordering rules, and :func:`on_device` makes a CPU tensor
look like one on ``cuda:i`` (``is_cuda``, ``device``) while sharing its memory.

The model:

* Every device has a current stream (its main stream at first). A stream is a queue of
  operations that run in order, lazily: only when someone synchronizes an event recorded on it,
  or a stream that waits on it runs (:meth:`FakeCuda.run_main`), as a GPU that is always
  "behind" the host. That makes every missing dependency visible: work nobody waited for
  simply has not happened.
* ``dst.copy_(src)`` with ``src`` a fake device tensor (a device-to-host copy) is enqueued on
  the current stream of **src's device**, as CUDA does, whatever the current device is.
* ``stream.wait_stream(other)`` / ``stream.wait_event(ev)`` enqueue "run ``other`` up to here".
* :meth:`FakeCuda.hold` makes running a device's streams block until :meth:`FakeCuda.release`
  (``blocked(i)`` is set when something waits on it): a copy that has not landed yet.

The test plays the main stream itself: before it changes a fake device tensor (what the
optimizer's kernels would do) it calls :meth:`FakeCuda.run_main` for that device, which runs
everything the main stream was made to wait on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

_WORLD: FakeCuda | None = None


class FakeStream:
    def __init__(self, world: FakeCuda, index: int, name: str) -> None:
        self.world, self.index, self.name = world, index, name
        self.ops: list[Callable[[], None]] = []
        self.ran = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name} cuda:{self.index}>"

    def enqueue(self, fn: Callable[[], None]) -> None:
        with self.world.lock:
            self.ops.append(fn)

    def wait_stream(self, other: FakeStream) -> None:
        pos = len(other.ops)
        self.enqueue(lambda: self.world.run(other, pos))

    def wait_event(self, event: FakeEvent) -> None:
        where = event.where
        self.world.waits.append((self, event))
        if where is not None:
            self.enqueue(lambda: self.world.run(*where))

    def synchronize(self) -> None:
        self.world.run(self, len(self.ops))


class FakeEvent:
    def __init__(self, *_: Any, **__: Any) -> None:
        assert _WORLD is not None
        self.world = _WORLD
        self.where: tuple[FakeStream, int] | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream if stream is not None else self.world.current_stream()
        self.where = (stream, len(stream.ops))

    def query(self) -> bool:
        return self.where is None or self.where[0].ran >= self.where[1]

    def synchronize(self) -> None:
        if self.where is not None:
            self.world.run(*self.where)


class FakeCudart:
    """``torch.cuda.cudart()``: records calls; ``register_rc`` is what cudaHostRegister returns
    (one value, or a list consumed call by call)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.register_rc: int | list[int] = 0
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        rc = self.register_rc.pop(0) if isinstance(self.register_rc, list) else self.register_rc
        self.calls.append(("register", ptr, size, flags, rc))
        if rc:
            self.last_error = rc
        return rc

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self) -> int:
        self.calls.append(("get_last_error",))
        rc, self.last_error = self.last_error, 0
        return rc

    def registered(self) -> list[tuple[int, int]]:
        """(ptr, size) of every registration still in force."""
        live: dict[int, int] = {}
        for call in self.calls:
            if call[0] == "register" and call[4] == 0:
                live[call[1]] = call[2]
            elif call[0] == "unregister":
                live.pop(call[1], None)
        return sorted(live.items())


class FakeCuda:
    """The fake device world (see the module docstring); install with :func:`fake_cuda`."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.lock = threading.RLock()
        self.main = [FakeStream(self, i, "main") for i in range(count)]
        self.current = list(self.main)
        self.current_device = 0
        self.waits: list[tuple[FakeStream, FakeEvent]] = []  # every wait_event, in order
        self.streams_made: list[FakeStream] = []
        self.cudart = FakeCudart()
        self.rng = {i: torch.tensor([i, 7], dtype=torch.uint8) for i in range(count)}
        self._held: dict[int, threading.Event] = {}
        self._blocked = {i: threading.Event() for i in range(count)}

    # -- the model -------------------------------------------------------------------------------
    def index(self, device: Any) -> int:
        if device is None:
            return self.current_device
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return d.index if d.index is not None else self.current_device

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current[self.index(device)]

    def run(self, stream: FakeStream, pos: int) -> None:
        """Run ``stream``'s operations up to ``pos`` (and whatever they wait on)."""
        held = self._held.get(stream.index)
        if held is not None and stream.ran < pos:
            self._blocked[stream.index].set()
            held.wait()
        with self.lock:
            while stream.ran < pos:
                op = stream.ops[stream.ran]
                stream.ran += 1
                op()

    def run_main(self, index: int) -> None:
        """Everything ``cuda:index``'s current stream was made to wait for, run: what the device
        guarantees before the next kernel on that stream (the optimizer's) starts."""
        s = self.current[index]
        self.run(s, len(s.ops))

    def hold(self, index: int) -> None:
        self._held[index] = threading.Event()
        self._blocked[index].clear()

    def release(self, index: int) -> None:
        self._held.pop(index).set()

    def blocked(self, index: int) -> threading.Event:
        """Set once something waits on a held device."""
        return self._blocked[index]

    # -- torch.cuda's surface ----------------------------------------------------------------------
    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        s = FakeStream(self, self.index(device), "side")
        self.streams_made.append(s)
        return s

    @contextlib.contextmanager
    def stream(self, s: FakeStream | None) -> Iterator[None]:
        if s is None:
            yield
            return
        prev, prev_dev = self.current[s.index], self.current_device
        self.current[s.index], self.current_device = s, s.index
        try:
            yield
        finally:
            self.current[s.index], self.current_device = prev, prev_dev

    @contextlib.contextmanager
    def device(self, d: Any) -> Iterator[None]:
        prev, self.current_device = self.current_device, self.index(d)
        try:
            yield
        finally:
            self.current_device = prev

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.rng[self.index(device)].clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.rng[self.index(device)] = state.clone()

    def install(self, mp: pytest.MonkeyPatch) -> None:
        global _WORLD
        _WORLD = self
        c = torch.cuda
        mp.setattr(c, "is_available", lambda: True)
        mp.setattr(c, "is_initialized", lambda: True)
        mp.setattr(c, "device_count", lambda: self.count)
        mp.setattr(c, "current_device", lambda: self.current_device)
        mp.setattr(c, "Stream", self.Stream)
        mp.setattr(c, "Event", FakeEvent)
        mp.setattr(c, "current_stream", self.current_stream)
        mp.setattr(c, "stream", self.stream)
        mp.setattr(c, "device", self.device)
        mp.setattr(c, "cudart", lambda: self.cudart)
        mp.setattr(c, "get_rng_state", self.get_rng_state)
        mp.setattr(c, "set_rng_state", self.set_rng_state)


class OnFakeCuda(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:fake_index`` (:func:`on_device`); a copy out of it
    is enqueued on that device's current stream of the installed :class:`FakeCuda`."""

    fake_index = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.fake_index)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.copy_ and _WORLD is not None:
                dst, src = args[0], args[1]
                if isinstance(src, OnFakeCuda) and not isinstance(dst, OnFakeCuda):
                    plain_dst, plain_src = dst.as_subclass(torch.Tensor), src.as_subclass(torch.Tensor)
                    _WORLD.current[src.fake_index].enqueue(lambda: plain_dst.copy_(plain_src))
                    return dst
            out = func(*args, **kwargs)
        # results of ops on a device tensor stay on its device (detach, views, ...)
        index = next((a.fake_index for a in args if isinstance(a, OnFakeCuda)), None)
        if index is not None and isinstance(out, torch.Tensor) and not isinstance(out, OnFakeCuda):
            return on_device(out, index)
        return out


def on_device(t: torch.Tensor, index: int = 0) -> OnFakeCuda:
    """``t`` (same memory) as a tensor on fake ``cuda:index``."""
    out = t.as_subclass(OnFakeCuda)
    out.fake_index = index
    return out


def fake_cuda(mp: pytest.MonkeyPatch, count: int = 2) -> FakeCuda:
    world = FakeCuda(count)
    world.install(mp)
    return world


def uninstall() -> None:
    global _WORLD
    _WORLD = None
