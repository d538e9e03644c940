"""How a node agent starts and reaps its processes, each on a device of its own.

:class:`DeviceSpawner` is the part of :class:`~nonstop.agent.node.NodeAgent` that carries out
the coordinator's ``spawn`` commands -- a free device from the agent's
:class:`~nonstop.devices.inventory.DeviceInventory` for every process, spares included
(``LOCAL_RANK`` = that device, for life; refused with ``spawned {pid: null, error}`` and ``exit {rc:
125}`` when none is free) -- and reports each exit, freeing its device. Agent loop thread only.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from nonstop.agent.processes import Agent
from nonstop.control.channel import Message
from nonstop.devices.inventory import DeviceInventory, NoFreeDeviceError, worker_device_env
from nonstop.faults import fired_at
from nonstop.protocol.agent import ExitMsg, SpawnedMsg, SpawnMsg

__all__ = ["EXIT_NO_DEVICE", "KILL_WAIT_S", "TICK_S", "DeviceSpawner"]

log = logging.getLogger(__name__)

EXIT_NO_DEVICE = 125  # the rc reported for a spawn refused for want of a free device (never ran)
TICK_S = 0.005
KILL_WAIT_S = 5.0  # how long a spawn waits for a SIGKILLed process's device (devices/inventory.py)


class DeviceSpawner:
    """Spawn on a free device, reap and free it (see the module docstring)."""

    agent: Agent | None
    devices: DeviceInventory
    job_dir: Path
    spec: Any
    _killed: set[int]

    def _send(self, msg: Message) -> None:
        raise NotImplementedError

    def _report_exits(self) -> None:
        """Tell the coordinator of every process that exited since the last call; free its device."""
        assert self.agent is not None
        for sid, rc in self.agent.poll():
            self.devices.release(sid)  # its device is free for the next process
            self._killed.discard(sid)
            pid = self.agent.exited_pids.get(sid)
            fault_at = fired_at(self.job_dir / "faults", pid) if pid is not None else None
            self._send(ExitMsg(spawn_id=sid, rc=rc, pid=pid, fault_at=fault_at).encode())

    def _spawn(self, cmd: SpawnMsg) -> None:
        """Start the process ``cmd`` asks for on a free device of this node (the module
        docstring); with none free, refuse it: ``spawned`` with the error, then its ``exit``."""
        assert self.agent is not None
        sid = cmd.spawn_id
        try:
            device = self._acquire(sid)
        except NoFreeDeviceError as e:
            log.error("node %s: %s", self.spec.node, e)
            self._send(SpawnedMsg(spawn_id=sid, pid=None, error=str(e)).encode())
            self._send(ExitMsg(spawn_id=sid, rc=EXIT_NO_DEVICE, pid=None, fault_at=None).encode())
            return
        env = dict(cmd.env or {})
        env.update(worker_device_env(self.spec.devices, device))  # LOCAL_RANK = its device, for life
        try:
            self.agent.spawn(cmd.role, sid, rank=cmd.rank, env=env)
        except BaseException:
            self.devices.release(sid)
            raise
        self._send(SpawnedMsg(spawn_id=sid, pid=self.agent.pid(sid), device=device).encode())

    def _acquire(self, sid: int) -> int | None:
        """A free device for process ``sid``. The coordinator replaces a process in place by
        "kill X, spawn a spare" in one breath: when every device is held but a holder was just
        SIGKILLed, wait (at most KILL_WAIT_S) for it to be reaped rather than refuse."""
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            try:
                return self.devices.acquire(sid)
            except NoFreeDeviceError:
                dying = any(self.devices.device_of(k) is not None for k in self._killed)
                if not dying or time.monotonic() > deadline:
                    raise
            time.sleep(TICK_S)
            self._report_exits()
