"""Preemption notices from an HTTP endpoint (a cloud's instance metadata service).

``nonstop run --preempt-url URL [--preempt-header 'Name: value' ...]``: the node agent polls
``URL`` every ``--preempt-poll`` seconds on a background thread. What counts as a notice
(:func:`parse_notice`, pure) covers the common metadata endpoints:

* an HTTP error or 404 (AWS ``spot/instance-action`` before a notice), an empty body, or a body
  that says no (``FALSE``, ``false``, ``0``, ``none``: GCP ``instance/preempted``) -- no notice;
* JSON with an ``Events`` list (Azure Scheduled Events): a notice when an event of type
  ``Preempt``, ``Terminate`` or ``Reboot`` is listed; its ``NotBefore`` is the deadline;
* any other 200 body -- a notice. A JSON ``time`` field (AWS: ``{"action": "terminate", "time":
  "2026-11-22T08:22:00Z"}``) is the deadline; without one the grace is ``--preempt-grace``.

The grace is the seconds from now until the deadline (never negative). A notice is reported
once; the agent then drains the node (see ``NodeAgent._check_preemption``). The request never
follows redirects to another scheme and reads at most 64 KiB.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

__all__ = ["NoticePoller", "parse_headers", "parse_notice"]

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
_NO = {"", "false", "0", "no", "none", "null"}
_AZURE_KINDS = {"preempt", "terminate", "reboot"}


def _deadline(value: object) -> float | None:
    """Seconds since the epoch of an ISO-8601 or RFC 2822 timestamp; None if unreadable."""
    if not isinstance(value, str) or not value.strip():
        return None
    text = value.strip()
    try:
        dt = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        try:
            dt = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.UTC)
    return dt.timestamp()


def parse_notice(status: int, body: bytes, *, now: float, default_grace_s: float) -> float | None:
    """The grace in seconds if this response of the notice endpoint is a preemption notice."""
    if status != 200:
        return None
    text = body.decode("utf-8", "replace").strip()
    if text.lower() in _NO:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return default_grace_s  # a plain-text notice (e.g. GCP's TRUE)
    deadline: float | None = None
    if isinstance(doc, dict) and isinstance(doc.get("Events"), list):
        events = [
            e
            for e in doc["Events"]
            if isinstance(e, dict) and str(e.get("EventType", "")).lower() in _AZURE_KINDS
        ]
        if not events:
            return None
        times = [t for t in (_deadline(e.get("NotBefore")) for e in events) if t is not None]
        deadline = min(times) if times else None
    elif isinstance(doc, dict):
        deadline = _deadline(doc.get("time"))
    elif doc in (False, 0, None):
        return None
    if deadline is None:
        return default_grace_s
    return max(0.0, deadline - now)


def parse_headers(specs: Sequence[str]) -> dict[str, str]:
    """``["Name: value", ...]`` -> headers; raises ValueError naming a malformed one."""
    out = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"a notice header must be 'Name: value' (got {spec!r})")
        out[name.strip()] = value.strip()
    return out


class NoticePoller:
    """Polls the notice endpoint on a daemon thread; :attr:`grace_s` is set once a notice came."""

    def __init__(
        self, url: str, *, headers: dict[str, str], interval_s: float, default_grace_s: float
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"the notice URL must be http:// or https:// (got {url!r})")
        self.url = url
        self.headers = headers
        self.interval_s = interval_s
        self.default_grace_s = default_grace_s
        self.grace_s: float | None = None
        self.noticed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nonstop-notice", daemon=True)

    def start(self) -> NoticePoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> float | None:
        req = urllib.request.Request(self.url, headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=min(2.0, self.interval_s * 2)) as resp:
                status, body = resp.status, resp.read(MAX_BODY)
        except urllib.error.HTTPError as e:
            status, body = e.code, b""
        except (urllib.error.URLError, OSError, ValueError) as e:
            log.debug("notice endpoint %s: %s", self.url, e)
            return None
        return parse_notice(status, body, now=time.time(), default_grace_s=self.default_grace_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            grace = self.poll_once()
            if grace is not None:
                self.grace_s = grace
                self.noticed.set()
                return
            self._stop.wait(self.interval_s)
