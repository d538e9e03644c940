"""The store sync built alone (issue 46: no operation holds the coordinator):
:class:`~nonstop.coordinator.store_sync.StoreSync` with a real view, a real executor over fake
channels, an event log in a temp dir, a job store over the embedded control store, and fakes of
only the peers it calls (the generations, the swaps, the node agents, the workers' protocol). A
whole coordinator restarting from the store is tests/coordinator/test_coordinator_ops.py and
tests/control/test_store_ridethrough.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nonstop.control.embedded import EmbeddedStore
from nonstop.control.jobstore import JobStore
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.store_sync import StoreSync
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog
from nonstop.policy.phase import Busy, JobPhase
from nonstop.policy.reconfiguration import Failure
from nonstop.protocol.worker import CadenceMsg, ResumeMsg
from tests.coord_fakes import FakeChannel, FakeClock, agent_chan, logged, worker_chan

TTL = 30.0  # the nodes' leases: nothing lapses on its own during a test


# -- fakes of the peers -----------------------------------------------------------------------------
class FakeGens:
    def __init__(self) -> None:
        self.begun: list[tuple[list[Failure], bool]] = []

    def begin(self, failures: list[Failure], *, inventory_needed: bool = False) -> None:
        self.begun.append((failures, inventory_needed))


class FakeSwaps:
    def __init__(self) -> None:
        self.requeued: list[tuple[list[Any], float]] = []

    def record(self) -> dict[str, Any]:
        return {"migrate_queue": [[0, "1", "drain"]], "migration": None, "grow": None}

    def requeue(self, rec: dict[str, Any], now: float) -> None:
        self.requeued.append((rec.get("migrate_queue", []), now))


class FakeNodes:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str]] = []

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None:
        node.alive = False
        self.lost.append((node.name, why))


class FakeWorkers:
    def __init__(self) -> None:
        self.cadences: list[object] = []

    def resumed_cadence(self, said: object) -> None:
        self.cadences.append(said)


class Parts:
    """Two nodes (0 plays rank 0 and holds a spare; 1 plays rank 1), the job running, and the store
    sync built from fakes (``jobs``: store mode)."""

    def __init__(self, tmp_path: Path, *, jobs: JobStore | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp_path = tmp_path
        self.view = view = JobView(job_id="j", world_size=2)
        for name in ("0", "1"):
            chan = FakeChannel({"role": "agent", "node": name}, peer=f"agent-{name}")
            view.nodes[name] = NodeRecord(
                name=name,
                chan=chan,
                nproc=1,
                spares=1,
                domain=name,
                data_addr="a",
                last_lease=time.monotonic(),
            )  # type: ignore[arg-type]
        self.members = [self._worker(str(rank), Role.WORKER, rank) for rank in (0, 1)]
        self.spare = self._worker("0", Role.SPARE, None)
        view.phase = JobPhase.RUNNING
        self.events = EventLog(tmp_path / "events.jsonl")
        self.io = Executor(view, self.events)
        self.life = JobLife(view=view, events=self.events, io=self.io, replicating=False)
        self.gens, self.swaps, self.nodes, self.workers = FakeGens(), FakeSwaps(), FakeNodes(), FakeWorkers()
        self.store = StoreSync(
            view=view,
            io=self.io,
            events=self.events,
            life=self.life,
            jobs=jobs,
            address=("127.0.0.1", 5000),
            lease_ttl_s=TTL,
            reconnect_s=60.0,
            store_url="etcd://127.0.0.1:1",
            swaps=self.swaps,
            clock=clock,
        )
        self.store.bind(nodes=self.nodes, workers=self.workers, gens=self.gens)

    def _worker(self, node: str, role: Role, rank: int | None) -> int:
        w = self.view.add_worker(node, role, rank, 0.0)
        w.chan = FakeChannel({"role": str(role)}, peer=f"worker-{w.spawn_id}")  # type: ignore[assignment]
        return w.spawn_id

    def chan(self, sid: int) -> FakeChannel:
        return worker_chan(self.view, sid)

    def agent(self, node: str) -> FakeChannel:
        return agent_chan(self.view, node)

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return logged(self.tmp_path / "events.jsonl", name)


@pytest.fixture
def jobs() -> Iterator[JobStore]:
    yield JobStore(EmbeddedStore(), "j")


# -- the record ---------------------------------------------------------------------------------------
def test_the_record_is_the_whole_view_and_the_swaps_part(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    rec = p.store.record()
    assert rec["job_id"] == "j" and rec["world_size"] == 2
    assert rec["migrate_queue"] == [[0, "1", "drain"]] and rec["migration"] is None


def test_a_restored_record_is_adopted_and_its_dead_nodes_lost(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.view.latest_step = {0: 5, 1: 5}
    rec = {**p.view.to_record(), "job_id": "the-old-job", "migrate_queue": [[1, None, "preempt"]]}
    rec["migration"] = {"rank": 1, "joiners": [p.spare], "told": [], "phase": "prepare", "swapped": False}
    q = Parts(tmp_path / "restarted")
    q.store.restore(rec, live={"0"})
    assert q.view.job_id == "the-old-job" and q.view.latest_step == {0: 5, 1: 5}
    assert q.nodes.lost == [("1", "its lease in the control store ended")]  # its lease ended meanwhile
    assert set(q.store.awaiting) == {"0"} and q.store.busy() == {Busy.RESYNCING}
    assert q.store.interrupted == {"migration": rec["migration"]}
    ((queued, _),) = q.swaps.requeued
    assert queued == [[1, None, "preempt"]]  # the queue is the swaps' to take back


def test_a_coordinator_resumed_mid_recovery_resyncs_once_its_nodes_are_back(
    tmp_path: Path, jobs: JobStore
) -> None:
    keepers = [jobs.register_node(name, "a", ttl=TTL) for name in ("0", "1")]
    p = Parts(tmp_path)
    p.view.phase = JobPhase.RECONFIGURING
    assert jobs.save(p.store.record())  # the dead coordinator's last record
    q = Parts(tmp_path / "restarted", jobs=jobs)
    q.store.open()
    try:
        [resumed] = q.events_named("coordinator_resumed")
        assert (
            resumed["nodes"] == ["0", "1"] and resumed["state"] == "reconfiguring" and resumed["lost"] == []
        )
        assert q.store.resync and q.swaps.requeued[0][0] == [[0, "1", "drain"]]
        q.store.tick()
        assert q.gens.begun == []  # its nodes are awaited first
        for name in ("0", "1"):
            q.store.reattach(q.view.nodes[name], FakeChannel({"role": "agent", "node": name}))  # type: ignore[arg-type]
        q.store.tick()
        assert q.gens.begun == [([], True)] and not q.store.resync and q.store.busy() == set()
    finally:
        q.store.close()
        for k in keepers:
            k.stop(revoke=True)


def test_a_resumed_coordinator_loses_a_node_that_does_not_reconnect_within_the_window(
    tmp_path: Path, jobs: JobStore
) -> None:
    keepers = [jobs.register_node(name, "a", ttl=TTL) for name in ("0", "1")]
    assert jobs.save(Parts(tmp_path).store.record())  # the dead coordinator's last record
    clock = FakeClock()
    q = Parts(tmp_path / "restarted", jobs=jobs, clock=clock)
    q.store.open()
    try:
        assert set(q.store.awaiting) == {"0", "1"}
        q.store.reattach(q.view.nodes["0"], FakeChannel({"role": "agent", "node": "0"}))  # type: ignore[arg-type]
        clock.advance(59.0)
        q.store.tick()  # within reconnect_s (60 s): node 1 is still awaited
        assert q.nodes.lost == [] and set(q.store.awaiting) == {"1"}
        clock.advance(2.0)
        q.store.tick()
        assert q.nodes.lost == [("1", "did not reconnect within 60s")] and not q.store.awaiting
    finally:
        q.store.close()
        for k in keepers:
            k.stop(revoke=True)


# -- nodes -------------------------------------------------------------------------------------------
def test_a_reattached_node_is_welcomed_on_its_new_channel(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.store.awaiting["1"] = 0.0
    chan = FakeChannel({"role": "agent", "node": "1", "lease_id": 42, "data_addr": "b"})
    p.store.reattach(p.view.nodes["1"], chan)  # type: ignore[arg-type]
    node = p.view.nodes["1"]
    assert node.chan is chan and node.lease_id == 42 and node.data_addr == "b" and chan.tag == ("node", "1")
    assert chan.sent == [{"t": "welcome", "job_id": "j", "resumed": True, "lease_ttl_s": TTL}]
    assert "1" not in p.store.awaiting and p.events_named("node_reconnected")[0]["node"] == "1"


def test_a_lease_ending_while_the_node_is_heard_lapses_else_loses_the_node(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.store.on_lease_ended(p.view.nodes["0"])  # heard just now
    assert "0" in p.store.lapsed and p.nodes.lost == []
    assert p.events_named("node_lease_lapsed")[0]["node"] == "0"
    p.view.nodes["1"].disconnected_at = time.monotonic()  # its channel is down: not heard
    p.store.on_lease_ended(p.view.nodes["1"])
    assert p.nodes.lost == [("1", "its lease in the control store ended")]


def test_a_node_lease_deleted_in_the_store_loses_an_unheard_node(tmp_path: Path, jobs: JobStore) -> None:
    keeper = jobs.register_node("1", "a", ttl=TTL)
    p = Parts(tmp_path, jobs=jobs)
    p.store.open()
    try:
        assert p.events_named("coordinator_leads")[0]["address"] == "127.0.0.1:5000"
        p.view.nodes["1"].chan = None  # not heard
        keeper.stop(revoke=True)
        deadline = time.monotonic() + 5.0
        while not p.nodes.lost and time.monotonic() < deadline:
            p.store.tick()
            time.sleep(0.01)
        assert p.nodes.lost == [("1", "its lease in the control store ended")]
    finally:
        p.store.close()
    assert jobs.load() is not None  # the final record reached the store


# -- workers and interrupted swaps ----------------------------------------------------------------------
def test_a_resumed_member_brings_its_progress_and_cadence_and_may_end_the_job(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.view.done_ranks.add(1)
    w = p.view.workers[p.members[0]]
    p.store.continue_on_resume.add(w.spawn_id)
    p.store.on_worker_resumed(
        w, ResumeMsg.decode({"gen": 0, "step": 9, "done": True, "cadence": {"every": 2, "since": 4}})
    )
    assert p.view.latest_step[0] == 9 and 0 in p.view.done_ranks
    assert p.workers.cadences == [CadenceMsg(every=2, since=4)]
    assert p.chan(w.spawn_id).kinds() == ["continue", "finish"]  # told to go on, then every rank is done
    assert p.view.phase is JobPhase.FINISHING and p.events_named("finish")


def test_a_stale_resume_point_is_ignored(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    w = p.view.workers[p.members[0]]
    p.store.on_worker_resumed(w, ResumeMsg.decode({"gen": 7, "step": 9, "cadence": {"every": 2}}))
    assert 0 not in p.view.latest_step and p.workers.cadences == [] and p.chan(w.spawn_id).sent == []


def test_an_unswapped_migration_is_aborted_when_the_nodes_are_back(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    told = p.spare
    untold = p._worker("1", Role.SPARE, None)
    for sid in (told, untold):
        p.view.workers[sid].role = Role.JOINER
    p.store.interrupted = {
        "migration": {
            "rank": 1,
            "joiners": [told, untold],
            "told": [told],
            "phase": "pause",
            "swapped": False,
        }
    }
    p.store.end_interrupted()
    assert p.view.workers[told].role is Role.RETIRED and p.view.workers[untold].role is Role.SPARE
    assert [m["t"] for m in p.agent("0").sent] == ["kill", "spawn"]  # a fresh spare in the told one's place
    for sid in p.members:
        assert p.chan(sid).kinds() == ["continue"]
    assert p.events_named("migration_aborted")[0]["error"] == "the coordinator restarted"
    assert p.store.interrupted == {} and not p.store.continue_on_resume


def test_a_swapped_operation_is_left_to_the_resync_generation(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.store.interrupted = {"grow": {"rank": 0, "joiners": [p.spare], "told": [p.spare], "swapped": True}}
    p.store.end_interrupted()
    assert p.events_named("operation_resumed")[0]["operation"] == "grow"
    assert p.agent("0").sent == [] and p.view.workers[p.spare].role is Role.SPARE
