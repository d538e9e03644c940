"""Authenticated JSON message channel over TCP: frames, keys and the client's handshake.

Wire format: each frame is ``len:u32be | mac:32 bytes | payload`` where
``payload = jlen:u32be | json | blob``: ``json`` is UTF-8 JSON of one object
(at most 1 MiB) and ``blob`` optional raw bytes (at most 64 MiB; snapshot
chunks on the data plane). ``mac = HMAC-SHA256(direction_key, seq:u64be |
payload)``; ``seq`` counts frames per direction from 0, so a replayed, dropped
or reordered frame fails verification, and each direction has its own key, so a
frame reflected back to its sender fails too. Nothing received is ever unpickled:
a blob is handed to the receiver as bytes, JSON is parsed as JSON.

Keys: the job secret never leaves the machines that hold it and never keys a
channel directly. Each purpose has its own key, ``K = HMAC(secret, "nonstop/v1/" +
purpose)`` (:func:`derive_key`): ``control`` (workers, agents and clients to the
coordinator), ``data`` (the node-to-node data plane) and ``etcd`` (the etcd root
password, :func:`etcd_password`), so a peer that learns one learns nothing of the
others, and a control client cannot open a data-plane channel or the reverse.

Handshake (before any frame; at most :data:`MAX_HANDSHAKE` bytes a message)::

    server -> client  {"nonce": Ns}
    client -> server  {"nonce": Nc, "mac": H(K, "c" | Ns | Nc), "hello": {...}}
    server -> client  {"ok": true, "mac": H(K, "s" | Nc | Ns)}  (or ok: false, then close)

Frames client -> server are keyed ``H(K, "kc" | Ns | Nc)``, server -> client
``H(K, "ks" | Ns | Nc)``. Handshake messages are length-prefixed JSON without a MAC.
The listening side is :mod:`nonstop.control.listener`.

TLS (``--tls``, :mod:`nonstop.control.tls`): the listener first sends ``{"tls": "nonstop/v1"}``
in clear, then both sides do a TLS handshake (the listener's ephemeral certificate, no chain
verified) and everything above runs inside it, with ``F`` = SHA-256 of the listener's
certificate (as the listener holds it, as the client saw it) appended to every MAC input and
key derivation: ``H(K, "c" | Ns | Nc | F)``, ``H(K, "s" | Nc | Ns | F)``, ``H(K, "kc" | Ns | Nc |
F)``, ``H(K, "ks" | Ns | Nc | F)``. A man in the middle that terminates TLS shows its own
certificate, so the MACs disagree and the handshake fails. Without TLS, ``F`` is empty: the
same bytes as before. Frame MACs stay under TLS (defence in depth; their cost is in
BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import threading
import time
from typing import Any

from nonstop.config import ENV, channel_tls_from_env
from nonstop.errors import AuthError, ControlError, UsageError

__all__ = [
    "BLOB",
    "MIN_SECRET_BYTES",
    "PURPOSES",
    "Channel",
    "connect",
    "derive_key",
    "etcd_password",
    "new_secret",
]

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20  # JSON part of a frame
MAX_BLOB = 64 << 20  # binary part of a frame
BLOB = "_blob"  # key under which recv() returns a frame's binary part
MAX_HANDSHAKE = 256 << 10  # one handshake message (the hello), before the peer is authenticated
HANDSHAKE_TIMEOUT_S = 5.0  # the whole handshake, not each read
MIN_SECRET_BYTES = 16
PURPOSES = ("control", "data", "etcd", "metrics")
Message = dict[str, Any]


def new_secret() -> bytes:
    """A fresh per-job secret (hex text, so it can live in a file or env var)."""
    return secrets.token_hex(32).encode()


def derive_key(secret: bytes, purpose: str) -> bytes:
    """The key of one ``purpose`` (:data:`PURPOSES`), derived from the job secret.

    Raises UsageError for a secret shorter than :data:`MIN_SECRET_BYTES` (a guessable one)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown key purpose {purpose!r}; one of {PURPOSES}")
    if len(secret) < MIN_SECRET_BYTES:
        raise UsageError(
            f"the job secret has {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}: use a real one "
            "(nonstop writes a fresh 64-byte one when it starts a job without --secret-file)"
        )
    return hmac.new(secret, b"nonstop/v1/" + purpose.encode(), hashlib.sha256).digest()


def etcd_password(secret: bytes) -> str:
    """The password of etcd's ``root`` user for this job: derived, so the secret itself never
    crosses the network (hex text; ``scripts/etcd.sh`` derives the same)."""
    return derive_key(secret, "etcd").hex()


def _mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    """HMAC-SHA256 of the concatenated ``parts``, fed one by one (a snapshot chunk is not copied)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic) the whole read ends by then, however
    the peer paces its bytes (a peer that drips one byte a second cannot stretch it)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlError("handshake not completed in time")
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 16))
        except TimeoutError:
            what = (
                "handshake not completed in time"
                if deadline is not None
                else "timed out waiting for the peer"
            )
            raise ControlError(what) from None
        if not chunk:
            raise ControlError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv_into(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise ControlError("timed out in the middle of a frame") from None
        if not k:
            raise ControlError("connection closed")
        got += k
    return buf


def _send_plain(sock: socket.socket, obj: Message) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_plain(sock: socket.socket, deadline: float) -> Message:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > MAX_HANDSHAKE:
        raise ControlError(f"handshake message too large ({n} bytes, limit {MAX_HANDSHAKE})")
    obj = json.loads(_recv_exact(sock, n, deadline))
    if not isinstance(obj, dict):
        raise ControlError("handshake frame is not a JSON object")
    return obj


class Channel:
    """One authenticated connection. ``send`` is thread-safe; ``recv`` is for one reader."""

    def __init__(
        self, sock: socket.socket, send_key: bytes, recv_key: bytes, hello: Message, peer: str
    ) -> None:
        self._sock = sock
        self._send_key = send_key
        self._recv_key = recv_key
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
            mac = _mac(self._send_key, struct.pack(">Q", self._send_seq), head, payload, body)
            self._send_seq += 1
            try:
                self._sock.sendall(struct.pack(">I", total) + mac + head + payload)
                if len(body):
                    self._sock.sendall(body)
            except OSError as e:  # a timeout too: a peer that stopped reading is gone
                self.closed = True
                raise ControlError(f"send failed: {e}") from e

    def recv(self) -> Message:
        """Block for the next message. Raises ControlError on close, a bad MAC, or (for a
        channel opened with ``read_timeout``) a peer silent for that long. A binary part, if
        the frame has one, is under ``msg[BLOB]`` (a memoryview of the received frame)."""
        (n,) = struct.unpack(">I", _recv_exact(self._sock, 4))
        if n > MAX_FRAME + MAX_BLOB + 4 or n < 4:
            raise ControlError(f"bad frame length {n}")
        mac = _recv_exact(self._sock, 32)
        payload = _recv_into(self._sock, n)
        expect = _mac(self._recv_key, struct.pack(">Q", self._recv_seq), payload)
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


def session_keys(key: bytes, ns: bytes, nc: bytes, binding: bytes = b"") -> tuple[bytes, bytes]:
    """(client -> server, server -> client) frame keys of one handshake (``binding``: the TLS
    certificate's fingerprint, empty without TLS)."""
    return _mac(key, b"kc", ns, nc, binding), _mac(key, b"ks", ns, nc, binding)


def _open_tls(
    sock: socket.socket, first: Message, tls: bool | None, where: str, deadline: float
) -> tuple[socket.socket, Message, bytes]:
    """After the listener's first message: TLS if it asked for it (and ``tls`` allows), the
    first message of the handshake proper, and the channel binding (b"" without TLS)."""
    if "tls" not in first:
        if tls:
            raise ControlError(
                f"the listener at {where} does not use TLS, but this process requires it (--tls, "
                f"{ENV.TLS}=1): is that job running without --tls?"
            )
        return sock, first, b""
    if tls is False:
        raise ControlError(
            f"the listener at {where} uses TLS (its job runs with --tls), but this process has it "
            f"off ({ENV.TLS}=0): unset it or start this with --tls"
        )
    from nonstop.control.tls import client_handshake

    ssock, binding = client_handshake(sock, deadline)
    return ssock, _recv_plain(ssock, deadline), binding


def connect(
    addr: tuple[str, int],
    secret: bytes,
    hello: Message,
    *,
    timeout: float = 10.0,
    purpose: str = "control",
    read_timeout: float | None = None,
    tls: bool | None = None,
) -> Channel:
    """Open an authenticated channel to a listener of ``purpose`` (module docstring).

    ``timeout`` bounds the connection and the whole handshake. ``read_timeout``: afterwards,
    a ``recv`` (or a ``send``) that makes no progress for this long raises ControlError (None:
    wait as long as it takes -- for peers whose silence a heartbeat detects). ``tls``: True
    requires TLS, False refuses it, None (default: ``NONSTOP_TLS`` of this process, else
    unset) follows the listener -- safe, since a listener with TLS refuses a client whose MAC
    does not bind its certificate, so a downgrade fails the handshake."""
    key = derive_key(secret, purpose)
    tls = channel_tls_from_env() if tls is None else tls
    deadline = time.monotonic() + timeout
    sock = socket.create_connection(addr, timeout=timeout)
    where = f"{addr[0]}:{addr[1]}"
    try:
        sock, first, binding = _open_tls(sock, _recv_plain(sock, deadline), tls, where, deadline)
        ns = bytes.fromhex(str(first["nonce"]))
        nc = secrets.token_bytes(16)
        mac = _mac(key, b"c", ns, nc, binding)
        _send_plain(sock, {"nonce": nc.hex(), "mac": mac.hex(), "hello": hello})
        reply = _recv_plain(sock, deadline)
        if not reply.get("ok"):
            raise AuthError(f"the {purpose} listener refused the connection: {reply.get('error', 'unknown')}")
        if not hmac.compare_digest(bytes.fromhex(str(reply["mac"])), _mac(key, b"s", nc, ns, binding)):
            raise AuthError(f"the {purpose} listener at {where} failed to prove it knows the job secret")
    except (OSError, KeyError, ValueError, TypeError) as e:
        sock.close()
        raise ControlError(f"handshake with {addr[0]}:{addr[1]} failed: {e}") from e
    except ControlError:
        sock.close()
        raise
    sock.settimeout(read_timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c2s, s2c = session_keys(key, ns, nc, binding)
    return Channel(sock, c2s, s2c, hello, where)
