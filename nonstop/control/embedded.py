"""The embedded control store: the :class:`~nonstop.control.store.ControlStore` contract in this
process's memory (the default; no setup, no durability)."""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from nonstop.control.store import KeyValue, Lease, Watch, WatchEvent
from nonstop.errors import ControlError

__all__ = ["EmbeddedStore"]


@dataclass
class _LeaseState:
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)


@dataclass
class _Watcher:
    key: str
    prefix: bool
    start_revision: int
    handle: Watch

    def wants(self, event: WatchEvent) -> bool:
        if event.revision < self.start_revision:
            return False
        return event.key.startswith(self.key) if self.prefix else event.key == self.key


class EmbeddedStore:
    """The control store in this process's memory: no setup, no durability, one process.

    One lock guards all state, so every operation is atomic and watches see changes in
    exactly the order they were made; events are queued to watches under that lock. Leases
    expire on time: every call first expires overdue leases, and a daemon thread (started
    with the first lease) wakes at the next deadline. The last ``history`` events are kept for
    watches with a start revision; asking for an older one fails the watch (as a compacted
    etcd would).
    """

    url = "embedded://"

    def __init__(self, *, history: int = 10_000) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._rev = 1
        self._kvs: dict[str, KeyValue] = {}
        self._history: deque[WatchEvent] = deque(maxlen=history)
        self._compacted = 0  # newest revision of an event dropped from the history
        self._leases: dict[int, _LeaseState] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watchers: list[_Watcher] = []
        self._reaper: threading.Thread | None = None
        self._closed = False

    # -- reads -------------------------------------------------------------------------------

    def revision(self) -> int:
        with self._cond:
            self._check()
            return self._rev

    def get(self, key: str) -> KeyValue | None:
        with self._cond:
            self._check()
            return self._kvs.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        with self._cond:
            self._check()
            return [kv for k, kv in sorted(self._kvs.items()) if k.startswith(prefix)]

    # -- writes ------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        with self._cond:
            self._check()
            return self._put(key, value, lease)

    def put_if(self, key: str, value: bytes, *, expect_revision: int, lease: int = 0) -> int | None:
        with self._cond:
            self._check()
            current = self._kvs.get(key)
            if (current.mod_revision if current else 0) != expect_revision:
                return None
            return self._put(key, value, lease)

    def delete(self, key: str) -> bool:
        with self._cond:
            self._check()
            return self._delete([key]) == 1

    def delete_prefix(self, prefix: str) -> int:
        with self._cond:
            self._check()
            return self._delete(sorted(k for k in self._kvs if k.startswith(prefix)))

    # -- leases ------------------------------------------------------------------------------

    def grant_lease(self, ttl: float) -> Lease:
        if not ttl > 0:
            raise ValueError(f"lease TTL must be > 0 seconds, got {ttl}")
        with self._cond:
            self._check()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _LeaseState(ttl, time.monotonic() + ttl)
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="embedded-store-leases", daemon=True)
                self._reaper.start()
            self._cond.notify_all()
            return Lease(lease_id, ttl)

    def keepalive(self, lease: int) -> bool:
        with self._cond:
            self._check()
            state = self._leases.get(lease)
            if state is None:
                return False
            state.deadline = time.monotonic() + state.ttl
            return True

    def revoke(self, lease: int) -> None:
        with self._cond:
            self._check()
            state = self._leases.pop(lease, None)
            if state is not None:
                self._delete(sorted(state.keys))

    # -- watches -----------------------------------------------------------------------------

    def watch(self, key: str, *, start_revision: int = 0) -> Watch:
        return self._watch(key, False, start_revision)

    def watch_prefix(self, prefix: str, *, start_revision: int = 0) -> Watch:
        return self._watch(prefix, True, start_revision)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            watchers, self._watchers = self._watchers, []
            self._cond.notify_all()
        for w in watchers:
            w.handle.fail(ControlError("the embedded control store was closed"))
        if self._reaper is not None:
            self._reaper.join()

    def _watch(self, key: str, prefix: bool, start_revision: int) -> Watch:
        if start_revision < 0:
            raise ValueError(f"start_revision must be >= 0, got {start_revision}")
        with self._cond:
            self._check()
            start = start_revision or self._rev + 1
            handle = Watch(on_cancel=lambda: self._unwatch(handle))
            w = _Watcher(key, prefix, start, handle)
            if start <= self._compacted:
                w.handle.fail(
                    ControlError(
                        f"cannot watch {key!r} from revision {start}: history before revision "
                        f"{self._compacted + 1} is compacted"
                    )
                )
                return w.handle
            for event in self._history:
                if w.wants(event):
                    w.handle.deliver(event)
            self._watchers.append(w)
            return w.handle

    def _unwatch(self, handle: Watch) -> None:
        with self._cond:
            self._watchers = [w for w in self._watchers if w.handle is not handle]

    # -- internals (called with the lock held) -----------------------------------------------

    def _check(self) -> None:
        if self._closed:
            raise ControlError("the embedded control store is closed")
        self._expire(time.monotonic())

    def _emit(self, event: WatchEvent) -> None:
        if len(self._history) == self._history.maxlen:
            self._compacted = self._history[0].revision
        self._history.append(event)
        for w in self._watchers:
            if w.wants(event):
                w.handle.deliver(event)

    def _put(self, key: str, value: bytes, lease: int) -> int:
        if lease and lease not in self._leases:
            raise ControlError(f"cannot put {key!r}: lease {lease:x} not found (expired or revoked)")
        self._rev += 1
        old = self._kvs.get(key)
        if old is not None and old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if lease:
            self._leases[lease].keys.add(key)
        created = old.create_revision if old is not None else self._rev
        self._kvs[key] = KeyValue(key, bytes(value), self._rev, created, lease)
        self._emit(WatchEvent("put", key, bytes(value), self._rev))
        return self._rev

    def _delete(self, keys: list[str]) -> int:
        present = [k for k in keys if k in self._kvs]
        if not present:
            return 0
        self._rev += 1
        for k in present:
            kv = self._kvs.pop(k)
            if kv.lease and kv.lease in self._leases:
                self._leases[kv.lease].keys.discard(k)
            self._emit(WatchEvent("delete", k, b"", self._rev))
        return len(present)

    def _expire(self, now: float) -> None:
        for lease_id in [i for i, s in self._leases.items() if s.deadline <= now]:
            state = self._leases.pop(lease_id)
            self._delete(sorted(state.keys))

    def _reap(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                self._expire(now)
                deadline = min((s.deadline for s in self._leases.values()), default=None)
                self._cond.wait(None if deadline is None else max(deadline - now, 0.001))
