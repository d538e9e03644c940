"""The control store on an etcd v3 server, through etcd's JSON gateway (standard library only).

etcd serves its gRPC API as JSON over HTTP/1.1 at ``/v3/...`` (3.4 also at ``/v3beta/``, which
3.5 dropped; ``/v3/`` works on both). Keys and values travel base64-encoded, 64-bit integers as
decimal strings. Nothing read from the server is unpickled: it is parsed as JSON.

Authentication: with a ``password``, the client logs in as ``user`` (``root``) through
``/v3/auth/authenticate`` and sends the token it gets in the ``Authorization`` header. A token
etcd no longer accepts (it expired, or etcd restarted) is replaced by logging in again once,
then the request is repeated; a refused password raises :class:`~nonstop.errors.AuthError`.

TLS: ``etcds://`` with an :class:`~nonstop.control.tls.EtcdTLS` (``tls``): etcd's certificate is
verified against the CA and the URL's host, and the client certificate, if any, is shown. A
failed TLS handshake (wrong CA, no client certificate, a plain server) raises ControlError
saying which, and so does a plain ``etcd://`` client talking to a TLS server.

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

import http.client
import json
import logging
import math
import ssl
import threading
import time

from nonstop.control.etcdwatch import WatchStream
from nonstop.control.etcdwire import (
    API_PREFIX,
    NOT_FOUND,
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    Json,
    b64,
    error_of,
    header_revision,
    key_bytes,
    keyvalue,
    prefix_range,
)
from nonstop.control.store import KeyValue, Lease, Watch
from nonstop.control.tls import EtcdTLS, describe_ssl_error, speaks_tls
from nonstop.errors import AuthError, ControlError, UsageError

__all__ = ["API_PREFIX", "NO_AUTH_ENV", "EtcdStore", "parse_etcd_url"]

log = logging.getLogger(__name__)

NO_AUTH_ENV = "NONSTOP_ETCD_NO_AUTH"  # "1": accept an etcd with authentication disabled
_MAX_IDLE = 4  # pooled keep-alive connections


def parse_etcd_url(url: str) -> list[tuple[str, int]]:
    """``etcd[s]://HOST:PORT[,HOST:PORT...]`` -> endpoints. Raises UsageError if malformed."""
    scheme, sep, rest = url.partition("://")
    endpoints: list[tuple[str, int]] = []
    for part in rest.rstrip("/").split(",") if scheme in ("etcd", "etcds") and sep else []:
        host, colon, port = part.strip().rpartition(":")
        if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
            endpoints = []
            break
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise UsageError(f"bad etcd URL {url!r}: expected etcd://HOST:PORT[,HOST:PORT...] or etcds://...")
    return endpoints


_PLAIN_TO_TLS = b"HTTP request to an HTTPS server"  # what etcd (Go) answers a plain request on TLS
_CN_REFUSED = b"CommonName of client"  # etcd's gateway refuses a client certificate with a CN


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
        tls: EtcdTLS | None = None,
    ) -> None:
        self._endpoints = parse_etcd_url(url)
        self.url = url
        if url.startswith("etcds://") and tls is None:
            raise UsageError(f"{url}: etcds:// needs --etcd-ca FILE, the CA that signed etcd's certificate")
        if tls is not None and not url.startswith("etcds://"):
            raise UsageError(f"{url}: --etcd-ca/--etcd-cert/--etcd-key are for TLS: use etcds://")
        self._ssl = tls.context() if tls is not None else None
        self._password = password
        self._allow_no_auth = allow_no_auth
        self._user = user
        self.timeout = timeout
        self.watch_retry_s = watch_retry_s
        self._lock = threading.Lock()  # endpoint choice, connection pool, streams, closed
        self._current = 0
        self._idle: list[tuple[int, http.client.HTTPConnection]] = []
        self._streams: set[WatchStream] = set()
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
        return header_revision(self._call("kv/range", {"key": b64(b"\0"), "count_only": True}))

    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("kv/range", {"key": b64(key_bytes(key))}).get("kvs") or []
        return keyvalue(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        body = {**prefix_range(prefix), "sort_order": "ASCEND", "sort_target": "KEY"}
        return [keyvalue(kv) for kv in self._call("kv/range", body).get("kvs") or []]

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        return header_revision(self._call("kv/put", self._put_request(key, value, lease)))

    def put_if(self, key: str, value: bytes, *, expect_revision: int, lease: int = 0) -> int | None:
        compare = {
            "key": b64(key_bytes(key)),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": str(expect_revision),
        }
        body = {"compare": [compare], "success": [{"request_put": self._put_request(key, value, lease)}]}
        obj = self._call("kv/txn", body)
        return header_revision(obj) if obj.get("succeeded") else None

    def delete(self, key: str) -> bool:
        return int(self._call("kv/deleterange", {"key": b64(key_bytes(key))}).get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        return int(self._call("kv/deleterange", prefix_range(prefix)).get("deleted", 0))

    @staticmethod
    def _put_request(key: str, value: bytes, lease: int) -> Json:
        body: Json = {"key": b64(key_bytes(key)), "value": b64(value)}
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
        self._call("lease/revoke", {"ID": str(lease)}, tolerate=NOT_FOUND)

    # -- watches -----------------------------------------------------------------------------

    def watch(self, key: str, *, start_revision: int = 0) -> Watch:
        return self._watch({"key": b64(key_bytes(key))}, repr(key), start_revision)

    def watch_prefix(self, prefix: str, *, start_revision: int = 0) -> Watch:
        return self._watch(prefix_range(prefix), f"prefix {prefix!r}", start_revision)

    def _watch(self, selector: Json, what: str, start_revision: int) -> Watch:
        if start_revision < 0:
            raise ValueError(f"start_revision must be >= 0, got {start_revision}")
        stream = WatchStream(self, selector, what, start_revision)
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

    def _call(self, method: str, body: Json, *, tolerate: int | None = None) -> Json:
        """POST ``body`` to ``/v3/<method>``; the answer, or raise ControlError / AuthError.
        An error with code ``tolerate`` is returned as an empty answer instead."""
        path = f"{API_PREFIX}/{method}"
        deadline = time.monotonic() + self.timeout
        relogged = False
        while True:
            token = self._token
            status, obj = self._post(path, body, token)
            err = error_of(status, obj)
            if err is None:
                return obj
            code, message = err
            if code == tolerate:
                return {}
            if code == UNAUTHENTICATED and self._password is not None and not relogged:
                self._authenticate(stale=token)
                relogged = True
                continue
            if code == UNAVAILABLE and time.monotonic() < deadline:  # no leader yet
                time.sleep(0.05)
                continue
            raise self._refusal(path, code, message)

    def _refusal(self, path: str, code: int, message: str) -> ControlError:
        if code in (UNAUTHENTICATED, PERMISSION_DENIED) or "user name is empty" in message:
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
            err = error_of(status, obj)
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
            if code in (3, PERMISSION_DENIED, UNAUTHENTICATED) or "authentication failed" in message:
                raise AuthError(
                    f"etcd at {self.url} refused user {self._user!r}: {message}; check the job secret"
                )
            raise ControlError(f"etcd at {self.url} failed {path}: {message} (gRPC code {code})")

    def _post(self, path: str, body: Json, token: str | None) -> tuple[int, Json]:
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
                except ssl.SSLError as e:
                    conn.close()
                    raise ControlError(f"etcd at {self.url} ({host}:{port}): {describe_ssl_error(e)}") from e
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
                hint = None if reused else self._first_request_failed(host, port, e)
                if hint is not None:
                    raise ControlError(f"etcd at {self.url} ({host}:{port}): {hint}") from e
                if reused and not isinstance(e, TimeoutError):
                    self._drop_idle()  # the server closed an idle connection: once more on a new one
                    continue
                self._next_endpoint(index)
                what = f"did not answer within {self.timeout:g} s" if isinstance(e, TimeoutError) else e
                raise ControlError(f"etcd at {self.url} ({host}:{port}): {path} lost: {what}") from e
            self._checkin(index, conn, resp)
            if self._ssl is None and _PLAIN_TO_TLS in raw:
                raise ControlError(
                    f"etcd at {self.url} ({host}:{port}) speaks TLS: use etcds://HOST:PORT with --etcd-ca "
                    "(and --etcd-cert/--etcd-key)"
                )
            if self._ssl is not None and _CN_REFUSED in raw:
                raise ControlError(
                    f"etcd at {self.url} refuses --etcd-cert: its JSON gateway takes no client certificate "
                    "with a CommonName; make one without (a subject like /O=nonstop, the name in its SANs)"
                )
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise ControlError(f"etcd at {self.url} answered {path} with non-JSON: {raw[:200]!r}") from e
            if not isinstance(obj, dict):
                raise ControlError(f"etcd at {self.url} answered {path} with {type(obj).__name__}")
            return resp.status, obj

    def _first_request_failed(self, host: str, port: int, e: Exception) -> str | None:
        """Why the first request on a new connection failed, when it is a TLS mismatch (None: a
        connection lost like any other)."""
        if isinstance(e, ssl.SSLError) and not isinstance(e, ssl.SSLEOFError):
            return describe_ssl_error(e)
        closed = (ssl.SSLEOFError, ConnectionResetError, http.client.RemoteDisconnected)
        if self._ssl is not None and isinstance(e, closed):
            return (
                "etcd closed the TLS connection at the first request: it wants a client certificate "
                "signed by a CA it trusts (its --trusted-ca-file): give --etcd-cert and --etcd-key"
            )
        if self._ssl is None and isinstance(e, closed) and speaks_tls(host, port, self.timeout):
            return "it speaks TLS: use etcds://HOST:PORT with --etcd-ca (and --etcd-cert/--etcd-key)"
        return None

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
        return index, self._connection(index), False

    def _connection(self, index: int) -> http.client.HTTPConnection:
        """A new (unconnected) connection to endpoint ``index``: HTTPS for etcds://."""
        host, port = self._endpoints[index]
        if self._ssl is not None:
            return http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=self.timeout)

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

    def _forget(self, stream: WatchStream) -> None:
        with self._lock:
            self._streams.discard(stream)
