"""The listening side of :mod:`nonstop.control.channel`: one server, bounded against floods.

What an unauthenticated peer can hold, and for how long:

* at most ``max_pending`` connections in the handshake at once (one thread and at most
  :data:`~nonstop.control.channel.MAX_HANDSHAKE` bytes each); the next is closed at once;
* each for at most ``handshake_timeout_s`` in all (a total deadline: dripping a byte at a
  time does not stretch it);
* a wrong secret, garbage or a slow handshake costs only that connection.

The accept loop never ends on an error while the server is open: ``accept`` failures
(out of file descriptors, a connection reset before it was accepted) are retried with
back-off, and when the process is out of descriptors a reserved one is released to
accept and close the waiting connection, so the backlog drains and the listener comes
back as soon as descriptors are free. Refusals reach ``on_refused`` rate-limited
(:class:`RefusalLimiter`): a flood writes a handful of lines and a count, not a line per
connection; a wrong secret is reported before the peer is told, so whoever sees the refusal
finds it recorded. Authenticated peers are not limited here: their silence is the detector's
business (heartbeats), and a client that waits on one passes ``read_timeout``.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from nonstop.config import channel_tls_from_env
from nonstop.control.channel import (
    HANDSHAKE_TIMEOUT_S,
    Channel,
    Message,
    _mac,
    _recv_plain,
    _send_plain,
    derive_key,
    session_keys,
)
from nonstop.control.tls import PREAMBLE, ListenerCert, listener_cert, server_handshake
from nonstop.errors import AuthError, ControlError, UsageError

__all__ = ["ControlServer", "ListenerLimits", "RefusalLimiter"]

log = logging.getLogger(__name__)

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Reported(Exception):
    """A handshake refused and already reported (:meth:`ControlServer._refuse`): only close."""


@dataclass(frozen=True)
class ListenerLimits:
    """What unauthenticated peers may hold (module docstring)."""

    max_pending: int = 64
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    refusals_per_window: int = 10  # refusals reported one by one per window; the rest are counted
    refusal_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_pending < 1 or self.handshake_timeout_s <= 0 or self.refusal_window_s <= 0:
            raise ValueError(f"bad listener limits {self}")


class RefusalLimiter:
    """Rate-limits refusal reports: the first ``burst`` of each window one by one, then a count.

    :meth:`refused` returns the report to make now (None: counted silently); :meth:`flush`
    returns the count of a window that ended with refusals unreported. Thread-safe; ``clock``
    is injectable for tests."""

    def __init__(self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = burst
        self._window_s = window_s
        self._clock = clock
        self._start = clock()
        self._count = 0
        self._hidden = 0
        self._lock = threading.Lock()

    def refused(self, reason: str) -> str | None:
        with self._lock:
            carried = self._roll()
            self._count += 1
            if self._count <= self._burst:
                return reason if carried is None else f"{reason} ({carried})"
            self._hidden += 1
            return None

    def flush(self) -> str | None:
        with self._lock:
            return self._roll()

    def _roll(self) -> str | None:
        now = self._clock()
        if now - self._start < self._window_s:
            return None
        hidden, self._hidden, self._count, self._start = self._hidden, 0, 0, now
        if not hidden:
            return None
        window = f"{self._window_s:g} s"
        return f"{hidden} more connection(s) refused in the previous {window}, not reported one by one"


class ControlServer:
    """Accepts authenticated channels of one ``purpose`` and feeds their messages into one queue.

    Events put on ``events``: ``("open", channel, None)``, ``("msg", channel, message)`` and
    ``("close", channel, None)``. A peer that fails the handshake is refused, reported
    through ``on_refused(peer, reason)`` (rate-limited) and never reaches the queue. Binds
    exactly ``host:port`` (a busy port or a bad host is a UsageError). ``tls`` (default: this
    process's ``NONSTOP_TLS``): every connection is TLS with this process's ephemeral
    certificate, bound to the handshake (:mod:`nonstop.control.tls`)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        secret: bytes,
        on_refused: Callable[[str, str], None] | None = None,
        purpose: str = "control",
        limits: ListenerLimits | None = None,
        tls: bool | None = None,
    ) -> None:
        self._key = derive_key(secret, purpose)
        self._tls: ListenerCert | None = listener_cert() if (tls or channel_tls_from_env()) else None
        self.purpose = purpose
        self.limits = limits or ListenerLimits()
        self.events: queue.Queue[tuple[str, Channel, Message | None]] = queue.Queue()
        self._on_refused = on_refused
        self._refusals = RefusalLimiter(self.limits.refusals_per_window, self.limits.refusal_window_s)
        self._pending = threading.BoundedSemaphore(self.limits.max_pending)
        self._stop = threading.Event()
        self._channels: set[Channel] = set()
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            if e.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"port {port} on {host} is already in use: pick another with --port, or --port 0 "
                    "for a free one"
                ) from e
            raise UsageError(f"cannot listen on {host}:{port} ({e.strerror}): check --host") from e
        self._sock.listen(128)
        self._sock.settimeout(0.5)  # the loop wakes to see close() and to report counted refusals
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._reserve: int | None = os.open(os.devnull, os.O_RDONLY)
        self._thread = threading.Thread(target=self._accept_loop, name=f"nonstop-{purpose}", daemon=True)
        self._thread.start()

    # -- accepting -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except TimeoutError:
                self._report(None, self._refusals.flush())
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                if e.errno in _OUT_OF_FDS:
                    self._shed()
                backoff = min(1.0, max(0.01, backoff * 2))
                self._refuse("(accept)", f"accept failed ({e.strerror or e}); retrying in {backoff:g} s")
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            peer = f"{addr[0]}:{addr[1]}"
            if not self._pending.acquire(blocking=False):
                sock.close()
                self._refuse(peer, f"{self.limits.max_pending} connections already in the handshake")
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock, peer), name="nonstop-conn", daemon=True
                ).start()
            except RuntimeError as e:  # no thread to be had: this connection only
                self._pending.release()
                sock.close()
                self._refuse(peer, f"cannot start a thread for it ({e})")

    def _shed(self) -> None:
        """Out of descriptors: free the reserved one, accept and close one waiting connection
        (it would otherwise sit in the backlog and fail every accept), take the reserve back."""
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
        try:
            sock, _ = self._sock.accept()
            sock.close()
        except OSError:
            pass
        try:
            self._reserve = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            self._reserve = None

    def _refuse(self, peer: str, reason: str) -> None:
        self._report(peer, self._refusals.refused(reason))

    def _report(self, peer: str | None, reason: str | None) -> None:
        if reason is None:
            return
        log.warning("%s listener refused %s: %s", self.purpose, peer or "connections", reason)
        if self._on_refused is not None:
            try:
                self._on_refused(peer or "*", reason)
            except Exception as e:  # a failing report must not stop the listener
                log.warning("reporting a refused connection failed: %s", e)

    # -- one connection --------------------------------------------------------------------
    def _handshake(
        self, sock: socket.socket, peer: str
    ) -> tuple[socket.socket, bytes, bytes, Message, bytes]:
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        sock.settimeout(self.limits.handshake_timeout_s)
        if self._tls is None:
            return (sock, *self._authenticate(sock, deadline, b"", peer))
        _send_plain(sock, PREAMBLE)
        ssock = server_handshake(sock, self._tls, deadline)
        try:
            return (ssock, *self._authenticate(ssock, deadline, self._tls.fingerprint, peer))
        except BaseException:
            ssock.close()
            raise

    def _authenticate(
        self, sock: socket.socket, deadline: float, binding: bytes, peer: str
    ) -> tuple[bytes, bytes, Message, bytes]:
        ns = secrets.token_bytes(16)
        _send_plain(sock, {"nonce": ns.hex()})
        hello_msg = _recv_plain(sock, deadline)
        nc = bytes.fromhex(str(hello_msg["nonce"]))
        if len(nc) != 16:
            raise ControlError("bad client nonce")
        expect = _mac(self._key, b"c", ns, nc, binding)
        if not hmac.compare_digest(bytes.fromhex(str(hello_msg["mac"])), expect):
            err = AuthError("wrong job secret" + (", or a man in the middle of TLS" if binding else ""))
            # reported before the peer is told: whoever waits on the refusal finds it recorded
            self._refuse(peer, str(err))
            try:
                _send_plain(sock, {"ok": False, "error": "authentication failed"})
            except OSError:
                pass  # the peer is gone: it was refused all the same
            raise _Reported(err)
        hello = hello_msg.get("hello")
        if not isinstance(hello, dict):
            raise ControlError("hello missing")
        _send_plain(sock, {"ok": True, "mac": _mac(self._key, b"s", nc, ns, binding).hex()})
        return ns, nc, hello, binding

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock, ns, nc, hello, binding = self._handshake(sock, peer)
        except _Reported:
            sock.close()
            return
        except (OSError, KeyError, ValueError, TypeError, ControlError) as e:
            self._refuse(peer, str(e) or type(e).__name__)
            sock.close()
            return
        finally:
            self._pending.release()
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c2s, s2c = session_keys(self._key, ns, nc, binding)
        ch = Channel(sock, s2c, c2s, hello, peer)
        with self._lock:
            if self._stop.is_set():
                ch.close()
                return
            self._channels.add(ch)
        self.events.put(("open", ch, None))
        try:
            while True:
                self.events.put(("msg", ch, ch.recv()))
        except (ControlError, OSError, ValueError, RecursionError):
            pass
        finally:
            ch.closed = True
            with self._lock:
                self._channels.discard(ch)
            self.events.put(("close", ch, None))

    def close(self) -> None:
        """Stop accepting and close every channel (their readers put ``close`` events)."""
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            chans = list(self._channels)
        for ch in chans:
            ch.close()
        if self._reserve is not None:
            try:
                os.close(self._reserve)
            except OSError:
                pass
            self._reserve = None
