"""The control store: a small consistent key-value store with revisions, leases and watches.

This module is the contract (:class:`ControlStore` and its value types). Two backends implement
it: :class:`nonstop.control.embedded.EmbeddedStore` (in this process) and
:class:`nonstop.control.etcd.EtcdStore` (an etcd v3 server). :func:`open_store` picks one from a URL.

Concepts, with the meaning both backends give them:

revision
    One store-wide counter. Every change (a put, a delete of existing keys, the keys a lease
    takes with it) gets the next revision; reads and failed compare-and-puts do not advance it.
    Revisions start at 1 on an empty store, so the first write is revision 2 (as in etcd).
lease
    A grant with a time to live (TTL). Keys put with ``lease=ID`` are deleted, all at one
    revision, when the lease expires (no keepalive for TTL seconds) or is revoked. A lease can
    only be refreshed by :meth:`ControlStore.keepalive` or :class:`LeaseKeeper`; putting a key
    does not refresh it.
watch
    A stream of the changes to one key or to all keys under a prefix, in revision order, from a
    start revision (replaying history) or from now. Delete events carry an empty value. A delete
    caused by lease expiry looks like any other delete.
compare-and-put
    :meth:`ControlStore.put_if` writes only if the key's ``mod_revision`` is the expected one
    (0: the key must be absent). This is how one process wins a leadership key.

Keys are text (UTF-8); values are bytes (callers put JSON there: nothing is unpickled).

Every method of a store may raise :class:`~nonstop.errors.ControlError` when the store
cannot be reached or answers with an error; :class:`~nonstop.errors.AuthError` (a subclass)
when it refuses the credentials. Stores are safe to use from several threads at once.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from nonstop.errors import ControlError, UsageError

if TYPE_CHECKING:
    from nonstop.control.tls import EtcdTLS

__all__ = [
    "ControlStore",
    "KeyValue",
    "Lease",
    "LeaseKeeper",
    "Watch",
    "WatchEvent",
    "open_store",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as stored: its value, the revision of its last change and of its creation, and
    the lease it is bound to (0: none)."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch. ``value`` is empty for a delete; ``revision`` is the
    revision of the change. Several events can share one (a prefix delete, a lease expiry or
    revoke deleting its keys); they then come in key order."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease. ``ttl`` is what the store granted: at least what was asked for (etcd
    rounds up to whole seconds and to its minimum TTL)."""

    id: int
    ttl: float


class Watch:
    """Handle on one watch: the events of one key or prefix, in revision order.

    A backend fills it (:meth:`deliver`, :meth:`fail`) from its own thread; one consumer reads
    it with :meth:`get`. Events are never dropped or reordered while the watch lives. When the
    watch cannot continue (history compacted past the revision it must resume from, the
    store unreachable for longer than the backend retries, the store closed) the events
    delivered before the failure are returned first, then every later :meth:`get` raises
    :class:`ControlError`. :meth:`cancel` may be called from any thread, also while another
    thread is blocked in :meth:`get`.
    """

    def __init__(self, *, on_cancel: Callable[[], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[WatchEvent | ControlError | None] = queue.SimpleQueue()
        self._on_cancel = on_cancel
        self._cancelled = threading.Event()
        self._cancel_lock = threading.Lock()
        self._error: ControlError | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def get(self, timeout: float | None = None) -> WatchEvent | None:
        """The next event; None after ``timeout`` seconds without one (None: wait forever) and
        at once after :meth:`cancel`. Raises ControlError once the watch has failed."""
        if self._error is not None:
            raise self._error
        if self._cancelled.is_set():
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:  # the cancel sentinel
            self._queue.put(None)
            return None
        if isinstance(item, ControlError):
            self._error = item
            raise item
        return item

    def cancel(self) -> None:
        """Stop the watch: the backend stops delivering and releases its stream. Idempotent."""
        with self._cancel_lock:
            if self._cancelled.is_set():
                return
            self._cancelled.set()
        self._queue.put(None)
        if self._on_cancel is not None:
            self._on_cancel()

    def deliver(self, event: WatchEvent) -> None:
        """Backend side: queue one event (dropped once cancelled)."""
        if not self._cancelled.is_set():
            self._queue.put(event)

    def fail(self, error: ControlError) -> None:
        """Backend side: end the watch with ``error``, raised by :meth:`get` after the events
        already queued."""
        self._queue.put(error)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


@runtime_checkable
class ControlStore(Protocol):
    """What the coordinator and node agents need from a control store. See the module docstring
    for revisions, leases and watches; both backends pass ``tests/control/test_control_store.py``."""

    @property
    def url(self) -> str:
        """Where the store is (``embedded://`` or ``etcd://host:port``), for messages."""
        ...

    def revision(self) -> int:
        """The store's current revision. To list a prefix and then follow it without a gap:
        ``rev = revision(); get_prefix(p); watch_prefix(p, start_revision=rev + 1)`` (changes
        between the two reads are seen twice, never missed)."""
        ...

    def get(self, key: str) -> KeyValue | None:
        """The key, or None if absent."""
        ...

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys starting with ``prefix`` (``""``: every key), sorted by key."""
        ...

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Write ``key`` unconditionally; returns the new revision. With ``lease``, the key is
        bound to that lease (a put without one unbinds it). Raises ControlError if the lease
        is gone (expired or revoked)."""
        ...

    def put_if(self, key: str, value: bytes, *, expect_revision: int, lease: int = 0) -> int | None:
        """Write ``key`` only if its ``mod_revision`` is ``expect_revision`` (0: only if the key
        is absent). Returns the new revision, or None (nothing written) if the check failed."""
        ...

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed. Deleting an absent key changes nothing."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` at one revision; returns how many there were."""
        ...

    def grant_lease(self, ttl: float) -> Lease:
        """A new lease of at least ``ttl`` seconds. Raises ValueError if ``ttl <= 0``."""
        ...

    def keepalive(self, lease: int) -> bool:
        """Refresh the lease to its full TTL. False if it is gone (expired or revoked): its keys
        are deleted and it cannot come back; grant a new one."""
        ...

    def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys. A lease already gone is not an error."""
        ...

    def watch(self, key: str, *, start_revision: int = 0) -> Watch:
        """Follow one key from ``start_revision`` (0: changes after this call returns; the
        watch is established when it returns)."""
        ...

    def watch_prefix(self, prefix: str, *, start_revision: int = 0) -> Watch:
        """Follow every key under ``prefix``; otherwise as :meth:`watch`."""
        ...

    def close(self) -> None:
        """Release connections and threads. Open watches fail with ControlError; later calls
        raise ControlError. Does not revoke leases: on etcd they expire by themselves."""
        ...


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread, refreshing it every ``interval`` seconds
    (default a third of its TTL) until :meth:`stop` or until the lease is lost.

    The lease counts as lost when the store says it is gone, or when no refresh has succeeded
    for a whole TTL (the store unreachable: the keys may already be deleted). Then ``lost`` is
    set, ``reason`` says why, ``on_lost(reason)`` runs on the keeper's thread, and the keeper
    stops; it never grants a new lease itself.
    """

    def __init__(
        self,
        store: ControlStore,
        lease: Lease,
        *,
        interval: float | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.interval = lease.ttl / 3 if interval is None else interval
        self.lost = threading.Event()
        self.reason = ""
        # when the newest successful refresh was *sent* (monotonic): the store's TTL runs from a
        # moment no earlier than this, so a holder that must stop before its keys vanish (a
        # fencing node agent) measures from here
        self.last_ok_sent = time.monotonic()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.id:x}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self, *, revoke: bool = False) -> None:
        """Stop refreshing (the keys then live until the TTL runs out); with ``revoke``, end the
        lease at once. Waits for the keeper's thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if revoke:
            self.store.revoke(self.lease.id)

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.interval):
            sent = time.monotonic()
            try:
                alive = self.store.keepalive(self.lease.id)
            except ControlError as e:
                if time.monotonic() - last_ok < self.lease.ttl:
                    log.warning("lease %x: keepalive failed, retrying: %s", self.lease.id, e)
                    continue
                self._lose(f"no keepalive got through for {self.lease.ttl:g} s: {e}")
                return
            if not alive:
                self._lose("the lease expired")
                return
            last_ok = time.monotonic()
            self.last_ok_sent = sent

    def _lose(self, reason: str) -> None:
        self.reason = f"lease {self.lease.id:x} lost: {reason}"
        log.warning("%s", self.reason)
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(self.reason)


def open_store(url: str, *, secret: str | None, etcd_tls: EtcdTLS | None = None) -> ControlStore:
    """Open the control store at ``url``.

    ``embedded://``
        A new :class:`~nonstop.control.embedded.EmbeddedStore` in this process (``secret`` is not used).
    ``etcd://HOST:PORT[,HOST:PORT...]``, ``etcds://...`` (TLS)
        An :class:`~nonstop.control.etcd.EtcdStore`; ``secret`` is the job secret, from which
        the password of etcd's ``root`` user is derived (:func:`~nonstop.control.channel.
        etcd_password`: the secret itself never goes to etcd). None: no login, which only a
        server with authentication disabled accepts, and only with ``NONSTOP_ETCD_NO_AUTH=1``.
        ``etcds://`` verifies etcd against ``etcd_tls`` (default: the job's ``--etcd-ca``/
        ``--etcd-cert``/``--etcd-key``, which its launcher hands every process in
        ``NONSTOP_ETCD_*``). Connects and authenticates before returning.

    Raises UsageError for a malformed URL or missing TLS files, AuthError for refused
    credentials, ControlError when etcd cannot be reached or its TLS handshake fails.
    """
    scheme, sep, rest = url.partition("://")
    if scheme == "embedded" and sep and not rest:
        from nonstop.control.embedded import EmbeddedStore

        return EmbeddedStore()
    if scheme in ("etcd", "etcds") and sep:
        from nonstop.config import etcd_tls_paths_from_env
        from nonstop.control.channel import etcd_password
        from nonstop.control.etcd import NO_AUTH_ENV, EtcdStore
        from nonstop.control.tls import EtcdTLS

        if etcd_tls is None and scheme == "etcds" and (paths := etcd_tls_paths_from_env()) is not None:
            etcd_tls = EtcdTLS(*paths)
        password = None if secret is None else etcd_password(secret.encode())
        return EtcdStore(
            url, password=password, allow_no_auth=os.environ.get(NO_AUTH_ENV) == "1", tls=etcd_tls
        )
    raise UsageError(
        f"unknown control store URL {url!r}: use embedded://, etcd://HOST:PORT[,HOST:PORT...] or etcds://..."
    )
