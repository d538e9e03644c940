"""The control store on an etcd v3 server, through etcd's JSON gateway (standard library only).

etcd serves its gRPC API as JSON over HTTP/1.1 at ``/v3/...`` (3.4 also at ``/v3beta/``, which
3.5 dropped; ``/v3/`` works on both). Keys and values travel base64-encoded, 64-bit integers as
decimal strings. Nothing read from the server is unpickled: it is parsed as JSON.

Authentication: with a ``password``, the client logs in as ``user`` (``root``) through
``/v3/auth/authenticate`` and sends the token it gets in the ``Authorization`` header. A token
etcd no longer accepts (it expired, or etcd restarted) is replaced by logging in again once,
then the request is repeated; a refused password raises :class:`~nonstop.errors.AuthError`.

Connections: unary calls share a small pool of keep-alive connections. An endpoint that
refuses the connection is skipped for the next one (several endpoints: ``etcd://a:1,b:2``);
a pooled connection the server had closed is replaced and the request sent once more. A
request that was sent and then lost (timeout, reset) is not repeated: it raises
:class:`~nonstop.errors.ControlError` naming the URL, since it may have been applied.

Watches: each watch has its own streaming connection and a daemon reader thread feeding the
:class:`~nonstop.control.store.Watch`. A broken stream (etcd restarted, connection reset, or
silent peer detected by TCP keepalive in about 11 s) is reconnected transparently from the
revision after the last event delivered, so no event is lost or repeated; if etcd stays
unreachable for ``watch_retry_s`` seconds, or its history was compacted past that revision,
``Watch.get`` raises ControlError.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import socket
import threading
import time
from typing import Any

from nonstop.control.store import KeyValue, Lease, Watch, WatchEvent
from nonstop.errors import AuthError, ControlError, UsageError

__all__ = ["API_PREFIX", "NO_AUTH_ENV", "EtcdStore", "parse_etcd_url"]

log = logging.getLogger(__name__)

API_PREFIX = "/v3"
MALFORMED_LIMIT = 3  # malformed watch answers at one revision before the watch fails
NO_AUTH_ENV = "NONSTOP_ETCD_NO_AUTH"  # "1": accept an etcd with authentication disabled
_NOT_FOUND = 5  # gRPC status codes etcd answers with
_PERMISSION_DENIED = 7
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16
_MAX_IDLE = 4  # pooled keep-alive connections
_Json = dict[str, Any]


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> endpoints. Raises UsageError if malformed."""
    scheme, sep, rest = url.partition("://")
    endpoints: list[tuple[str, int]] = []
    for part in rest.rstrip("/").split(",") if scheme == "etcd" and sep else []:
        host, colon, port = part.strip().rpartition(":")
        if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
            endpoints = []
            break
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise UsageError(f"bad etcd URL {url!r}: expected etcd://HOST:PORT[,HOST:PORT...]")
    return endpoints


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    return base64.b64decode(str(text)) if text else b""


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _key_text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _prefix_range(prefix: str) -> _Json:
    """The range request fields selecting every key that starts with ``prefix``."""
    start = _key_bytes(prefix)
    end = start.rstrip(b"\xff")
    if not end:  # "" (or only 0xff bytes): etcd's "from key to the end" convention
        return {"key": _b64(start or b"\0"), "range_end": _b64(b"\0")}
    return {"key": _b64(start), "range_end": _b64(end[:-1] + bytes([end[-1] + 1]))}


def _header_revision(obj: _Json) -> int:
    return int(obj.get("header", {}).get("revision", 0))


def _keyvalue(kv: _Json) -> KeyValue:
    return KeyValue(
        key=_key_text(_unb64(kv.get("key"))),
        value=_unb64(kv.get("value")),
        mod_revision=int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _error_of(status: int, obj: _Json) -> tuple[int, str] | None:
    """(gRPC code, message) if the gateway answered with an error, else None."""
    err = obj.get("error")
    if isinstance(err, dict):  # the shape streaming endpoints (keepalive, watch) use
        return int(err.get("grpc_code") or err.get("code") or 2), str(err.get("message", ""))
    if status != 200 or "code" in obj:
        return int(obj.get("code") or 2), str(obj.get("message") or err or f"HTTP status {status}")
    return None


def _tcp_keepalive(sock: socket.socket) -> None:
    """Notice a silent peer on an idle stream in about 5 + 3 * 2 = 11 s (Linux knobs)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class EtcdStore:
    """A :class:`~nonstop.control.store.ControlStore` on etcd v3 (tested against 3.4).

    Connects, and logs in as ``user`` with ``password`` (for a job: :func:`~nonstop.control.
    channel.etcd_password`, derived from the job secret) before returning: an unreachable
    server raises ControlError naming the URL, a refused password AuthError, and a server
    with authentication disabled AuthError too (anyone who reaches it could rewrite the
    job's state) unless ``allow_no_auth``. ``timeout`` bounds each
    request and the wait for a watch to be established. Thread-safe. Lease TTLs are whole
    seconds, at least etcd's minimum (1 s with ``scripts/etcd.sh``'s election timeout); etcd
    deletes an expired lease's keys within about 0.5 s after the TTL runs out.
    """

    def __init__(
        self,
        url: str,
        *,
        password: str | None,
        user: str = "root",
        allow_no_auth: bool = False,
        timeout: float = 5.0,
        watch_retry_s: float = 10.0,
    ) -> None:
        self._endpoints = parse_etcd_url(url)
        self.url = url
        self._password = password
        self._allow_no_auth = allow_no_auth
        self._user = user
        self.timeout = timeout
        self.watch_retry_s = watch_retry_s
        self._lock = threading.Lock()  # endpoint choice, connection pool, streams, closed
        self._current = 0
        self._idle: list[tuple[int, http.client.HTTPConnection]] = []
        self._streams: set[_WatchStream] = set()
        self._closed = False
        self._auth_lock = threading.Lock()
        self._token: str | None = None
        try:
            if password is not None:
                self._authenticate(stale=None)
            else:
                self.revision()
        except BaseException:
            self.close()
            raise

    # -- reads -------------------------------------------------------------------------------

    def revision(self) -> int:
        return _header_revision(self._call("kv/range", {"key": _b64(b"\0"), "count_only": True}))

    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("kv/range", {"key": _b64(_key_bytes(key))}).get("kvs") or []
        return _keyvalue(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        body = {**_prefix_range(prefix), "sort_order": "ASCEND", "sort_target": "KEY"}
        return [_keyvalue(kv) for kv in self._call("kv/range", body).get("kvs") or []]

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return _header_revision(self._call("kv/put", self._put_request(key, value, lease)))

    def put_if(self, key: str, value: bytes, *, expect_revision: int, lease: int = 0) -> int | None:
        compare = {
            "key": _b64(_key_bytes(key)),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(expect_revision),
        }
        body = {"compare": [compare], "success": [{"request_put": self._put_request(key, value, lease)}]}
        obj = self._call("kv/txn", body)
        return _header_revision(obj) if obj.get("succeeded") else None

    def delete(self, key: str) -> bool:
        return int(self._call("kv/deleterange", {"key": _b64(_key_bytes(key))}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call("kv/deleterange", _prefix_range(prefix)).get("deleted", 0))

    @staticmethod
    def _put_request(key: str, value: bytes, lease: int) -> _Json:
        body: _Json = {"key": _b64(_key_bytes(key)), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return body

    # -- leases ------------------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> Lease:
        if not ttl > 0:
            raise ValueError(f"lease TTL must be > 0 seconds, got {ttl}")
        obj = self._call("lease/grant", {"TTL": str(math.ceil(ttl)), "ID": "0"})
        if obj.get("error"):
            raise ControlError(f"etcd at {self.url} refused a {ttl:g} s lease: {obj['error']}")
        return Lease(int(obj["ID"]), float(obj["TTL"]))

    def keepalive(self, lease: int) -> bool:
        # One request on etcd's keepalive stream: the gateway answers it and ends the stream.
        obj = self._call("lease/keepalive", {"ID": str(lease)})
        return int(obj.get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        self._call("lease/revoke", {"ID": str(lease)}, tolerate=_NOT_FOUND)

    # -- watches -----------------------------------------------------------------------------

    def watch(self, key: str, *, start_revision: int = 0) -> Watch:
        return self._watch({"key": _b64(_key_bytes(key))}, repr(key), start_revision)

    def watch_prefix(self, prefix: str, *, start_revision: int = 0) -> Watch:
        return self._watch(_prefix_range(prefix), f"prefix {prefix!r}", start_revision)

    def _watch(self, selector: _Json, what: str, start_revision: int) -> Watch:
        if start_revision < 0:
            raise ValueError(f"start_revision must be >= 0, got {start_revision}")
        stream = _WatchStream(self, selector, what, start_revision)
        with self._lock:
            self._check_open()
            self._streams.add(stream)
        return stream.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            streams, self._streams = list(self._streams), set()
        for _, conn in idle:
            conn.close()
        for stream in streams:
            stream.handle.fail(ControlError(f"the control store at {self.url} was closed"))
            stream.stop()

    # -- requests ----------------------------------------------------------------------------

    def _call(self, method: str, body: _Json, *, tolerate: int | None = None) -> _Json:
        """POST ``body`` to ``/v3/<method>``; the answer, or raise ControlError / AuthError.
        An error with code ``tolerate`` is returned as an empty answer instead."""
        path = f"{API_PREFIX}/{method}"
        deadline = time.monotonic() + self.timeout
        relogged = False
        while True:
            token = self._token
            status, obj = self._post(path, body, token)
            err = _error_of(status, obj)
            if err is None:
                return obj
            code, message = err
            if code == tolerate:
                return {}
            if code == _UNAUTHENTICATED and self._password is not None and not relogged:
                self._authenticate(stale=token)
                relogged = True
                continue
            if code == _UNAVAILABLE and time.monotonic() < deadline:  # no leader yet
                time.sleep(0.05)
                continue
            raise self._refusal(path, code, message)

    def _refusal(self, path: str, code: int, message: str) -> ControlError:
        if code in (_UNAUTHENTICATED, _PERMISSION_DENIED) or "user name is empty" in message:
            hint = "open it with the job secret" if self._password is None else "check the job secret"
            return AuthError(f"etcd at {self.url} refused {path}: {message}; {hint}")
        return ControlError(f"etcd at {self.url} failed {path}: {message} (gRPC code {code})")

    def _authenticate(self, *, stale: str | None) -> None:
        """Log in, unless another thread already replaced the token ``stale``."""
        assert self._password is not None
        with self._auth_lock:
            if self._token != stale:
                return
            path = f"{API_PREFIX}/auth/authenticate"
            status, obj = self._post(path, {"name": self._user, "password": self._password}, None)
            err = _error_of(status, obj)
            if err is None:
                self._token = str(obj["token"])
                return
            code, message = err
            if "authentication is not enabled" in message:
                if not self._allow_no_auth:
                    raise AuthError(
                        f"etcd at {self.url} has authentication disabled, so anyone who reaches it "
                        "could rewrite this job's state: enable it (scripts/etcd.sh start does) or "
                        f"set {NO_AUTH_ENV}=1 to run without"
                    )
                log.warning("etcd at %s does not have authentication enabled; anyone can change it", self.url)
                return
            if code in (3, _PERMISSION_DENIED, _UNAUTHENTICATED) or "authentication failed" in message:
                raise AuthError(
                    f"etcd at {self.url} refused user {self._user!r}: {message}; check the job secret"
                )
            raise ControlError(f"etcd at {self.url} failed {path}: {message} (gRPC code {code})")

    def _post(self, path: str, body: _Json, token: str | None) -> tuple[int, _Json]:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        refused: list[str] = []
        while True:
            index, conn, reused = self._checkout()
            host, port = self._endpoints[index]
            if not reused:
                try:
                    conn.connect()
                except OSError as e:
                    conn.close()
                    refused.append(f"{host}:{port}: {e}")
                    self._next_endpoint(index)
                    if len(refused) == len(self._endpoints):
                        raise ControlError(
                            f"etcd at {self.url} is unreachable ({'; '.join(refused)}); is it running? "
                            "(scripts/etcd.sh start DATA_DIR PORT SECRET_FILE)"
                        ) from e
                    continue
            try:
                conn.request("POST", path, data, headers)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and not isinstance(e, TimeoutError):
                    self._drop_idle()  # the server closed an idle connection: once more on a new one
                    continue
                self._next_endpoint(index)
                what = f"did not answer within {self.timeout:g} s" if isinstance(e, TimeoutError) else e
                raise ControlError(f"etcd at {self.url} ({host}:{port}): {path} lost: {what}") from e
            self._checkin(index, conn, resp)
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise ControlError(f"etcd at {self.url} answered {path} with non-JSON: {raw[:200]!r}") from e
            if not isinstance(obj, dict):
                raise ControlError(f"etcd at {self.url} answered {path} with {type(obj).__name__}")
            return resp.status, obj

    def _check_open(self) -> None:
        if self._closed:
            raise ControlError(f"the control store at {self.url} is closed")

    def _checkout(self) -> tuple[int, http.client.HTTPConnection, bool]:
        with self._lock:
            self._check_open()
            index = self._current
            while self._idle:
                at, conn = self._idle.pop()
                if at == index:
                    return index, conn, True
                conn.close()
        host, port = self._endpoints[index]
        return index, http.client.HTTPConnection(host, port, timeout=self.timeout), False

    def _checkin(self, index: int, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        with self._lock:
            if not resp.will_close and not self._closed and index == self._current:
                if len(self._idle) < _MAX_IDLE:
                    self._idle.append((index, conn))
                    return
        conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()

    def _next_endpoint(self, failed: int) -> None:
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self._endpoints)

    def _endpoint(self) -> tuple[int, str, int]:
        with self._lock:
            self._check_open()
            return self._current, *self._endpoints[self._current]

    def _forget(self, stream: _WatchStream) -> None:
        with self._lock:
            self._streams.discard(stream)


class _Reconnect(Exception):
    """Open the stream again at once (after logging in again)."""


class _WatchEnded(Exception):
    """The watch cannot continue; ``error`` goes to the consumer."""

    def __init__(self, error: ControlError) -> None:
        super().__init__(str(error))
        self.error = error


class _WatchStream:
    """The reader thread of one watch: one streaming POST to ``/v3/watch`` at a time."""

    def __init__(self, store: EtcdStore, selector: _Json, what: str, start_revision: int) -> None:
        self._store = store
        self._selector = selector
        self._what = what
        self._next = start_revision  # revision to resume from; 0 until etcd says where "now" is
        self.handle = Watch(on_cancel=self.stop)
        self._conn: http.client.HTTPConnection | None = None
        self._conn_lock = threading.Lock()
        self._stopped = threading.Event()
        self._created = threading.Event()
        self._setup_error: ControlError | None = None
        self._broken_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {what}", daemon=True)

    def start(self) -> Watch:
        """Start reading; return once etcd has confirmed the watch (ControlError if it cannot)."""
        self._thread.start()
        if not self._created.wait(self._store.timeout):
            self.handle.cancel()
            raise ControlError(
                f"etcd at {self._store.url} did not confirm the watch on {self._what} "
                f"within {self._store.timeout:g} s"
            )
        if self._setup_error is not None:
            self.handle.cancel()
            raise self._setup_error
        return self.handle

    def stop(self) -> None:
        """Called by ``Watch.cancel`` (and on close): end the stream; the thread exits."""
        self._stopped.set()
        with self._conn_lock:
            sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._store._forget(self)

    def _run(self) -> None:
        """Read until stopped; whatever goes wrong ends in a reconnect from the next revision
        (nothing is missed) or in an error the consumer sees at ``Watch.get`` -- never in a
        thread that dies silently (a watch that stopped would stop node-loss detection)."""
        try:
            self._read_until_stopped()
        except BaseException as e:  # a bug here must not leave the consumer waiting for ever
            self._end(ControlError(f"watch on {self._what} failed: {type(e).__name__}: {e}"))
            raise

    def _read_until_stopped(self) -> None:
        delay = 0.05
        relogins = 0
        malformed, malformed_at = 0, -1
        while not self._stopped.is_set():
            try:
                self._stream()
                problem = "the stream ended"
            except _Reconnect as e:
                relogins += 1
                if relogins <= 2:
                    continue
                problem = str(e)
            except _WatchEnded as e:
                self._end(e.error)
                return
            except AuthError as e:
                self._end(e)
                return
            except (OSError, http.client.HTTPException, ControlError) as e:
                problem = str(e) or type(e).__name__
            except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
                # A malformed answer: reconnect from the last revision delivered. The same one
                # again and again (not a glitch on the wire) ends the watch, loudly.
                malformed = malformed + 1 if malformed_at == self._next else 1
                malformed_at = self._next
                problem = f"malformed answer ({type(e).__name__}: {e})"
                if malformed >= MALFORMED_LIMIT:
                    self._end(
                        ControlError(
                            f"watch on {self._what}: etcd at {self._store.url} answered malformed "
                            f"messages {malformed} times at revision {self._next} ({problem})"
                        )
                    )
                    return
            if self._stopped.is_set():
                return
            if not self._created.is_set():
                self._end(ControlError(f"cannot watch {self._what} on etcd at {self._store.url}: {problem}"))
                return
            now = time.monotonic()
            if self._broken_since is None:
                self._broken_since = now
                delay = 0.05
                log.warning(
                    "watch on %s broke (%s); reconnecting from revision %d", self._what, problem, self._next
                )
            elif now - self._broken_since > self._store.watch_retry_s:
                self._end(
                    ControlError(
                        f"watch on {self._what} lost: etcd at {self._store.url} unreachable for "
                        f"{self._store.watch_retry_s:g} s ({problem})"
                    )
                )
                return
            self._stopped.wait(delay)
            delay = min(2 * delay, 1.0)

    def _end(self, error: ControlError) -> None:
        if self._created.is_set():
            self.handle.fail(error)
        else:
            self._setup_error = error
            self._created.set()
        self._store._forget(self)

    def _stream(self) -> None:
        store = self._store
        index, host, port = store._endpoint()
        conn = http.client.HTTPConnection(host, port, timeout=store.timeout)
        try:
            try:
                conn.connect()
            except OSError:
                store._next_endpoint(index)
                raise
            with self._conn_lock:
                if self._stopped.is_set():
                    return
                self._conn = conn
            token = store._token
            request = {"create_request": {**self._selector, "start_revision": str(self._next)}}
            headers = {"Content-Type": "application/json"}
            if token:
                headers["Authorization"] = token
            conn.request("POST", f"{API_PREFIX}/watch", json.dumps(request).encode(), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                obj = json.loads(resp.read() or b"{}")
                code, message = _error_of(resp.status, obj) or (2, f"HTTP status {resp.status}")
                self._refused(code, message, token)
            assert conn.sock is not None
            conn.sock.settimeout(None)  # an idle watch is normal; a dead peer is left to keepalive
            _tcp_keepalive(conn.sock)
            while not self._stopped.is_set():
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    self._on_message(json.loads(line), token)
        finally:
            with self._conn_lock:
                self._conn = None
            conn.close()

    def _refused(self, code: int, message: str, token: str | None) -> None:
        store = self._store
        if code == _UNAUTHENTICATED and store._password is not None:
            store._authenticate(stale=token)
            raise _Reconnect(f"etcd at {store.url} keeps refusing the login token: {message}")
        raise _WatchEnded(store._refusal(f"{API_PREFIX}/watch", code, message))

    def _on_message(self, msg: _Json, token: str | None) -> None:
        err = msg.get("error")
        if isinstance(err, dict):
            code, message = _error_of(200, msg) or (2, "")
            if code == _UNAUTHENTICATED:
                self._refused(code, message, token)
            raise ControlError(f"etcd at {self._store.url} broke the watch stream: {message}")
        result: _Json = msg.get("result") or {}
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", ""))
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                self._created.set()  # established, then ended: the error goes through Watch.get
                raise _WatchEnded(
                    ControlError(
                        f"cannot watch {self._what} from revision {self._next}: etcd at "
                        f"{self._store.url} compacted its history up to revision {compacted}"
                    )
                )
            if "auth token" in reason or "Unauthenticated" in reason:
                self._refused(_UNAUTHENTICATED, reason, token)
            raise _WatchEnded(
                ControlError(f"etcd at {self._store.url} cancelled the watch on {self._what}: {reason}")
            )
        if result.get("created"):
            if self._next == 0:
                self._next = _header_revision(result) + 1
            self._broken_since = None
            self._created.set()
        for event in result.get("events") or []:
            kv = event.get("kv", {})
            revision = int(kv.get("mod_revision", 0))
            key = _key_text(_unb64(kv.get("key")))
            if event.get("type") == "DELETE":
                self.handle.deliver(WatchEvent("delete", key, b"", revision))
            else:
                self.handle.deliver(WatchEvent("put", key, _unb64(kv.get("value")), revision))
            self._next = revision + 1
