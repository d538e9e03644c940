"""etcd's JSON gateway as nonstop speaks it: encodings, error shapes, the socket options of a
stream (shared by :mod:`nonstop.control.etcd` and :mod:`nonstop.control.etcdwatch`)."""

from __future__ import annotations

import base64
import socket
from typing import Any

from nonstop.control.store import KeyValue

API_PREFIX = "/v3"
NOT_FOUND = 5  # gRPC status codes etcd answers with
PERMISSION_DENIED = 7
UNAVAILABLE = 14
UNAUTHENTICATED = 16
Json = dict[str, Any]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object) -> bytes:
    return base64.b64decode(str(text)) if text else b""


def key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def key_text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def prefix_range(prefix: str) -> Json:
    """The range request fields selecting every key that starts with ``prefix``."""
    start = key_bytes(prefix)
    end = start.rstrip(b"\xff")
    if not end:  # "" (or only 0xff bytes): etcd's "from key to the end" convention
        return {"key": b64(start or b"\0"), "range_end": b64(b"\0")}
    return {"key": b64(start), "range_end": b64(end[:-1] + bytes([end[-1] + 1]))}


def header_revision(obj: Json) -> int:
    return int(obj.get("header", {}).get("revision", 0))


def keyvalue(kv: Json) -> KeyValue:
    return KeyValue(
        key=key_text(unb64(kv.get("key"))),
        value=unb64(kv.get("value")),
        mod_revision=int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def error_of(status: int, obj: Json) -> tuple[int, str] | None:
    """(gRPC code, message) if the gateway answered with an error, else None."""
    err = obj.get("error")
    if isinstance(err, dict):  # the shape streaming endpoints (keepalive, watch) use
        return int(err.get("grpc_code") or err.get("code") or 2), str(err.get("message", ""))
    if status != 200 or "code" in obj:
        return int(obj.get("code") or 2), str(obj.get("message") or err or f"HTTP status {status}")
    return None


def tcp_keepalive(sock: socket.socket) -> None:
    """Notice a silent peer on an idle stream in about 5 + 3 * 2 = 11 s (Linux knobs)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
