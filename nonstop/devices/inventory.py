"""A node's accelerator devices and which process holds each one.

The node agent (:mod:`nonstop.agent.node`) owns one :class:`DeviceInventory`. Every process it
spawns -- a rank, a hot spare, a cold replacement -- takes a FREE device at spawn and holds it
until it exits; the device is then free for the next process. A spare that takes a rank keeps
the device it was spawned with: its state is restored onto that device, nothing moves.

**Device index and ``LOCAL_RANK``.** All of the node's devices stay visible to every process
(``CUDA_VISIBLE_DEVICES`` is not narrowed; a value the user exported passes through untouched)
and the process is told its device index: ``LOCAL_RANK`` = ``NONSTOP_DEVICE`` = that index,
set in its environment before the script's first line and never changed while it lives
(:mod:`nonstop.train.membership` keeps it against a reconfigure). This is torchrun's convention
(``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks the process's own GPU), it keeps
NCCL's topology detection (it sees every GPU of the node, NVLink peers included) and a spare's
index is meaningful before it has a rank. The price: after a recovery ``LOCAL_RANK`` is not
dense -- a spare on GPU 7 that takes rank 3 has ``LOCAL_RANK`` 7 -- so it is a device index,
not a position among the node's ranks (data sharding reads ``RANK``, as it should).

**Which devices.** :func:`detect_devices`: ``NONSTOP_FAKE_DEVICES=N`` (tests, CPU machines: N
devices of type ``NONSTOP_FAKE_DEVICE_TYPE``, default ``cuda``, that exist only as indexes --
processes compute on the CPU), else ``torch.accelerator`` (the current accelerator and its
device count), else the CPU: no inventory limit, no index handed out, ``LOCAL_RANK`` as the
coordinator numbers it (:mod:`nonstop.coordinator.torch_env`) -- today's CPU behaviour unchanged.

Pure except :func:`detect_devices` (reads torch). Not thread-safe: the agent's loop only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from nonstop.errors import NonstopError, UsageError

__all__ = [
    "DeviceInventory",
    "Devices",
    "NoFreeDeviceError",
    "check_fits",
    "detect_devices",
    "worker_device_env",
]

FAKE_DEVICES = "NONSTOP_FAKE_DEVICES"  # N: pretend the node has N accelerator devices
FAKE_DEVICE_TYPE = "NONSTOP_FAKE_DEVICE_TYPE"  # their type (default cuda)
DEVICE = "NONSTOP_DEVICE"  # the index of the process's device (== LOCAL_RANK), set at spawn
DEVICE_TYPE = "NONSTOP_DEVICE_TYPE"  # cuda, xpu, ...; absent on a CPU node
DEVICE_FAKE = "NONSTOP_DEVICE_FAKE"  # "1": the index names no real device (compute on the CPU)


class NoFreeDeviceError(NonstopError):
    """Every device of the node is held by a live process: place the process elsewhere."""


@dataclass(frozen=True, kw_only=True)
class Devices:
    """The accelerator devices a node has. ``count`` None: a CPU node (no limit, no index)."""

    type: str = "cpu"
    count: int | None = None
    fake: bool = False

    @property
    def limited(self) -> bool:
        return self.count is not None

    def describe(self) -> str:
        if self.count is None:
            return "no accelerator (CPU)"
        return f"{self.count} {self.type} device(s)" + (f" (fake: ${FAKE_DEVICES})" if self.fake else "")


def detect_devices(env: Mapping[str, str] | None = None) -> Devices:
    """This machine's devices (the module docstring); a bad ``$NONSTOP_FAKE_DEVICES`` is a
    UsageError naming it."""
    env = os.environ if env is None else env
    text = env.get(FAKE_DEVICES)
    if text is not None and text.strip() != "":
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise UsageError(f"${FAKE_DEVICES}={text!r}: must be a number of devices (0: a CPU node)")
        if n == 0:
            return Devices()
        return Devices(type=env.get(FAKE_DEVICE_TYPE) or "cuda", count=n, fake=True)
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        if dev is not None and dev.type != "cpu":
            return Devices(type=dev.type, count=int(acc.device_count()))
    return Devices()


def check_fits(*, nproc: int, spares: int, devices: Devices) -> None:
    """A node runs ``nproc`` ranks and ``spares`` hot spares, each on a device of its own:
    UsageError (one line, exit 2) when that is more processes than it has devices."""
    if devices.count is None:
        return
    want = nproc + spares
    if want > devices.count:
        raise UsageError(
            f"--nproc-per-node {nproc} + --spares {spares} = {want} processes, but this node has "
            f"{devices.describe()}: each rank and spare needs a device of its own"
        )


def worker_device_env(devices: Devices, index: int | None) -> dict[str, str]:
    """What a process holding device ``index`` (None: a CPU node) finds in its environment."""
    if index is None or devices.count is None:
        return {}
    env = {DEVICE: str(index), DEVICE_TYPE: devices.type, "LOCAL_RANK": str(index)}
    if devices.fake:
        env[DEVICE_FAKE] = "1"
    return env


class DeviceInventory:
    """Which live process (spawn id) holds each device of a node (the module docstring)."""

    def __init__(self, devices: Devices) -> None:
        self.devices = devices
        self._holder: dict[int, int] = {}  # device index -> spawn id
        self._of: dict[int, int] = {}  # spawn id -> device index

    def acquire(self, spawn_id: int) -> int | None:
        """The lowest free device, now held by ``spawn_id`` (the one it holds if it has one);
        None on a CPU node. NoFreeDeviceError when every device is held."""
        if self.devices.count is None:
            return None
        if spawn_id in self._of:
            return self._of[spawn_id]
        for index in range(self.devices.count):
            if index not in self._holder:
                self._holder[index] = spawn_id
                self._of[spawn_id] = index
                return index
        held = ", ".join(f"{d}: process {s}" for d, s in sorted(self._holder.items()))
        raise NoFreeDeviceError(
            f"no free device for process {spawn_id}: all {self.devices.describe()} are held ({held})"
        )

    def release(self, spawn_id: int) -> int | None:
        """``spawn_id`` exited: its device (returned, None if it held none) is free again."""
        index = self._of.pop(spawn_id, None)
        if index is not None:
            del self._holder[index]
        return index

    def device_of(self, spawn_id: int) -> int | None:
        return self._of.get(spawn_id)

    def free(self) -> list[int]:
        """Free device indexes, ascending (empty on a CPU node: it has no indexes)."""
        if self.devices.count is None:
            return []
        return [i for i in range(self.devices.count) if i not in self._holder]

    def has_room(self) -> bool:
        """Whether one more process can be spawned here."""
        return self.devices.count is None or len(self._holder) < self.devices.count
