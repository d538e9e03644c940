"""Append-only JSONL event log of a job (``<job_dir>/events.jsonl``).

Each line is one JSON object with at least ``ts`` (unix time) and ``event``.
Lines are flushed as they are written, so the log is readable while the job
runs and survives a crash of the launcher.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events"]


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ts": time.time(), "event": event, **fields}, default=str)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
