"""A node agent's health probes on a period (issue 21), on a thread of their own.

:class:`~nonstop.config.ProbeConfig` is what the operator asks for (``--probe-period``, ``--health-cmd``,
``--health-timeout``), validated at start. :class:`ProbeThread` runs the node's probes
(:mod:`~nonstop.agent.probes`: the host probe, the NVML probe where ``pynvml`` imports, the
health command) every ``period_s`` seconds and keeps the worst verdict of each round. The
first verdict and every **change** of verdict (healthy / degraded / failing; a changed detail
alone is not one) is sent to the coordinator as the agent's health message::

    agent -> coordinator   health {verdict, probe, detail}

where the coordinator's :class:`~nonstop.coordinator.health.Health` logs it (event ``health``),
grades the node's failures with it and, with ``--on-degraded drain``, drains the node.

Threading: the probes run on the thread (a health command may take up to its timeout), never
on the agent's loop; ``send`` must be safe to call from it (the agent's control channel sends
under a lock). :meth:`ProbeThread.forget` (any thread) makes the next round send its verdict
even if unchanged: a restarted coordinator knows none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nonstop.agent.probes import CommandProbe, ProbeResult, _Clock, host_probe, nvml_probe, run_probes
from nonstop.config import ProbeConfig
from nonstop.protocol.base import HealthMsg

__all__ = ["MAX_DETAIL", "Probe", "ProbeThread", "health_message", "node_probes"]

log = logging.getLogger(__name__)

Probe = Callable[[], ProbeResult]
MAX_DETAIL = 300  # characters of a verdict's detail sent to the coordinator


def node_probes(config: ProbeConfig, *, env: Mapping[str, str] | None = None) -> list[Probe]:
    """The probes of one node: the host probe (with its own clock record), the NVML probe where
    ``pynvml`` imports and initializes, and ``config.command`` with environment ``env``. Call it
    on the probe thread: initializing NVML may take a while."""
    clock = _Clock()

    def host() -> ProbeResult:
        return host_probe(clock=clock)

    probes: list[Probe] = [host]
    nvml = nvml_probe()
    if nvml is not None:
        probes.append(nvml)
    if config.command is not None:
        probes.append(CommandProbe(config.command, timeout_s=config.timeout_s, env=env))
    return probes


def health_message(result: ProbeResult) -> dict[str, Any]:
    """The agent's ``health`` message for ``result`` (its detail cut to :data:`MAX_DETAIL`)."""
    return HealthMsg(
        verdict=result.verdict,
        probe=None if result.probe == "none" else result.probe,  # "none": every probe healthy
        detail=result.detail[:MAX_DETAIL] or None,
    ).encode()


class ProbeThread:
    """Runs ``make_probes()`` (called once, on the thread) every ``period_s`` seconds and sends
    each verdict change with ``send`` (see the module docstring). ``wait(seconds)`` sleeps
    between rounds and returns True to stop (default: the thread's stop event; tests pass a
    fake clock)."""

    def __init__(
        self,
        make_probes: Callable[[], Sequence[Probe]],
        *,
        period_s: float,
        send: Callable[[dict[str, Any]], None],
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0 (got {period_s})")
        self.period_s = period_s
        self._make = make_probes
        self._send = send
        self._stop = threading.Event()
        self._wait = wait if wait is not None else self._stop.wait
        self._probes: Sequence[Probe] | None = None
        self.last: str | None = None  # the verdict last sent
        self.rounds = 0
        self._thread: threading.Thread | None = None

    def check(self) -> ProbeResult:
        """One round: run every probe, send the worst verdict if it is new; return it."""
        if self._probes is None:
            self._probes = list(self._make())
        result = run_probes(self._probes)
        self.rounds += 1
        if result.verdict != self.last:
            self.last = result.verdict
            self._send(health_message(result))
        return result

    def forget(self) -> None:
        """Send the next round's verdict even if it did not change."""
        self.last = None

    def run(self) -> None:
        """Rounds until stopped; a round that raises is logged and the next one tried."""
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:
                log.exception("health probes failed")
            if self._wait(self.period_s):
                return

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="nonstop-probes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current round (not waited for: a health command may run until its
        timeout; the thread is a daemon)."""
        self._stop.set()
