"""The control-store contract: every backend (embedded, etcd) must pass the same tests.

The etcd backend runs against a real etcd started once per session by ``scripts/etcd.sh``
(which installs etcd if it is missing: these tests are never skipped), on free ports in a
temporary directory, with authentication on and a fresh secret.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from nonstop.control.channel import etcd_password
from nonstop.control.embedded import EmbeddedStore
from nonstop.control.etcd import EtcdStore
from nonstop.control.store import ControlStore, LeaseKeeper, Watch, WatchEvent, open_store
from nonstop.errors import AuthError, ControlError, UsageError
from tests.conftest import EtcdServer, free_port

pytestmark = pytest.mark.timeout(60)

BACKENDS = ["embedded", "etcd"]
# The lease-timing tests wait whole TTLs; etcd cannot grant less than 1 s, the embedded store can.
SLOW_ON_ETCD = pytest.mark.parametrize(
    "store", ["embedded", pytest.param("etcd", marks=pytest.mark.slow)], indirect=True
)


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[ControlStore]:
    if request.param == "embedded":
        s = open_store("embedded://", secret=None)
    else:
        server: EtcdServer = request.getfixturevalue("etcd_server")
        s = open_store(server.url, secret=server.secret)
        s.delete_prefix("")  # one server for the session: start every test empty
    yield s
    s.close()


def _ttl(store: ControlStore) -> float:
    return 0.3 if isinstance(store, EmbeddedStore) else 1.0


def _expiry_slack(store: ControlStore) -> float:
    # etcd checks for expired leases every 500 ms, then commits the revoke through raft.
    return 0.2 if isinstance(store, EmbeddedStore) else 1.0


def _events(watch: Watch, n: int, timeout: float = 5.0) -> list[WatchEvent]:
    out: list[WatchEvent] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        ev = watch.get(max(deadline - time.monotonic(), 0.0))
        assert ev is not None, f"got only {out} of {n} events in {timeout} s"
        out.append(ev)
    return out


# -- contract ----------------------------------------------------------------------------------


def test_put_get_delete(store: ControlStore) -> None:
    assert isinstance(store, ControlStore)
    assert store.get("job") is None
    rev = store.put("job", b'{"step": 3}')
    kv = store.get("job")
    assert kv is not None
    assert (kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease) == (
        "job",
        b'{"step": 3}',
        rev,
        rev,
        0,
    )
    store.put("nodes/b", b"2")
    store.put("nodes/a", b"1")
    store.put("nodesx", b"not under nodes/")
    store.put("empty", b"")
    assert [(kv.key, kv.value) for kv in store.get_prefix("nodes/")] == [("nodes/a", b"1"), ("nodes/b", b"2")]
    empty = store.get("empty")
    assert empty is not None and empty.value == b""
    assert [kv.key for kv in store.get_prefix("")] == ["empty", "job", "nodes/a", "nodes/b", "nodesx"]
    assert store.delete("job") is True
    assert store.delete("job") is False
    assert store.get("job") is None
    assert store.delete_prefix("nodes/") == 2
    assert [kv.key for kv in store.get_prefix("")] == ["empty", "nodesx"]
    assert store.delete_prefix("nodes/") == 0


def test_revisions_increase_only_on_change(store: ControlStore) -> None:
    r0 = store.revision()
    r1 = store.put("k", b"1")
    r2 = store.put("k", b"2")
    assert r0 < r1 < r2 == store.revision()
    kv = store.get("k")
    assert kv is not None and (kv.create_revision, kv.mod_revision) == (r1, r2)
    store.get("k")
    store.get_prefix("")
    assert store.put_if("k", b"x", expect_revision=r1) is None
    assert store.delete("absent") is False
    assert store.revision() == r2  # reads, failed compares and no-op deletes change nothing
    store.delete("k")
    r3 = store.put("k", b"3")
    kv = store.get("k")
    assert kv is not None and kv.create_revision == r3 > r2  # re-created


def test_put_if(store: ControlStore) -> None:
    won = store.put_if("leader", b"coord-1", expect_revision=0)
    assert won is not None
    assert store.put_if("leader", b"coord-2", expect_revision=0) is None  # create-if-absent lost
    kv = store.get("leader")
    assert kv is not None and kv.value == b"coord-1" and kv.mod_revision == won
    assert store.put_if("leader", b"coord-1b", expect_revision=won - 1) is None  # stale revision
    again = store.put_if("leader", b"coord-1b", expect_revision=won)
    assert again is not None and again > won
    kv = store.get("leader")
    assert kv is not None and kv.value == b"coord-1b"
    store.delete("leader")
    assert store.put_if("leader", b"coord-3", expect_revision=0) is not None


@SLOW_ON_ETCD
def test_lease_keepalive_then_expiry(store: ControlStore) -> None:
    lease = store.grant_lease(_ttl(store))
    assert lease.ttl >= _ttl(store)
    store.put("nodes/n1", b"alive", lease=lease.id)
    kv = store.get("nodes/n1")
    assert kv is not None and kv.lease == lease.id
    watch = store.watch_prefix("nodes/")
    keeper = LeaseKeeper(store, lease).start()
    time.sleep(2.5 * lease.ttl)  # well past one TTL: only the keepalives keep it
    assert store.get("nodes/n1") is not None
    assert watch.get(0) is None
    keeper.stop()
    stopped = time.monotonic()
    ev = watch.get(lease.ttl + _expiry_slack(store))
    took = time.monotonic() - stopped
    assert ev is not None and (ev.kind, ev.key, ev.value) == ("delete", "nodes/n1", b""), took
    assert store.get("nodes/n1") is None
    assert not keeper.lost.is_set()
    assert store.keepalive(lease.id) is False
    with pytest.raises(ControlError, match="lease"):
        store.put("nodes/n1", b"again", lease=lease.id)


def test_revoke_deletes_at_once_at_one_revision(store: ControlStore) -> None:
    lease = store.grant_lease(30)
    store.put("nodes/a", b"", lease=lease.id)
    store.put("nodes/b", b"", lease=lease.id)
    store.put("nodes/c", b"")
    store.put("nodes/c", b"", lease=lease.id)
    store.put("nodes/c", b"unbound")  # a put without the lease unbinds the key
    watch = store.watch_prefix("nodes/")
    store.revoke(lease.id)
    evs = _events(watch, 2, timeout=2.0)
    assert [(e.kind, e.key) for e in evs] == [("delete", "nodes/a"), ("delete", "nodes/b")]
    assert evs[0].revision == evs[1].revision == store.revision()
    assert [kv.key for kv in store.get_prefix("nodes/")] == ["nodes/c"]
    assert store.keepalive(lease.id) is False
    store.revoke(lease.id)  # already gone: not an error


def test_grant_lease_rejects_nonpositive_ttl(store: ControlStore) -> None:
    with pytest.raises(ValueError, match="TTL"):
        store.grant_lease(0)


def test_lease_keeper_reports_a_revoked_lease(store: ControlStore) -> None:
    lease = store.grant_lease(_ttl(store))
    reasons: list[str] = []
    keeper = LeaseKeeper(store, lease, interval=0.05, on_lost=reasons.append).start()
    store.revoke(lease.id)
    assert keeper.lost.wait(2.0)
    assert reasons == [keeper.reason] and "expired" in keeper.reason
    keeper.stop()


def test_watch_prefix_sees_changes_in_order(store: ControlStore) -> None:
    store.put("jobs/old", b"before the watch")
    watch = store.watch_prefix("jobs/")
    key_watch = store.watch("jobs/a")
    r1 = store.put("jobs/a", b"1")
    r2 = store.put("jobs/b", b"2")
    store.put("other/x", b"not watched")
    r3 = store.put("jobs/a", b"3")
    r4 = store.delete_prefix("jobs/") and store.revision()
    evs = _events(watch, 6)
    assert [(e.kind, e.key, e.value, e.revision) for e in evs] == [
        ("put", "jobs/a", b"1", r1),
        ("put", "jobs/b", b"2", r2),
        ("put", "jobs/a", b"3", r3),
        ("delete", "jobs/a", b"", r4),
        ("delete", "jobs/b", b"", r4),
        ("delete", "jobs/old", b"", r4),
    ]
    assert watch.get(0.1) is None
    assert [(e.kind, e.value) for e in _events(key_watch, 3)] == [
        ("put", b"1"),
        ("put", b"3"),
        ("delete", b""),
    ]
    assert key_watch.get(0.1) is None

    replay = store.watch_prefix("jobs/", start_revision=r2)  # history from r2 on, then live
    assert [e.revision for e in _events(replay, 5)] == [r2, r3, r4, r4, r4]
    r5 = store.put("jobs/c", b"live")
    assert replay.get(2.0) == WatchEvent("put", "jobs/c", b"live", r5)


def test_list_then_watch_misses_nothing(store: ControlStore) -> None:
    store.put("nodes/a", b"")
    rev = store.revision()
    listed = store.get_prefix("nodes/")
    store.put("nodes/b", b"")  # between the list and the watch
    watch = store.watch_prefix("nodes/", start_revision=rev + 1)
    assert [kv.key for kv in listed] == ["nodes/a"]
    assert watch.get(2.0) == WatchEvent("put", "nodes/b", b"", rev + 1)


def test_cancel_stops_a_watch(store: ControlStore) -> None:
    watch = store.watch_prefix("k/")
    store.put("k/1", b"")
    assert watch.get(2.0) is not None
    watch.cancel()
    store.put("k/2", b"")
    assert watch.get(0.2) is None
    watch.cancel()  # idempotent

    blocked = store.watch_prefix("k/")
    got: list[WatchEvent | None] = []
    reader = threading.Thread(target=lambda: got.append(blocked.get()))
    reader.start()
    time.sleep(0.1)
    blocked.cancel()  # wakes a reader blocked without a timeout
    reader.join(2.0)
    assert not reader.is_alive() and got == [None]


def test_closed_store_fails_watches_and_calls(store: ControlStore) -> None:
    watch = store.watch_prefix("")
    store.close()
    with pytest.raises(ControlError, match="closed"):
        watch.get(2.0)
    with pytest.raises(ControlError, match="closed"):
        store.put("k", b"")
    store.close()  # idempotent


# -- backend specifics -------------------------------------------------------------------------


def test_open_store_rejects_bad_urls() -> None:
    for url in [
        "",
        "etcd://",
        "etcd://host",
        "etcd://host:0",
        "etcd://a:1,b",
        "http://127.0.0.1:2379",
        "embedded://x",
    ]:
        with pytest.raises(UsageError, match="URL"):
            open_store(url, secret=None)


def test_embedded_history_is_bounded() -> None:
    store = EmbeddedStore(history=2)
    first = store.put("a", b"1")
    store.put("a", b"2")
    store.put("a", b"3")
    watch = store.watch("a", start_revision=first)
    with pytest.raises(ControlError, match="compacted"):
        watch.get(1.0)
    assert [e.value for e in _events(store.watch("a", start_revision=first + 1), 2)] == [b"2", b"3"]


def test_etcd_wrong_or_missing_password_is_refused(etcd_server: EtcdServer) -> None:
    with pytest.raises(AuthError, match=r"refused user 'root'.*check the job secret"):
        open_store(etcd_server.url, secret="not-the-secret-of-this-job")
    with pytest.raises(AuthError, match="open it with the job secret"):
        open_store(etcd_server.url, secret=None)


def _password(server: EtcdServer) -> str:
    return etcd_password(server.secret.encode())


def test_etcd_password_is_derived_and_the_secret_itself_is_refused(etcd_server: EtcdServer) -> None:
    """Was: the job secret was etcd's root password, sent in clear over HTTP at every login."""
    with pytest.raises(AuthError, match="refused user 'root'"):
        EtcdStore(etcd_server.url, password=etcd_server.secret)
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    store.put("derived", b"ok")
    store.close()


def test_etcd_unreachable_names_the_url() -> None:
    url = f"etcd://127.0.0.1:{free_port()}"
    with pytest.raises(ControlError, match=f"etcd at {url} is unreachable"):
        open_store(url, secret="x" * 32)


def test_etcd_several_endpoints_skip_a_dead_one(etcd_server: EtcdServer) -> None:
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{etcd_server.port}"
    store = open_store(url, secret=etcd_server.secret)
    store.put("k", b"v")
    assert store.get("k") is not None
    store.close()


def test_etcd_logs_in_again_when_the_token_is_refused(etcd_server: EtcdServer) -> None:
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    store.put("k0", b"x")  # logged in
    assert store._token is not None
    # as etcd sees a token after its TTL or a restart: unknown, of an index it has applied (a
    # simple token's ".N" is a raft index, and etcd waits for an index it has not reached yet:
    # a made-up ".42" hung this test for its whole timeout whenever it ran first on a fresh server)
    index = store._token.rsplit(".", 1)[-1]
    store._token = f"expired.{index}"
    store.put("k", b"v")
    assert store._token != f"expired.{index}"  # refused, logged in again, put
    store._token = f"expired2.{index}"
    watch = store.watch("k")
    store.put("k", b"w")
    assert watch.get(2.0) is not None
    store.close()


def test_etcd_compacted_history_fails_the_watch(etcd_server: EtcdServer) -> None:
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    first = store.put("c", b"1")
    last = store.put("c", b"2")
    store._call("kv/compaction", {"revision": str(last)})
    watch = store.watch("c", start_revision=first)
    with pytest.raises(ControlError, match="compacted"):
        watch.get(2.0)
    store.close()


@pytest.mark.slow
def test_etcd_watch_resumes_after_a_restart_or_fails_after_retrying(etcd_server: EtcdServer) -> None:
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    impatient = EtcdStore(etcd_server.url, password=_password(etcd_server), watch_retry_s=0.5)
    watch = store.watch_prefix("w/")
    doomed = impatient.watch_prefix("w/")
    store.put("w/1", b"before")
    etcd_server.stop()
    try:
        # Down longer than watch_retry_s: the impatient watch fails (after its one event).
        assert doomed.get(2.0) is not None
        with pytest.raises(ControlError, match=r"lost: etcd at .* unreachable for 0.5 s"):
            doomed.get(5.0)
    finally:
        etcd_server.start()
    # etcd forgot the login token when it restarted; the pooled connection is dead too.
    store.put("w/2", b"after")
    evs = _events(watch, 2)
    assert [(e.key, e.value) for e in evs] == [("w/1", b"before"), ("w/2", b"after")]
    assert watch.get(0.3) is None  # nothing replayed twice
    store.close()
    impatient.close()


def test_etcd_watch_survives_a_malformed_line_and_misses_nothing(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: one malformed watch line (valid JSON, not an object) killed the watch thread
    silently, and with it node-loss detection."""
    import json as real_json
    import types

    from nonstop.control import etcdwatch as etcd_mod

    mangled: list[bytes] = []

    def loads(raw: bytes | str) -> object:
        text = raw if isinstance(raw, bytes) else raw.encode()
        if b'"events"' in text and not mangled:
            mangled.append(text)
            return ["not", "an", "object"]
        return real_json.loads(raw)

    monkeypatch.setattr(etcd_mod, "json", types.SimpleNamespace(loads=loads, dumps=real_json.dumps))
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    try:
        watch = store.watch_prefix("mal/")
        store.put("mal/1", b"a")
        store.put("mal/2", b"b")
        got = [watch.get(5.0), watch.get(5.0)]
        assert mangled, "the test did not mangle a line"
        assert [(e.key, e.value) for e in got if e is not None] == [("mal/1", b"a"), ("mal/2", b"b")]
    finally:
        store.close()


def test_etcd_watch_fails_loudly_when_every_answer_is_malformed(
    etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json as real_json
    import types

    from nonstop.control import etcdwatch as etcd_mod

    def loads(raw: bytes | str) -> object:
        text = raw if isinstance(raw, bytes) else raw.encode()
        return [] if b'"events"' in text else real_json.loads(raw)

    monkeypatch.setattr(etcd_mod, "json", types.SimpleNamespace(loads=loads, dumps=real_json.dumps))
    store = EtcdStore(etcd_server.url, password=_password(etcd_server))
    try:
        watch = store.watch_prefix("bad/")
        store.put("bad/1", b"a")
        with pytest.raises(ControlError, match="malformed"):
            for _ in range(50):
                watch.get(0.5)
    finally:
        store.close()
