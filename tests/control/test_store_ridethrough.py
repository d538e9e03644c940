"""Riding through a control-store stall (issue 17, item 4), unit tier: the coordinator keeps a
node whose store lease ended while it still hears it, the agent fences only when neither the
store nor the coordinator hears it, the coordinator's record is written off its loop, and a
restarted coordinator does not wait out the lease of a predecessor that is known dead.
The real thing (etcd frozen with SIGSTOP under a running job) is tests/e2e/test_store_stall.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.agent.lease import NodeLease
from nonstop.control.embedded import EmbeddedStore
from nonstop.control.jobstore import JobStore, RecordWriter
from nonstop.control.store import Lease, LeaseKeeper
from nonstop.coordinator.store_sync import leader_ttl
from nonstop.errors import ControlError
from nonstop.protocol.worker import ResumeMsg
from tests.coord_fakes import Harness

TTL = 0.4


# -- the coordinator: a lapsed lease while the node is heard --------------------------------------
def _store_job(tmp_path: Path) -> tuple[Harness, JobStore, dict[str, LeaseKeeper]]:
    jobs = JobStore(EmbeddedStore(), "fakejob")
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    keepers = {n: jobs.register_node(n, "127.0.0.1:1", ttl=60.0) for n in ("0", "1")}
    h = Harness(
        tmp_path / "job", jobs=jobs, nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:1",
        lease_ttl_s=TTL, store="etcd://127.0.0.1:1", secret_file=secret,
    )  # fmt: skip
    h.coord.store.open()
    for n in ("0", "1"):
        h.add_node(n, nproc=1, spares=1)
        h.put("msg", h.agents[n], {"t": "registered", "lease_id": keepers[n].lease.id})
    h.tick()
    h.bring_up()
    return h, jobs, keepers


def _heard(h: Harness, node: str, seq: int) -> None:
    h.put("msg", h.agents[node], {"t": "lease", "seq": seq})
    h.tick()


def test_a_lease_that_ends_while_the_node_is_heard_keeps_the_node_until_it_is_not(tmp_path: Path) -> None:
    h, jobs, keepers = _store_job(tmp_path)
    try:
        _heard(h, "1", 1)
        keepers["1"].stop(revoke=True)  # the store ends node 1's lease (as after a stall)
        h.tick()
        [lapsed] = h.events("node_lease_lapsed")
        assert lapsed["node"] == "1" and lapsed["heard_s_ago"] < TTL
        assert h.coord.view.nodes["1"].alive and not h.events("node_lost")
        # the agent registers a new lease: the node is whole again
        keepers["1"] = jobs.register_node("1", "127.0.0.1:1", ttl=60.0)
        h.tick()
        assert [e["node"] for e in h.events("node_lease_renewed")] == ["1"]
        # it lapses again, and this time the node stops being heard: lost after a whole TTL
        _heard(h, "1", 2)
        keepers["1"].stop(revoke=True)
        h.tick()
        assert len(h.events("node_lease_lapsed")) == 2 and h.coord.view.nodes["1"].alive
        time.sleep(TTL * 1.2)
        h.tick()
        assert not h.coord.view.nodes["1"].alive
        [lost] = h.events("node_lost")
        assert lost["node"] == "1" and "not heard" in lost["reason"]
    finally:
        for k in keepers.values():
            k.stop(revoke=True)
        h.coord.store.close()


def test_a_lease_that_ends_while_the_node_is_not_heard_loses_it_at_once(tmp_path: Path) -> None:
    h, _, keepers = _store_job(tmp_path)
    try:
        time.sleep(TTL * 1.2)  # node 1 said nothing for longer than a TTL
        _heard(h, "0", 1)
        keepers["1"].stop(revoke=True)
        h.tick()
        assert not h.events("node_lease_lapsed")
        [lost] = h.events("node_lost")
        assert lost["node"] == "1" and lost["reason"] == "its lease in the control store ended"
    finally:
        for k in keepers.values():
            k.stop(revoke=True)
        h.coord.store.close()


# -- the record is written off the coordinator's loop ------------------------------------------
class _StalledStore(EmbeddedStore):
    """A store whose writes wait for ``go`` (a frozen etcd), or fail while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.go.set()
        self.down = False
        self.puts: list[bytes] = []

    def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        self.go.wait()
        if self.down:
            raise ControlError("etcd did not answer within 5 s")
        self.puts.append(value)
        return super().put(key, value, lease=lease)


def test_the_record_writer_never_blocks_its_caller_and_the_newest_record_wins() -> None:
    store = _StalledStore()
    jobs = JobStore(store, "j")
    writer = RecordWriter(jobs, retry_s=0.01)
    store.go.clear()
    t0 = time.monotonic()
    for i in range(50):
        writer.save({"n": i})
    assert time.monotonic() - t0 < 0.5  # a frozen store never held the caller
    store.go.set()
    assert writer.close(timeout=5.0)
    assert jobs.load() == {"n": 49}
    assert len(store.puts) <= 2  # the first (taken before the stall) and the newest


def test_the_record_writer_retries_until_the_store_answers() -> None:
    store = _StalledStore()
    jobs = JobStore(store, "j")
    store.down = True
    writer = RecordWriter(jobs, retry_s=0.01)
    writer.save({"n": 1})
    time.sleep(0.1)
    assert jobs.load() is None
    store.down = False
    assert writer.close(timeout=5.0)
    assert jobs.load() == {"n": 1}


def test_the_record_writer_gives_up_on_close_when_the_store_stays_down() -> None:
    store = _StalledStore()
    store.down = True
    writer = RecordWriter(JobStore(store, "j"), retry_s=0.01)
    writer.save({"n": 1})
    assert writer.close(timeout=0.2) is False


# -- leadership ----------------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _hold_leader(jobs: JobStore, pid: int) -> None:
    import json
    import socket

    lease = jobs.store.grant_lease(60.0)
    value = json.dumps({"address": "127.0.0.1:1", "pid": pid, "host": socket.gethostname()}).encode()
    assert jobs.store.put_if(jobs.prefix + "leader", value, expect_revision=0, lease=lease.id) is not None


def test_a_dead_predecessor_on_this_host_is_not_waited_for() -> None:
    jobs = JobStore(EmbeddedStore(), "j")
    _hold_leader(jobs, _dead_pid())
    t0 = time.monotonic()
    keeper = jobs.lead("127.0.0.1:2", 60.0, timeout=5.0, on_lost=lambda why: None)
    try:
        assert time.monotonic() - t0 < 2.0 and jobs.took_over_dead
    finally:
        keeper.stop(revoke=True)


def test_a_live_predecessor_is_waited_for() -> None:
    jobs = JobStore(EmbeddedStore(), "j")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _hold_leader(jobs, sleeper.pid)
        with pytest.raises(ControlError, match="another coordinator"):
            jobs.lead("127.0.0.1:2", 60.0, timeout=0.5, on_lost=lambda why: None)
        assert not jobs.took_over_dead
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_leader_lease_outlasts_a_3s_stall_on_the_default_node_lease() -> None:
    assert leader_ttl(1.0) > 3.0 and leader_ttl(30.0) >= 30.0


# -- the agent: fence only when neither the store nor the coordinator hears it -----------------
class _Keeper:
    def __init__(self, *, silent_s: float, lost: bool) -> None:
        self.lease = Lease(id=7, ttl=1.0)
        self.last_ok_sent = time.monotonic() - silent_s
        self.lost = threading.Event()
        if lost:
            self.lost.set()
        self.reason = "lease 7 lost: the lease expired" if lost else ""


def _lease() -> NodeLease:
    jobs: Any = None  # no store here: the lease's keeper is a fake and renewing does nothing
    lease = NodeLease(jobs, node="1", data_addr="127.0.0.1:1", ttl=1.0, send=lambda msg: None)
    lease._renew = lambda: None  # type: ignore[method-assign]
    return lease


@pytest.mark.parametrize(
    ("store_silent_s", "lost", "unacked_s", "fenced", "renews"),
    [
        (0.1, False, 5.0, False, False),  # the store hears it: the coordinator may be restarting
        (0.9, False, 0.1, False, False),  # a store stall while the coordinator hears it
        (0.1, True, 0.1, False, True),  # its lease lapsed, the coordinator hears it: a new one
        (0.1, True, 0.6, False, False),  # ... heard, but not recently enough to register again
        (0.9, False, 0.9, True, False),  # neither hears it
        (0.1, True, 0.9, True, False),
    ],
)
def test_an_agent_fences_only_when_neither_the_store_nor_the_coordinator_hears_it(
    store_silent_s: float, lost: bool, unacked_s: float, fenced: bool, renews: bool
) -> None:
    lease = _lease()
    keeper: Any = _Keeper(silent_s=store_silent_s, lost=lost)
    lease.keeper = keeper
    why = lease.judge(time.monotonic(), unacked_s, 1.0)
    assert (why is not None) == fenced
    assert (lease._renewing is not None) == renews
    if fenced:
        assert why is not None and "acknowledged nothing" in why


# -- a worker reconnecting to a restarted coordinator says where it is *now* ----------------------
def test_a_reconnecting_worker_reports_its_newest_step_not_the_one_when_the_link_broke(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from nonstop.train import link as link_mod

    step = {"now": 6}

    def resume() -> ResumeMsg:
        return ResumeMsg(gen=1, step=step["now"], done=step["now"] >= 16)

    hellos: list[dict[str, Any]] = []

    def connect(addr: Any, secret: Any, hello: dict[str, Any], timeout: float) -> object:
        hellos.append(hello)
        if len(hellos) < 3:
            step["now"] = 16  # it trained to the end while the coordinator was away
            raise ControlError("connection refused")
        return object()

    monkeypatch.setattr(link_mod, "connect", connect)
    monkeypatch.setattr(link_mod.time, "sleep", lambda s: None)
    link = link_mod.CoordinatorLink.__new__(link_mod.CoordinatorLink)
    link.env = SimpleNamespace(
        reconnect_s=30.0, control_addr=("127.0.0.1", 1), secret=b"x", role="worker", spawn_id=3
    )  # type: ignore[assignment]
    link._resume = resume
    link._subscription = None  # no Session.on_event subscription to repeat
    link.closing = False
    assert link._reconnect()
    assert hellos[0]["resume"]["step"] == 6
    assert hellos[-1]["resume"] == {"gen": 1, "step": 16, "done": True, "cadence": None}


def test_a_worker_that_finishes_while_its_hello_is_on_the_way_says_done_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hello's resume point said "not done"; the last step ended during the connect, and its
    done went to the dead connection: the link sends it on the new one (seen in a loaded CI: a
    job whose ranks all finished around a coordinator restart waited 6 minutes for the hang
    detector)."""
    from types import SimpleNamespace

    from nonstop.train import link as link_mod

    state: dict[str, Any] = {"step": 15, "done": False}
    sent: list[dict[str, Any]] = []

    def connect(addr: Any, secret: Any, hello: dict[str, Any], timeout: float) -> object:
        state.update(step=16, done=True)  # the main thread finished meanwhile
        return SimpleNamespace(send=sent.append)

    monkeypatch.setattr(link_mod, "connect", connect)
    link = link_mod.CoordinatorLink.__new__(link_mod.CoordinatorLink)
    link.env = SimpleNamespace(
        reconnect_s=30.0, control_addr=("127.0.0.1", 1), secret=b"x", role="worker", spawn_id=3
    )  # type: ignore[assignment]
    link._resume = lambda: ResumeMsg(gen=2, **state)
    link._subscription = None
    link.closing = False
    assert link._reconnect()
    assert sent == [{"t": "done", "gen": 2, "step": 16}]
    # one that had said done in its hello is not repeated
    sent.clear()
    assert link._reconnect() and sent == []


def test_process_age_counts_from_the_process_start() -> None:
    code = (
        "import time; time.sleep(1.0); "
        "from nonstop.coordinator import store_sync as s; print(s.process_age_s())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 1.0 <= float(out) < 60.0
