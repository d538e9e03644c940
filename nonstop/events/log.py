"""Append-only JSONL event log of a job (``<job_dir>/events.jsonl``).

Each line is one JSON object with at least ``ts`` (unix time) and ``event``: a typed event of
:mod:`nonstop.events` as its :meth:`~nonstop.events.Event.to_json`. The first
line of a new log is a header (``"event": "eventlog"``, ``"version"``); readers take logs with
and without one. Lines are flushed as they are written, so the log is readable while the job
runs and survives a crash of the launcher.

Subscribers (:meth:`EventLog.subscribe`: the job's Prometheus metrics) see each event after its
line is written, on the emitting thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nonstop.events import Event, LogHeader, from_fields

__all__ = ["EventLog", "read_events"]


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._subscribers: tuple[Callable[[Event], None], ...] = ()
        if os.fstat(self._fh.fileno()).st_size == 0:  # a new log: its format first
            self.emit(LogHeader())

    def emit(self, event: Event | str, /, **fields: Any) -> None:
        """Log ``event`` (stamped with the time now unless it has a ``ts``).

        Transition form: ``emit("node_lost", node=..., ...)`` builds the event of that kind from
        the fields and raises ``TypeError`` for an unknown kind or a field the kind does not have."""
        if isinstance(event, str):
            event = from_fields(event, fields)
        elif fields:
            raise TypeError("emit takes a typed event or a kind with its fields, not both")
        if event.ts is None:
            event = dataclasses.replace(event, ts=time.time())
        line = json.dumps(event.to_json(), default=str)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()
        for subscriber in self._subscribers:
            subscriber(event)

    def subscribe(self, subscriber: Callable[[Event], None]) -> None:
        """Call ``subscriber`` with every event logged from now on, on the thread that logs it,
        after its line is written. It must return quickly and never raise (it runs inside the
        coordinator's loop and the persisters' threads)."""
        with self._lock:
            self._subscribers = (*self._subscribers, subscriber)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every line of the log as a JSON object (the header included); decode them with
    :func:`nonstop.events.decode`."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
