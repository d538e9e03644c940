"""The job's Prometheus metrics (coordinator/metrics.py) and their server (coordinator/status_server.py):
events and step reports to metrics, the view's gauges, the snapshot handoff, authentication and
the server's bounds. No job runs here (tests/e2e/test_metrics_e2e.py runs one)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nonstop import events as ev
from nonstop.coordinator.metrics import JobMetrics, JobMonitor, StatusBoard
from nonstop.coordinator.status_server import Limits, StatusServer, metrics_token
from nonstop.events.log import EventLog

SECRET = b"0123456789abcdef" * 4


def samples(text: str | bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of a Prometheus exposition."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(text: str | bytes, name: str, **labels: str) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def recovery(mttr: float, **kw: Any) -> ev.Recovery:
    base: dict[str, Any] = dict(
        failure_kind="exit",
        rank=1,
        step=8,
        detail="",
        detect_s=0.01,
        stages={"detect": 0.01, "restore": 0.2},
        training_again_s=mttr,
        mttr_s=mttr,
        lost_steps=1,
        restore_step=7,
        replacement="spare",
        generation=1,
        replans=0,
    )
    base.update(kw)
    return ev.Recovery(**base)


STATUS: dict[str, Any] = {
    "job_id": "j",
    "state": "running",
    "generation": 2,
    "world_size": 2,
    "ranks": {
        "0": {"node": "0", "spawn_id": 0, "pid": 1, "step": 12},
        "1": {"node": "1", "spawn_id": 3, "pid": 2, "step": 11},
    },
    "nodes": {
        "0": {"alive": True, "quarantined": False, "idle_spares": 1},
        "1": {"alive": True, "quarantined": False, "idle_spares": 0},
        "2": {"alive": False, "quarantined": False, "idle_spares": 0},
    },
    "committed_step": 9,
    "replicated_step": 9,
    "durable_step": 5,
}


# -- events and steps to metrics -----------------------------------------------------------------
def test_events_become_counters_and_histograms(tmp_path: Path) -> None:
    m = JobMetrics()
    log = EventLog(tmp_path / "events.jsonl")
    log.subscribe(m.on_event)
    log.emit(ev.Failure(failure_kind="exit", rank=1, spawn_id=1, detail="", step=8, detect_s=0.01))
    log.emit(ev.Failure(failure_kind="hang", rank=0, spawn_id=0, detail="", step=9, detect_s=1.0))
    log.emit(recovery(0.4))
    log.emit(ev.Replicated(step=4, seconds=0.05, raw_bytes=1000, wire_bytes=300, rounds=1))
    log.emit(ev.Persist(step=4, raw_bytes=1000, stored_bytes=400, seconds=0.3, full=True, url="x"))
    log.emit(ev.MigrationRefused(rank=0, target="1", reason="no spare"))
    log.emit(ev.NodeLost(node="1", reason="lease", quarantined=False))
    log.close()
    out = m.exposition()
    assert value(out, "nonstop_failures_total", kind="exit") == 1
    assert value(out, "nonstop_failures_total", kind="hang") == 1
    assert value(out, "nonstop_recoveries_total", kind="exit") == 1
    assert value(out, "nonstop_mttr_seconds_count") == 1
    assert value(out, "nonstop_mttr_seconds_sum") == pytest.approx(0.4)
    assert value(out, "nonstop_mttr_seconds_bucket", le="0.5") == 1
    assert value(out, "nonstop_mttr_seconds_bucket", le="0.25") == 0
    assert value(out, "nonstop_recovery_stage_seconds_sum", stage="restore") == pytest.approx(0.2)
    assert value(out, "nonstop_lost_steps_total") == 1
    assert value(out, "nonstop_replicated_bytes_total", encoding="wire") == 300
    assert value(out, "nonstop_replication_rounds_total") == 1
    assert value(out, "nonstop_persisted_bytes_total", encoding="stored") == 400
    assert value(out, "nonstop_persist_seconds_count") == 1
    assert value(out, "nonstop_migrations_total", outcome="refused") == 1
    assert value(out, "nonstop_nodes_lost_total") == 1


def test_steps_count_rank_zero_and_time_every_rank() -> None:
    mon = JobMonitor(lambda: dict(STATUS))
    for rank in (0, 1):
        mon.on_step(rank, 0.02, 0.001, 4096)
    mon.on_step(0, 0.03, 0.002, 4096)
    out = mon.metrics.exposition().decode()  # no coordinator ticks: the view's gauges are absent
    assert value(out, "nonstop_steps_total") == 2
    assert value(out, "nonstop_step_seconds_count") == 3
    assert value(out, "nonstop_snapshot_stall_seconds_count") == 3


def test_view_gauges_from_a_published_status() -> None:
    mon = JobMonitor(lambda: json.loads(json.dumps(STATUS)))
    mon.on_step(0, 0.02, 0.001, 4096)
    mon.on_step(1, 0.05, 0.003, 4096)
    mon.board.publish(mon.build())
    out = mon.metrics.exposition()
    assert value(out, "nonstop_committed_step") == 9
    assert value(out, "nonstop_durable_step") == 5
    assert value(out, "nonstop_nodes_alive") == 2
    assert value(out, "nonstop_spares_ready") == 1
    assert value(out, "nonstop_replication_lag_steps") == 2  # every rank is at 11 or later
    assert value(out, "nonstop_rank_last_step", rank="1") == 11
    assert value(out, "nonstop_rank_step_seconds", rank="1") == pytest.approx(0.05)
    assert value(out, "nonstop_rank_snapshot_bytes", rank="0") == 4096


def test_status_is_what_nonstop_status_json_shows() -> None:
    mon = JobMonitor(lambda: json.loads(json.dumps(STATUS)))
    mon.on_step(0, 0.02, 0.001, 1)
    mon.board.publish(mon.build())
    assert mon.status() == {"t": "status", **STATUS}


def test_two_jobs_in_one_process_have_registries_of_their_own() -> None:
    a, b = JobMetrics(), JobMetrics()
    a.on_event(ev.PersistFailed(error="x"))
    assert value(a.exposition(), "nonstop_persist_failures_total") == 1
    assert value(b.exposition(), "nonstop_persist_failures_total") == 0


# -- the snapshot handoff --------------------------------------------------------------------------
def test_a_reader_waits_for_the_coordinator_at_most_wait_s() -> None:
    board = StatusBoard(max_age_s=10.0)
    t0 = time.monotonic()
    assert board.get(wait_s=0.1) is None  # no coordinator ticks: nothing, after the wait
    assert 0.09 <= time.monotonic() - t0 < 2.0
    assert board.wanted

    def coordinator() -> None:
        while not board.wanted:
            time.sleep(0.001)
        board.publish({"x": 1})

    threading.Thread(target=coordinator).start()
    assert board.get(wait_s=5.0) == {"x": 1}
    assert not board.wanted
    assert board.get(wait_s=0.0) == {"x": 1}  # fresh: no new request
    assert not board.wanted


# -- the server ------------------------------------------------------------------------------------
@contextlib.contextmanager
def serving(limits: Limits) -> Iterator[tuple[StatusServer, str]]:
    mon = JobMonitor(lambda: json.loads(json.dumps(STATUS)))
    stop = threading.Event()

    def coordinator() -> None:  # the loop's hook, as Coordinator.tick calls it
        while not stop.is_set():
            mon.tick()
            time.sleep(0.005)

    t = threading.Thread(target=coordinator, daemon=True)
    t.start()
    token = metrics_token(SECRET)
    server = StatusServer(
        host="127.0.0.1",
        port=0,
        token=token,
        monitor=mon,
        limits=limits,
    )
    try:
        yield server, token
    finally:
        server.close()
        stop.set()
        t.join()


@pytest.fixture
def served() -> Iterator[tuple[StatusServer, str]]:
    """A server with the default connection bound: a client that makes its requests one after
    another is never refused, however late the server's threads release their slots (with a bound
    of 2, a busy CPU left two finished handlers holding theirs and the fifth request was closed at
    accept, as the bound says it must be)."""
    with serving(Limits(max_request_bytes=1024)) as s:
        yield s


@pytest.fixture
def served_tight() -> Iterator[tuple[StatusServer, str]]:
    """Two slots and a 0.5 s request timeout: for the tests of those bounds."""
    with serving(Limits(max_connections=2, request_timeout_s=0.5, max_request_bytes=1024)) as s:
        yield s


def get(server: StatusServer, path: str, token: str | None) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token is not None else {})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def test_the_token_is_derived_from_the_secret() -> None:
    t = metrics_token(SECRET)
    assert len(t) == 64 and int(t, 16) >= 0
    assert t == metrics_token(SECRET) != metrics_token(SECRET[::-1])


@pytest.mark.parametrize("path", ["/metrics", "/status", "/nothing"])
def test_no_token_or_a_wrong_one_is_401(served: tuple[StatusServer, str], path: str) -> None:
    server, token = served
    for bad in (None, "", token[:-1] + ("0" if token[-1] != "0" else "1"), token + "0"):
        status, body, headers = get(server, path, bad)
        assert status == 401 and b"committed" not in body
        assert headers.get("WWW-Authenticate", "").startswith("Bearer")
    conn = http.client.HTTPConnection(*server.address, timeout=5)
    conn.request("GET", path, headers={"Authorization": f"Basic {token}"})  # the right token, wrong scheme
    assert conn.getresponse().status == 401
    conn.close()


def test_the_right_token_gets_metrics_and_status(served: tuple[StatusServer, str]) -> None:
    server, token = served
    status, body, headers = get(server, "/metrics", token)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert value(body, "nonstop_committed_step") == 9
    status, body, _ = get(server, "/status", token)
    assert status == 200 and json.loads(body) == {"t": "status", **STATUS}
    assert get(server, "/other", token)[0] == 404


def test_an_oversized_request_is_refused(served: tuple[StatusServer, str]) -> None:
    server, token = served
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(
            b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer "
            + token.encode()
            + b"\r\nX: "
            + b"a" * 4096
            + b"\r\n\r\n"
        )
        reply = s.recv(4096)
    assert not reply.startswith(b"HTTP/1.0 200")


def test_slow_clients_hold_no_slot_for_long(served_tight: tuple[StatusServer, str]) -> None:
    server, token = served_tight
    idle = [socket.create_connection(server.address, timeout=5) for _ in range(2)]  # both slots
    try:
        time.sleep(0.2)
        with socket.create_connection(server.address, timeout=5) as third:  # closed at accept
            third.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert third.recv(100) == b""
        time.sleep(1.0)  # past the request timeout: the slow ones were dropped
        assert get(server, "/metrics", token)[0] == 200
    finally:
        for s in idle:
            s.close()


def test_start_writes_a_private_token_file_and_hooks_the_coordinator(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from nonstop.config import JobConfig, OperationsConfig
    from nonstop.coordinator.status_server import TOKEN_FILE, start_status_server

    events = EventLog(tmp_path / "events.jsonl")
    c = SimpleNamespace(
        config=JobConfig(script="x", operations=OperationsConfig(metrics_port=0)),
        status=lambda: dict(STATUS),
        monitor=None,
    )
    assert (
        start_status_server(
            SimpleNamespace(config=JobConfig(script="x"), monitor=None),
            events=events,
            secret=SECRET,
            job_dir=tmp_path,
        )
        is None
    )  # type: ignore[arg-type]
    server = start_status_server(c, events=events, secret=SECRET, job_dir=tmp_path)  # type: ignore[arg-type]
    assert server is not None and c.monitor is not None
    try:
        path = tmp_path / TOKEN_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text() == metrics_token(SECRET)
        assert server.job_info(tmp_path)["metrics"] == f"127.0.0.1:{server.address[1]}"
        events.emit(ev.PersistFailed(error="x"))  # the metrics subscribe to the job's events
        assert value(c.monitor.metrics.exposition(), "nonstop_persist_failures_total") == 1
    finally:
        server.close(tmp_path)
        events.close()
    assert not (tmp_path / TOKEN_FILE).exists()


# -- nonstop status --watch ------------------------------------------------------------------------
def test_watch_redraws_until_the_job_is_gone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import io

    from nonstop.cli.status import CLEAR, watch_status
    from nonstop.errors import UsageError
    from nonstop.launch import job_client as client

    answers: list[dict[str, Any] | None] = [{"committed_step": 3}, {"committed_step": 4}, None]

    def status(job_dir: Path) -> dict[str, Any]:
        got = answers.pop(0)
        if got is None:
            raise UsageError("cannot reach the job")
        return got

    monkeypatch.setattr(client, "request_status", status)
    out = io.StringIO()
    assert watch_status(tmp_path, lambda st: f"step {st['committed_step']}", interval_s=0.01, out=out) == 0
    text = out.getvalue()
    assert text.count(CLEAR) == 2 and "step 3" in text and "step 4" in text
    assert text.rstrip().endswith("no longer reachable (cannot reach the job)")
    monkeypatch.setattr(client, "request_status", lambda job_dir: status(job_dir))
    answers[:] = [None]
    with pytest.raises(UsageError):  # unreachable at the first look: the usual error
        watch_status(tmp_path, str, out=io.StringIO())


def test_a_status_the_coordinator_cannot_build_never_fails_it() -> None:
    calls = [json.loads(json.dumps(STATUS))]

    def status() -> dict[str, Any]:
        if not calls:
            raise KeyError(0)  # the view between two consistent states (seen at a job's start)
        return calls.pop()

    mon = JobMonitor(status)
    assert mon.board.get(wait_s=0.0) is None  # a reader asks; nothing yet
    mon.tick()  # published
    mon.board.max_age_s = 0.0
    got: list[dict[str, Any] | None] = []
    reader = threading.Thread(target=lambda: got.append(mon.board.get(wait_s=5.0)))
    reader.start()
    while not mon.board.wanted:
        time.sleep(0.001)
    mon.tick()  # raises inside: nothing new, the reader is answered with the last one at once
    reader.join(timeout=5.0)
    assert got and got[0] is not None and got[0]["committed_step"] == 9
