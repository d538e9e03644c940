"""What the chaos driver sees of a running job: its event log read as it grows, and ``nonstop
status`` (the coordinator's own view) asked for as often as the driver needs it.

Every wait here is for a condition on those two, with a deadline: nothing sleeps and hopes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nonstop.errors import NonstopError
from nonstop.launch.job_client import request_status

__all__ = ["JobEnded", "JobWatch", "Timeout"]

POLL_S = 0.1  # each status request is a connection the job logs: not faster


class Timeout(NonstopError):
    """A condition the driver waited for did not come within its deadline."""


class JobEnded(Timeout):
    """The job reached its last step (and ended) before what the driver waited for came."""


class JobWatch:
    """The events of one job (``<job_dir>/events.jsonl``), read incrementally, and its status."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.path = job_dir / "events.jsonl"
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self.last_status: dict[str, Any] | None = None

    def poll(self) -> list[dict[str, Any]]:
        """Read the lines appended since the last poll (whole lines only); return them."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        new = []
        for line in whole.splitlines():
            if line.strip():
                try:
                    new.append(json.loads(line))
                except ValueError:
                    continue
        self.events.extend(new)
        return new

    def named(self, name: str, since: float = 0.0) -> list[dict[str, Any]]:
        self.poll()
        return [e for e in self.events if e.get("event") == name and float(e.get("ts", 0)) >= since]

    @property
    def job_id(self) -> str | None:
        got = self.named("job_start")
        return str(got[0]["job_id"]) if got else None

    def ended(self) -> bool:
        return bool(self.named("job_end"))

    def status(self) -> dict[str, Any] | None:
        """The coordinator's status, None while it cannot answer (restarting, ended)."""
        try:
            got = request_status(self.job_dir)
        except (NonstopError, OSError, ValueError, KeyError):
            return None
        if got.get("t") != "status":
            return None
        self.last_status = got
        return got

    def wait(
        self,
        what: str,
        cond: Callable[[], Any],
        timeout: float,
        *,
        alive: Callable[[], bool] | None = None,
        every: float = POLL_S,
    ) -> Any:
        """Until ``cond()`` is truthy (returned); :class:`Timeout` naming ``what`` after ``timeout``
        seconds, or at once when the job ended or ``alive()`` turned false."""
        deadline = time.monotonic() + timeout
        while True:
            got = cond()
            if got:
                return got
            if self.ended():
                raise JobEnded(f"the job ended while waiting for {what}")
            if alive is not None and not alive():
                raise Timeout(f"node 0 exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise Timeout(f"no {what} within {timeout:g}s")
            time.sleep(every)

    def wait_event(self, name: str, since: float, timeout: float, **kw: Any) -> dict[str, Any]:
        got: dict[str, Any] = self.wait(f"{name} event", lambda: self.named(name, since), timeout, **kw)[0]
        return got
