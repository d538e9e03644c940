"""The coordinator's HTTP endpoint for operators (``nonstop run --metrics-port P``): Prometheus
``/metrics`` and the job's ``/status`` JSON (exactly what ``nonstop status --json`` shows), both
read-only, on the address the control server binds (``--host``, or ``--coordinator``'s host).

Authentication: every request carries ``Authorization: Bearer <token>``; the token is the hex of
an HMAC of the job secret under the purpose ``metrics`` (:func:`metrics_token`), written 0600 to
``<job_dir>/metrics.token`` for Prometheus' ``authorization: {credentials_file: ...}``. It is
compared in constant time; anything else is answered 401 and nothing more.

Bounds (a peer that has not authenticated holds little, and no peer holds the coordinator):

* at most :attr:`Limits.max_connections` connections are served at once; the next is closed at
  accept, before a byte is read;
* a request (its line and headers) is at most :attr:`Limits.max_request_bytes` bytes and must
  arrive within :attr:`Limits.request_timeout_s` (each read also times out): a slow or oversized
  one is dropped; one request per connection (HTTP/1.0), no body is read;
* the server runs on threads of its own; a scrape reads the snapshot the coordinator's thread
  last published (:class:`~nonstop.coordinator.metrics.StatusBoard`: at most one fresh status per
  0.25 s however many scrape), never the coordinator's state.

Nothing received is ever unpickled or evaluated: a request is its method, path and headers.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST

from nonstop.control.channel import derive_key
from nonstop.control.secret import write_secret
from nonstop.coordinator.metrics import JobMonitor
from nonstop.errors import UsageError
from nonstop.events.log import EventLog

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["TOKEN_FILE", "Limits", "StatusServer", "metrics_token", "start_status_server"]

log = logging.getLogger(__name__)

TOKEN_FILE = "metrics.token"  # <job_dir>/metrics.token: the bearer token, 0600


def metrics_token(secret: bytes) -> str:
    """The bearer token of a job's metrics endpoint: the job secret's key for the purpose
    ``metrics`` (:func:`nonstop.control.channel.derive_key`), in hex."""
    return derive_key(secret, "metrics").hex()


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_connections: int = 16
    request_timeout_s: float = 5.0  # the whole request line and headers
    max_request_bytes: int = 8192


class _CappedReader:
    """A request's input: at most ``cap`` bytes, until ``deadline``; then end of input (the
    request parser sees a truncated request and answers 400, or gives up)."""

    def __init__(self, raw: io.BufferedIOBase, cap: int, deadline: float) -> None:
        self._raw, self._left, self._deadline = raw, cap, deadline
        self.cut = False  # the cap or the deadline ended the input

    @property
    def exhausted(self) -> bool:
        return self.cut or self._left <= 0

    def _room(self, size: int) -> int:
        if self._left <= 0 or time.monotonic() > self._deadline:
            self.cut = True
            return 0
        return self._left if size is None or size < 0 else min(size, self._left)

    def readline(self, size: int = -1) -> bytes:
        n = self._room(size)
        if n == 0:
            return b""
        line = self._raw.readline(n)
        self._left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        n = self._room(size)
        if n == 0:
            return b""
        data = self._raw.read(n)
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._raw.close()


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    protocol_version = "HTTP/1.0"  # one request per connection
    server_version = "nonstop"
    sys_version = ""

    def setup(self) -> None:
        lim = self.server.limits
        self.request.settimeout(lim.request_timeout_s)  # each read of the socket
        super().setup()
        self.rfile = _CappedReader(  # type: ignore[assignment]
            self.rfile, lim.max_request_bytes, time.monotonic() + lim.request_timeout_s
        )

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        reader = self.rfile
        if isinstance(reader, _CappedReader) and reader.exhausted:
            self.send_error(431, "request too large or too slow")
            return False
        return True

    def _send(self, code: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _authorized(self) -> bool:
        got = self.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), self.server.token)
        return ok and scheme.lower() == "bearer"

    def do_GET(self) -> None:
        if not self._authorized():
            self.server.refused += 1
            self._send(401, b"unauthorized\n", "text/plain", {"WWW-Authenticate": 'Bearer realm="nonstop"'})
            return
        path = self.path.partition("?")[0]
        if path == "/metrics":
            self._send(200, self.server.monitor.metrics.exposition(), CONTENT_TYPE_LATEST)
        elif path == "/status":
            st = self.server.monitor.status()
            if st is None:
                self._send(503, b'{"error": "the coordinator has not answered yet"}\n', "application/json")
            else:
                self._send(200, json.dumps(st, indent=2).encode() + b"\n", "application/json")
        else:
            self._send(404, b"not found: /metrics or /status\n", "text/plain")

    do_HEAD = do_GET


class StatusServer(ThreadingHTTPServer):
    """``/metrics`` and ``/status`` of one job (see the module docstring); serves on a thread of
    its own from construction until :meth:`close`."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self, *, host: str, port: int, token: str, monitor: JobMonitor, limits: Limits | None = None
    ) -> None:
        self.token = token.encode()
        self.monitor = monitor
        self.limits = limits or Limits()
        self.refused = 0  # requests answered 401
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.address_family = family
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="nonstop-metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return (str(host), int(port))

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: a request from %s failed", client_address, exc_info=True)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: closed before a byte is read
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def job_info(self, job_dir: Path) -> dict[str, str]:
        """What the job-info file (``<job_dir>/job.json``) says of this server."""
        host, port = self.address
        return {"metrics": f"{host}:{port}", "metrics_token_file": str(job_dir / TOKEN_FILE)}

    def close(self, job_dir: Path | None = None) -> None:
        """Stop serving (and remove ``job_dir``'s token file)."""
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5.0)
        if job_dir is not None:
            (job_dir / TOKEN_FILE).unlink(missing_ok=True)


def start_status_server(
    c: Coordinator, *, events: EventLog, secret: bytes, job_dir: Path
) -> StatusServer | None:
    """With ``--metrics-port``: hook a :class:`JobMonitor` into ``c`` and its event log, write
    the token file, serve. None without the flag. UsageError for a port that cannot be bound."""
    port = c.config.operations.metrics_port
    if port is None:
        return None
    monitor = JobMonitor(c.status)
    host = c.config.coordinator_addr[0]
    token = metrics_token(secret)
    try:
        server = StatusServer(host=host, port=port, token=token, monitor=monitor)
    except OSError as e:
        raise UsageError(
            f"cannot serve metrics on {host}:{port} ({e.strerror or e}): choose another --metrics-port"
        ) from None
    try:
        write_secret(job_dir / TOKEN_FILE, token.encode())
    except BaseException:
        server.close()
        raise
    events.subscribe(monitor.metrics.on_event)
    c.monitor = monitor
    return server
