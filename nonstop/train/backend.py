"""The device a worker computes on and the process-group backend that goes with it.

The node agent gave the process its device at spawn (:mod:`nonstop.devices.inventory`:
``NONSTOP_DEVICE`` = ``LOCAL_RANK``, ``NONSTOP_DEVICE_TYPE``); :func:`worker_device` reads it
back as a ``torch.device`` -- ``cuda:LOCAL_RANK`` on a GPU node, ``cpu`` on a CPU node or with
fake devices -- and :func:`set_current_device` makes it the process's current device. ``nonstop.init()``
does that before anything else touches CUDA, so a script that does ``model.to(session.device)``
(or ``torch.cuda.current_device()``) lands on its own GPU, spares included.

:func:`choose_backend` (pure) picks the backend string and ``device_id`` of a generation's
``init_process_group``:

==========  ==============================  ==========================================
device      backend                         ``device_id``
==========  ==============================  ==========================================
``cpu``     ``gloo``                        None (today's CPU path, unchanged)
``cuda:i``  ``cpu:gloo,cuda:nccl``          ``cuda:i`` (NCCL binds the communicator
                                            eagerly to the rank's own GPU)
``xpu:i``   ``cpu:gloo,xpu:xccl``           ``xpu:i``
other       ``cpu:gloo,T:<torch default>``  the device
==========  ==============================  ==========================================

The composite keeps gloo for the CPU tensors the runtime itself reduces (a CPU tensor's
collective goes to gloo, a device tensor's to NCCL), so nothing of nonstop's CPU-side
bookkeeping needs a device copy.

:func:`collective_timeout_s`: the process group's collective timeout. On CPU it is the
rebuild timeout, as before. On a device node NCCL's watchdog enforces it (with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` it aborts the communicators and fails the collective
instead of killing the process, :mod:`nonstop.devices.nccl`), so it is a backstop behind
nonstop's own hang detection, separate from how long a rebuild may take:
``$NONSTOP_COLLECTIVE_TIMEOUT_S``, default 600 s (NCCL's default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nonstop.devices.inventory import DEVICE, DEVICE_FAKE, DEVICE_TYPE
from nonstop.errors import UsageError

__all__ = [
    "BackendChoice",
    "choose_backend",
    "collective_timeout_s",
    "set_current_device",
    "worker_device",
]

COLLECTIVE_TIMEOUT = "NONSTOP_COLLECTIVE_TIMEOUT_S"
DEVICE_COLLECTIVE_TIMEOUT_S = 600.0  # NCCL's own default (kProcessGroupNCCLDefaultTimeout)


@dataclass(frozen=True, kw_only=True)
class BackendChoice:
    """What ``init_process_group`` is called with for a rank on ``device``."""

    backend: str
    device_id: torch.device | None


def worker_device(env: Mapping[str, str] | None = None) -> torch.device:
    """This process's device, from what the agent set at spawn: ``type:index``, or ``cpu`` on a
    CPU node and with fake devices (an index that names no real device)."""
    env = os.environ if env is None else env
    kind, index = env.get(DEVICE_TYPE), env.get(DEVICE)
    if not kind or index is None or env.get(DEVICE_FAKE) == "1":
        return torch.device("cpu")
    return torch.device(kind, int(index))


def choose_backend(device: torch.device) -> BackendChoice:
    """The backend and ``device_id`` for a rank computing on ``device`` (the module docstring)."""
    if device.type == "cpu":
        return BackendChoice(backend="gloo", device_id=None)
    if device.index is None:
        raise ValueError(f"{device}: a rank's device needs an index")
    native = dist.Backend.default_device_backend_map.get(device.type)
    if native is None:
        raise UsageError(f"device type {device.type!r}: torch.distributed has no backend for it")
    return BackendChoice(backend=f"cpu:gloo,{device.type}:{native}", device_id=device)


def set_current_device(device: torch.device) -> None:
    """Make ``device`` the process's current device (nothing on the CPU). Must run before the
    process creates its first device context, i.e. before the script builds anything on the
    device: otherwise that context lands on device 0."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.accelerator.set_device_index(device.index)


def collective_timeout_s(
    rebuild_timeout_s: float, device: torch.device, env: Mapping[str, str] | None = None
) -> float:
    """The process group's collective timeout (the module docstring)."""
    env = os.environ if env is None else env
    text = env.get(COLLECTIVE_TIMEOUT)
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise UsageError(f"${COLLECTIVE_TIMEOUT}={text!r}: must be a positive number of seconds")
        return value
    return rebuild_timeout_s if device.type == "cpu" else max(rebuild_timeout_s, DEVICE_COLLECTIVE_TIMEOUT_S)
