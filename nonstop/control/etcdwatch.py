"""The reader of one etcd watch (see :mod:`nonstop.control.etcd`, "Watches"): one streaming
POST to ``/v3/watch`` at a time, reconnected from the next revision when it breaks."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
from typing import TYPE_CHECKING

from nonstop.control.etcdwire import (
    API_PREFIX,
    UNAUTHENTICATED,
    Json,
    error_of,
    header_revision,
    key_text,
    tcp_keepalive,
    unb64,
)
from nonstop.control.store import Watch, WatchEvent
from nonstop.control.tls import describe_ssl_error
from nonstop.errors import AuthError, ControlError

if TYPE_CHECKING:
    from nonstop.control.etcd import EtcdStore

__all__ = ["MALFORMED_LIMIT", "WatchStream"]

log = logging.getLogger(__name__)

MALFORMED_LIMIT = 3  # malformed watch answers at one revision before the watch fails


class _Reconnect(Exception):
    """Open the stream again at once (after logging in again)."""


class _WatchEnded(Exception):
    """The watch cannot continue; ``error`` goes to the consumer."""

    def __init__(self, error: ControlError) -> None:
        super().__init__(str(error))
        self.error = error


class WatchStream:
    """The reader thread of one watch: one streaming POST to ``/v3/watch`` at a time."""

    def __init__(self, store: EtcdStore, selector: Json, what: str, start_revision: int) -> None:
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
        index, _, _ = store._endpoint()
        conn = store._connection(index)
        try:
            try:
                conn.connect()
            except ssl.SSLError as e:  # not a reachability problem: the same on every attempt
                raise _WatchEnded(ControlError(f"etcd at {store.url}: {describe_ssl_error(e)}")) from e
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
                code, message = error_of(resp.status, obj) or (2, f"HTTP status {resp.status}")
                self._refused(code, message, token)
            assert conn.sock is not None
            conn.sock.settimeout(None)  # an idle watch is normal; a dead peer is left to keepalive
            tcp_keepalive(conn.sock)
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
        if code == UNAUTHENTICATED and store._password is not None:
            store._authenticate(stale=token)
            raise _Reconnect(f"etcd at {store.url} keeps refusing the login token: {message}")
        raise _WatchEnded(store._refusal(f"{API_PREFIX}/watch", code, message))

    def _on_message(self, msg: Json, token: str | None) -> None:
        err = msg.get("error")
        if isinstance(err, dict):
            code, message = error_of(200, msg) or (2, "")
            if code == UNAUTHENTICATED:
                self._refused(code, message, token)
            raise ControlError(f"etcd at {self._store.url} broke the watch stream: {message}")
        result: Json = msg.get("result") or {}
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
                self._refused(UNAUTHENTICATED, reason, token)
            raise _WatchEnded(
                ControlError(f"etcd at {self._store.url} cancelled the watch on {self._what}: {reason}")
            )
        if result.get("created"):
            if self._next == 0:
                self._next = header_revision(result) + 1
            self._broken_since = None
            self._created.set()
        for event in result.get("events") or []:
            kv = event.get("kv", {})
            revision = int(kv.get("mod_revision", 0))
            key = key_text(unb64(kv.get("key")))
            if event.get("type") == "DELETE":
                self.handle.deliver(WatchEvent("delete", key, b"", revision))
            else:
                self.handle.deliver(WatchEvent("put", key, unb64(kv.get("value")), revision))
            self._next = revision + 1
