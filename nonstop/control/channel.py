"""Authenticated JSON message channel over TCP.

Wire format: each frame is ``len:u32be | mac:32 bytes | payload`` where
``payload = jlen:u32be | json | blob``: ``json`` is UTF-8 JSON of one object
(at most 1 MiB) and ``blob`` optional raw bytes (at most 64 MiB; snapshot
chunks on the data plane). ``mac = HMAC-SHA256(session_key, seq:u64be |
payload)``; ``seq`` counts frames per direction from 0, so a replayed, dropped
or reordered frame fails verification. Nothing received is ever unpickled: a
blob is handed to the receiver as bytes, JSON is parsed as JSON.

Handshake (before any frame)::

    server -> client  {"nonce": Ns}
    client -> server  {"nonce": Nc, "mac": H(secret, "c" | Ns | Nc), "hello": {...}}
    server -> client  {"ok": true, "mac": H(secret, "s" | Nc | Ns)}  (or ok: false, then close)

``session_key = H(secret, "k" | Ns | Nc)``. Handshake messages are length-
prefixed JSON without a MAC.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import queue
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from nonstop.errors import AuthError, ControlError, UsageError

__all__ = ["BLOB", "Channel", "ControlServer", "connect", "new_secret"]

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20  # JSON part of a frame
MAX_BLOB = 64 << 20  # binary part of a frame
BLOB = "_blob"  # key under which recv() returns a frame's binary part
HANDSHAKE_TIMEOUT_S = 5.0
Message = dict[str, Any]


def new_secret() -> bytes:
    """A fresh per-job secret (hex text, so it can live in a file or env var)."""
    return secrets.token_hex(32).encode()


def _mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenated ``parts``, fed one by one (a snapshot chunk is not copied)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ControlError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv_into(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ControlError("connection closed")
        got += k
    return buf


def _send_plain(sock: socket.socket, obj: Message) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_plain(sock: socket.socket) -> Message:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ControlError(f"handshake frame too large ({n} bytes)")
    obj = json.loads(_recv_exact(sock, n))
    if not isinstance(obj, dict):
        raise ControlError("handshake frame is not a JSON object")
    return obj


class Channel:
    """One authenticated connection. ``send`` is thread-safe; ``recv`` is for one reader."""

    def __init__(self, sock: socket.socket, key: bytes, hello: Message, peer: str) -> None:
        self._sock = sock
        self._key = key
        self._send_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self.hello = hello
        self.peer = peer
        self.closed = False
        self.tag: Any = None  # owner's bookkeeping (e.g. which worker this is)

    def send(self, msg: Message, blob: bytes | bytearray | memoryview | None = None) -> None:
        """Send one message, with an optional binary part (returned by ``recv`` under BLOB)."""
        payload = json.dumps(msg, separators=(",", ":")).encode()
        if len(payload) > MAX_FRAME:
            raise ControlError(f"message too large ({len(payload)} bytes)")
        body = memoryview(b"") if blob is None else memoryview(blob).cast("B")
        if len(body) > MAX_BLOB:
            raise ControlError(f"binary part too large ({len(body)} bytes, limit {MAX_BLOB})")
        head = struct.pack(">I", len(payload))
        total = len(head) + len(payload) + len(body)
        with self._send_lock:
            mac = _mac(self._key, struct.pack(">Q", self._send_seq), head, payload, body)
            self._send_seq += 1
            try:
                self._sock.sendall(struct.pack(">I", total) + mac + head + payload)
                if len(body):
                    self._sock.sendall(body)
            except OSError as e:
                self.closed = True
                raise ControlError(f"send failed: {e}") from e

    def recv(self) -> Message:
        """Block for the next message. Raises ControlError on close or a bad MAC.
        A binary part, if the frame has one, is under ``msg[BLOB]`` (bytearray)."""
        (n,) = struct.unpack(">I", _recv_exact(self._sock, 4))
        if n > MAX_FRAME + MAX_BLOB + 4 or n < 4:
            raise ControlError(f"bad frame length {n}")
        mac = _recv_exact(self._sock, 32)
        payload = _recv_into(self._sock, n)
        expect = _mac(self._key, struct.pack(">Q", self._recv_seq), payload)
        if not hmac.compare_digest(mac, expect):
            raise AuthError(f"bad message MAC from {self.peer}; dropping the connection")
        self._recv_seq += 1
        (jlen,) = struct.unpack_from(">I", payload)
        if jlen > MAX_FRAME or 4 + jlen > n:
            raise ControlError(f"bad JSON length {jlen} in a frame of {n} bytes")
        obj = json.loads(bytes(payload[4 : 4 + jlen]))
        if not isinstance(obj, dict):
            raise ControlError("frame is not a JSON object")
        if n > 4 + jlen:
            obj[BLOB] = memoryview(payload)[4 + jlen :]
        return obj

    def close(self) -> None:
        self.closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def connect(addr: tuple[str, int], secret: bytes, hello: Message, *, timeout: float = 10.0) -> Channel:
    """Open an authenticated channel to a :class:`ControlServer`."""
    sock = socket.create_connection(addr, timeout=timeout)
    try:
        ns = bytes.fromhex(str(_recv_plain(sock)["nonce"]))
        nc = secrets.token_bytes(16)
        _send_plain(sock, {"nonce": nc.hex(), "mac": _mac(secret, b"c", ns, nc).hex(), "hello": hello})
        reply = _recv_plain(sock)
        if not reply.get("ok"):
            raise AuthError(f"coordinator refused the connection: {reply.get('error', 'unknown')}")
        if not hmac.compare_digest(bytes.fromhex(str(reply["mac"])), _mac(secret, b"s", nc, ns)):
            raise AuthError("coordinator failed to prove it knows the job secret")
    except (OSError, KeyError, ValueError) as e:
        sock.close()
        raise ControlError(f"handshake with {addr[0]}:{addr[1]} failed: {e}") from e
    except ControlError:
        sock.close()
        raise
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Channel(sock, _mac(secret, b"k", ns, nc), hello, f"{addr[0]}:{addr[1]}")


class ControlServer:
    """Accepts authenticated channels and feeds their messages into one queue.

    Events put on ``events``: ``("open", channel, None)``, ``("msg", channel,
    message)`` and ``("close", channel, None)``. A peer that fails the handshake
    is refused, logged through ``on_refused`` and never reaches the queue.
    """

    def __init__(
        self, *, host: str, port: int, secret: bytes, on_refused: Callable[[str, str], None] | None = None
    ) -> None:
        self._secret = secret
        self.events: queue.Queue[tuple[str, Channel, Message | None]] = queue.Queue()
        self._on_refused = on_refused
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
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="nonstop-control", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), name="nonstop-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            ns = secrets.token_bytes(16)
            _send_plain(sock, {"nonce": ns.hex()})
            hello_msg = _recv_plain(sock)
            nc = bytes.fromhex(str(hello_msg["nonce"]))
            good = hmac.compare_digest(bytes.fromhex(str(hello_msg["mac"])), _mac(self._secret, b"c", ns, nc))
            if not good:
                _send_plain(sock, {"ok": False, "error": "authentication failed"})
                raise AuthError("wrong job secret")
            _send_plain(sock, {"ok": True, "mac": _mac(self._secret, b"s", nc, ns).hex()})
            hello = hello_msg.get("hello")
            if not isinstance(hello, dict):
                raise ControlError("hello missing")
        except (OSError, KeyError, ValueError, ControlError) as e:
            if self._on_refused is not None:
                self._on_refused(peer, str(e))
            log.warning("refused control connection from %s: %s", peer, e)
            sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ch = Channel(sock, _mac(self._secret, b"k", ns, nc), hello, peer)
        with self._lock:
            self._channels.add(ch)
        self.events.put(("open", ch, None))
        try:
            while True:
                self.events.put(("msg", ch, ch.recv()))
        except (ControlError, OSError, ValueError):
            pass
        finally:
            ch.closed = True
            with self._lock:
                self._channels.discard(ch)
            self.events.put(("close", ch, None))

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            chans = list(self._channels)
        for ch in chans:
            ch.close()
