"""The node agents (coordinator/node_agents.py) and the job's start (coordinator/job_start.py),
each built alone (issue 46): a real view, a real executor over fake channels, an event log in a
temp dir, and fakes of only the peers it calls. What is asserted is what it sent, what it
emitted and what it asked its peers."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nonstop.control.channel import Channel
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.failures import ProcessEnd
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.job_start import JobStart
from nonstop.coordinator.node_agents import AgentTerms, NodeAgents
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog, read_events
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.phase import JobPhase
from nonstop.policy.reconfiguration import Failure
from nonstop.protocol.agent import (
    ExitMsg,
    FatalMsg,
    FetchRequestMsg,
    InventoryRequestMsg,
    LeaseMsg,
    RegisteredMsg,
    SpawnedMsg,
)
from nonstop.protocol.wire import Lost
from tests.coord_fakes import FakeChannel, FakeClock, add_member, logged


# -- fakes of the peers ----------------------------------------------------------------------------
class FakeStore:
    def __init__(self) -> None:
        self.reattached: list[tuple[str, Any]] = []
        self.revoked: list[str] = []

    def reattach(self, node: NodeRecord, chan: Channel) -> None:
        self.reattached.append((node.name, chan))

    def revoke(self, node: NodeRecord) -> None:
        self.revoked.append(node.name)


class FakeFetches:
    def __init__(self) -> None:
        self.waiting_fetch: dict[int, tuple[int, int]] = {}


class FakeRounds:
    def __init__(self) -> None:
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1


class FakeExits:
    def __init__(self) -> None:
        self.exits: list[ProcessEnd] = []

    def on_exit(self, ex: ProcessEnd) -> None:
        self.exits.append(ex)


def _terms(**over: Any) -> AgentTerms:
    base: dict[str, Any] = dict(
        nproc_per_node=2,
        lease_ttl_s=5.0,
        num_slots=2,
        replicas=0,
        worker_env={"A": "1"},
        store_mode=False,
        store=None,
        reconnect_s=30.0,
        elastic=False,
    )
    return AgentTerms(**{**base, **over})


class Agents:
    """A NodeAgents over a fresh view, with its fakes."""

    def __init__(self, tmp_path: Path, *, max_failures: int = 3, **terms: Any) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.path = tmp_path / "events.jsonl"
        self.view = JobView(job_id="job-7", world_size=2)
        self.clock = FakeClock()
        self.events = EventLog(self.path)
        self.io = Executor(self.view, self.events)
        self.life = JobLife(view=self.view, events=self.events, io=self.io, replicating=False)
        self.store, self.fetches, self.rounds, self.exits = (
            FakeStore(),
            FakeFetches(),
            FakeRounds(),
            FakeExits(),
        )
        self.agents = NodeAgents(
            view=self.view,
            io=self.io,
            events=self.events,
            life=self.life,
            terms=_terms(**terms),
            quarantine=QuarantinePolicy(max_failures=max_failures, window_s=60.0),
            store=self.store,
            fetches=self.fetches,
            rounds=self.rounds,
            clock=self.clock,
        )
        self.agents.bind(exits=self.exits)

    def hello(self, name: str, **fields: Any) -> FakeChannel:
        chan = FakeChannel({"role": "agent", "node": name, "nproc": 2, "data_addr": f"{name}:1", **fields})
        self.agents.on_open(chan)  # type: ignore[arg-type]
        return chan

    def kinds(self) -> list[str]:
        return [str(e["event"]) for e in read_events(self.path) if e["event"] != "eventlog"]

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return logged(self.path, kind)

    def worker(self, node: str, rank: int | None, role: Role = Role.WORKER) -> FakeChannel:
        w = add_member(self.view, node, role, rank)
        w.chan = FakeChannel({"role": str(role), "spawn_id": w.spawn_id})  # type: ignore[assignment]
        return w.chan  # type: ignore[return-value]


# -- NodeAgents: hello ----------------------------------------------------------------------------------
def test_an_agent_is_welcomed_with_the_jobs_terms_and_recorded(tmp_path: Path) -> None:
    a = Agents(tmp_path, replicas=1, num_slots=4)
    chan = a.hello("n0", spares=1, domain="rack1", lease_id=9, devices=2)
    assert chan.kinds() == ["welcome"] and not chan.closed
    assert chan.last("welcome") == {
        "t": "welcome",
        "job_id": "job-7",
        "lease_ttl_s": 5.0,
        "num_slots": 4,
        "replicas": 1,
        "env": {"A": "1"},
        "store": None,
        "reconnect_s": 30.0,
    }
    node = a.view.nodes["n0"]
    assert (node.spares, node.domain, node.data_addr, node.lease_id, node.devices) == (
        1,
        "rack1",
        "n0:1",
        9,
        2,
    )
    assert chan.tag == ("node", "n0") and node.chan is chan
    (joined,) = a.events_of("node_join")
    assert (joined["node"], joined["rejoin"]) == ("n0", False)
    assert a.io.pending == {} and [m for m in chan.sent if m["t"] == "spawn"] == []  # the start spawns


@pytest.mark.parametrize(
    ("setup", "hello", "reason"),
    [
        (None, {"node": ""}, "hello without a node name"),
        ("alive", {}, "node n0 is already part of the job"),
        ("quarantined", {}, "node n0 is quarantined after 2 failures"),
        (None, {"nproc": 3}, "node n0 runs --nproc-per-node 3 but the job has 2 per node"),
        ("ending", {}, "the job is ending"),
    ],
)
def test_an_agent_that_cannot_join_is_refused_with_why_and_closed(
    tmp_path: Path, setup: str | None, hello: dict[str, Any], reason: str
) -> None:
    a = Agents(tmp_path)
    if setup in ("alive", "quarantined"):
        a.hello("n0")
        if setup == "quarantined":
            a.view.nodes["n0"].alive = False
            a.view.nodes["n0"].quarantined = True
            a.view.nodes["n0"].failure_times = [1.0, 2.0]
    if setup == "ending":
        a.view.phase = JobPhase.FAILED
    chan = a.hello("n0", **hello)
    assert chan.kinds() == ["refused"] and chan.closed
    assert chan.sent[0]["error"].startswith(reason)
    assert a.events_of("refused")[-1]["reason"].startswith(reason)


def test_a_refusal_on_a_broken_channel_still_closes_it(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    chan = FakeChannel({"role": "agent", "node": "n0", "nproc": 7})
    chan.closed = True  # its send raises ControlError: dropped, as the executor's sends are
    a.agents.on_open(chan)  # type: ignore[arg-type]
    assert chan.sent == [] and "n0" not in a.view.nodes and a.kinds() == ["refused"]


def test_a_node_joining_a_running_job_brings_its_spares_and_in_an_elastic_job_room(tmp_path: Path) -> None:
    for elastic, want in ((False, 1), (True, 3)):
        a = Agents(tmp_path / str(elastic), elastic=elastic)
        a.view.phase = JobPhase.RUNNING
        chan = a.hello("n1", spares=1)
        spawns = [m for m in chan.sent if m["t"] == "spawn"]
        assert len(spawns) == want and {m["role"] for m in spawns} == {"spare"}
        assert a.view.spares_on("n1") == want


def test_store_mode_reattaches_an_agent_that_reconnects_to_a_restarted_coordinator(tmp_path: Path) -> None:
    a = Agents(tmp_path, store_mode=True, store="etcd://x:1")
    first = a.hello("n0")
    assert first.last("welcome")["store"] == "etcd://x:1"
    first.closed = True
    again = a.hello("n0", resume={})
    assert a.store.reattached == [("n0", again)] and again.sent == []
    a.view.nodes["n0"].chan = again
    refused = a.hello("n0", resume={})  # its channel is open: a second agent of one node
    assert refused.kinds() == ["refused"]


# -- NodeAgents: what an agent reports ------------------------------------------------------------------
def test_a_lease_is_noted_and_acknowledged_with_its_sequence_number(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    chan = a.hello("n0")
    node = a.view.nodes["n0"]
    node.last_lease = 0.0
    a.agents.on_lease(node, LeaseMsg(seq=12))
    assert chan.last("lease_ok") == {"t": "lease_ok", "seq": 12} and node.last_lease > 0.0
    a.agents.on_registered(node, RegisteredMsg(lease_id=44))
    assert node.lease_id == 44


def test_a_spawned_process_gets_its_pid_and_device(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.hello("n0")
    a.worker("n0", 0)
    sid = a.view.members[0]
    a.agents.on_spawned(a.view.nodes["n0"], SpawnedMsg(spawn_id=sid, pid=4321, device=1))
    w = a.view.workers[sid]
    assert (w.pid, w.local_rank) == (4321, 1)
    (spawned,) = a.events_of("spawned")
    assert (spawned["spawn_id"], spawned["pid"], spawned["node"]) == (sid, 4321, "n0")


def test_an_exit_goes_to_the_failures_once(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.hello("n0")
    a.worker("n0", 0)
    sid = a.view.members[0]
    a.agents.on_exited(ExitMsg(spawn_id=sid, rc=1, pid=10, fault_at=None))
    a.agents.on_exited(ExitMsg(spawn_id=sid, rc=1, pid=10, fault_at=None))  # (reported twice)
    a.agents.on_exited(ExitMsg(spawn_id=99, rc=1, pid=None, fault_at=None))  # (not a process of ours)
    assert a.exits.exits == [ProcessEnd(sid=sid, rc=1, pid=10, fault_at=None)]
    assert not a.view.workers[sid].live


def test_a_fatal_report_fails_the_job_naming_the_node(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.hello("n0")
    a.agents.on_fatal(a.view.nodes["n0"], FatalMsg(error="no shared memory"))
    assert a.view.phase is JobPhase.FAILED and a.life.error == "node n0: no shared memory"


def test_an_exit_before_bind_is_a_wiring_error(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.agents._exits = None
    a.hello("n0")
    a.worker("n0", 0)
    with pytest.raises(AssertionError, match="bind"):
        a.agents.on_exited(ExitMsg(spawn_id=a.view.members[0], rc=1, pid=None, fault_at=None))


# -- NodeAgents: leases, loss, quarantine -------------------------------------------------------------
def test_a_node_silent_past_its_lease_is_lost_with_every_process_on_it(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    agent = a.hello("n0")
    node = a.view.nodes["n0"]
    w0, w1 = a.worker("n0", 0), a.worker("n0", 1)
    fetch = a.io.request(node, FetchRequestMsg(rank=0, step=1, addr=node.data_addr, kind="local"))
    inventory = a.io.request(node, InventoryRequestMsg())
    a.fetches.waiting_fetch[fetch] = (0, 1)
    node.last_lease = 100.0
    a.agents.check_leases(now=104.0)  # within its TTL
    assert node.alive
    a.agents.check_leases(now=106.0)
    assert not node.alive and agent.closed and w0.closed and w1.closed
    assert [(ex.sid, ex.rc, ex.node_lost is not None) for ex in a.exits.exits] == [
        (a.view.members[0], -signal.SIGKILL, True),
        (a.view.members[1], -signal.SIGKILL, True),
    ]
    assert (
        isinstance(a.io.replies.get(inventory), Lost) and fetch not in a.io.replies
    )  # fetches: their generation's
    assert a.rounds.resets == 1 and len(node.failure_times) == 1
    (lost,) = a.events_of("node_lost")
    assert lost["reason"].startswith("lease expired") and not lost["quarantined"]
    assert "fenced" not in agent.kinds()


def test_in_store_mode_leases_are_not_checked_here(tmp_path: Path) -> None:
    a = Agents(tmp_path, store_mode=True)
    a.hello("n0")
    a.view.nodes["n0"].last_lease = 0.0
    a.agents.check_leases(now=1e9)
    assert a.view.nodes["n0"].alive


def test_a_closed_agent_channel_loses_the_node_or_in_store_mode_disconnects_it(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.hello("n0")
    a.agents.on_close(a.view.nodes["n0"])
    assert (
        not a.view.nodes["n0"].alive
        and a.events_of("node_lost")[0]["reason"] == "its agent's connection closed"
    )
    s = Agents(tmp_path / "store", store_mode=True)
    s.hello("n0")
    s.agents.on_close(s.view.nodes["n0"])
    node = s.view.nodes["n0"]
    assert node.alive and node.disconnected_at is not None and s.kinds()[-1] == "node_disconnected"


def test_a_node_that_fails_too_often_is_quarantined_fenced_and_its_lease_revoked(tmp_path: Path) -> None:
    a = Agents(tmp_path, max_failures=2, store_mode=True)
    agent = a.hello("n0", lease_id=5)
    a.hello("n1")
    a.agents.node_failed("n0")
    assert a.view.nodes["n0"].alive
    a.agents.node_failed("n0")
    node = a.view.nodes["n0"]
    assert not node.alive and node.quarantined and agent.closed
    assert agent.last("fenced")["error"].startswith("2 failures within 60s")
    assert a.store.revoked == ["n0"]
    assert a.events_of("node_lost")[0]["quarantined"] is True


def test_the_last_usable_node_is_never_quarantined(tmp_path: Path) -> None:
    a = Agents(tmp_path, max_failures=1)
    a.hello("n0")
    a.agents.node_failed("n0")
    assert a.view.nodes["n0"].alive and not a.view.nodes["n0"].quarantined


def test_a_drained_nodes_departure_does_not_count_as_a_failure(tmp_path: Path) -> None:
    a = Agents(tmp_path)
    a.hello("n0")
    a.agents.lose_node(a.view.nodes["n0"], "released after draining", failure=False)
    assert a.view.nodes["n0"].failure_times == [] and a.rounds.resets == 1


# -- NodeAgents: spares -------------------------------------------------------------------------------------
def test_spares_are_replenished_within_each_nodes_room(tmp_path: Path) -> None:
    a = Agents(tmp_path, elastic=True)
    n0 = a.hello("n0", spares=2)
    n1 = a.hello("n1", spares=1)
    a.view.nodes["n1"].draining = True
    a.worker("n0", 0)
    a.worker("n0", 1)
    a.worker("n0", None, Role.SPARE)
    a.agents.replenish_spares()
    # n0: 2 ranks + 1 spare of room for nproc 2 + spares 2: one more; n1 drains: none
    assert [m["role"] for m in n0.sent if m["t"] == "spawn"] == ["spare"]
    assert [m for m in n1.sent if m["t"] == "spawn"] == []


# -- JobStart -----------------------------------------------------------------------------------------------
class FakeGenerations:
    def __init__(self, initial_step: int | None = None) -> None:
        self.initial_step = initial_step
        self.resharded: list[dict[str, Any]] = []
        self.begun: list[list[Failure]] = []

    def reshard_first(self, source: dict[str, Any]) -> None:
        self.resharded.append(source)

    def begin(self, failures: list[Failure]) -> None:
        self.begun.append(failures)


class FakeInstaller:
    def __init__(self) -> None:
        self.asked: list[tuple[list[int], dict[str, list[int]], str]] = []
        self.done: Callable[[int | None], None] | None = None

    def install_durable(
        self, steps: list[int], placement: dict[str, list[int]], url: str, done: Callable[[int | None], None]
    ) -> None:
        self.asked.append((steps, placement, url))
        self.done = done


class Start:
    """A JobStart over a view with ``nodes`` joined (nproc 2, one spare each)."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        nodes: int = 2,
        nnodes: int = 2,
        initial_step: int | None = None,
        resume_url: str | None = "file:///ckpt",
        sharded: bool = False,
        written_world: int = 4,
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.path = tmp_path / "events.jsonl"
        self.view = JobView(job_id="j", world_size=4)
        self.chans: dict[str, FakeChannel] = {}
        for i in range(nodes):
            name = f"n{i}"
            self.chans[name] = chan = FakeChannel({"role": "agent", "node": name})
            self.view.nodes[name] = NodeRecord(
                name=name, chan=chan, nproc=2, spares=1, domain=name, data_addr="x", last_lease=0.0
            )  # type: ignore[arg-type]
        self.events = EventLog(self.path)
        self.io = Executor(self.view, self.events)
        self.life = JobLife(view=self.view, events=self.events, io=self.io, replicating=False)
        self.gens, self.installer = FakeGenerations(initial_step), FakeInstaller()
        self.read: list[tuple[str, int]] = []

        def world_at(url: str, step: int) -> int:
            self.read.append((url, step))
            return written_world

        self.start = JobStart(
            view=self.view,
            io=self.io,
            events=self.events,
            life=self.life,
            nnodes=nnodes,
            nproc_per_node=2,
            join_timeout_s=10.0,
            world_size=4,
            resume_url=resume_url,
            sharded=sharded,
            since=100.0,
            generations=self.gens,
            installer=self.installer,
            world_at=world_at,
        )

    def spawns(self) -> list[tuple[str, str, int | None]]:
        return [
            (n, m["role"], m.get("rank")) for n, c in self.chans.items() for m in c.sent if m["t"] == "spawn"
        ]

    def kinds(self) -> list[str]:
        return [str(e["event"]) for e in read_events(self.path) if e["event"] != "eventlog"]


def test_the_job_starts_once_every_node_joined_with_each_nodes_ranks_and_spares(tmp_path: Path) -> None:
    s = Start(tmp_path)
    s.start.check_join(now=101.0)
    assert s.spawns() == [
        ("n0", "worker", 0),
        ("n0", "worker", 1),
        ("n0", "spare", None),
        ("n1", "worker", 2),
        ("n1", "worker", 3),
        ("n1", "spare", None),
    ]
    assert s.kinds()[0] == "nodes_joined" and sorted(s.view.members) == [0, 1, 2, 3]
    s.start.check_join(now=102.0)  # started: nothing more
    assert len(s.spawns()) == 6


def test_the_job_waits_for_its_nodes_then_fails_at_the_join_timeout(tmp_path: Path) -> None:
    s = Start(tmp_path, nodes=1)
    s.start.check_join(now=109.0)
    assert s.view.phase is JobPhase.STARTING and s.spawns() == []
    s.start.check_join(now=111.0)
    assert s.view.phase is JobPhase.FAILED
    assert s.life.error is not None and s.life.error.startswith("only 1 of 2 nodes joined within 10s")


def test_a_resumed_checkpoint_is_installed_on_every_node_before_the_first_processes(tmp_path: Path) -> None:
    s = Start(tmp_path, initial_step=40)
    s.start.check_join(now=101.0)
    assert s.installer.asked == [([40], {"n0": [0, 1], "n1": [2, 3]}, "file:///ckpt")]
    assert s.spawns() == [] and s.start.starting
    s.start.check_join(now=102.0)  # the install is under way: no second one
    assert len(s.installer.asked) == 1
    assert s.installer.done is not None
    s.installer.done(40)
    assert len(s.spawns()) == 6 and s.read == []  # (not sharded: its world size is not read)


def test_a_resumed_checkpoint_that_installs_nowhere_fails_the_job(tmp_path: Path) -> None:
    s = Start(tmp_path, initial_step=40)
    s.start.check_join(now=101.0)
    assert s.installer.done is not None
    s.installer.done(None)
    assert s.view.phase is JobPhase.FAILED and s.spawns() == []
    assert s.life.error == "could not install the resumed checkpoint step 40 on every node"
    n = Start(tmp_path / "none", initial_step=40, resume_url=None)
    n.start.check_join(now=101.0)
    assert n.life.error == "could not install the resumed checkpoint step 40: no durable tier"


def test_a_sharded_checkpoint_of_another_size_is_resharded_not_installed(tmp_path: Path) -> None:
    s = Start(tmp_path, initial_step=40, sharded=True, written_world=8)
    s.start.check_join(now=101.0)
    assert s.read == [("file:///ckpt", 40)]
    assert s.gens.resharded == [{"url": "file:///ckpt", "step": 40, "world": 8}]
    assert s.installer.asked == [] and len(s.spawns()) == 6
    same = Start(tmp_path / "same", initial_step=40, sharded=True, written_world=4)
    same.start.check_join(now=101.0)
    assert same.gens.resharded == [] and len(same.installer.asked) == 1


def test_the_first_generation_begins_once_every_member_connected(tmp_path: Path) -> None:
    s = Start(tmp_path)
    s.start.connected()  # no members yet
    s.start.check_join(now=101.0)
    members = [s.view.workers[sid] for sid in s.view.members.values()]
    for w in members[:-1]:
        w.chan = FakeChannel({})  # type: ignore[assignment]
        s.start.connected()
    assert s.gens.begun == []
    members[-1].chan = FakeChannel({})  # type: ignore[assignment]
    s.start.connected()
    assert s.gens.begun == [[]]


def test_a_lease_is_judged_on_the_clock_the_node_agents_were_given(tmp_path: Path) -> None:
    """Issue 46, the clock comes in: a welcome and each renewal stamp the node on the operation's
    clock, so a fake one drives the lease past its TTL (5 s here) without a sleep."""
    a = Agents(tmp_path)
    a.hello("n0")
    node = a.view.nodes["n0"]
    assert node.last_lease == a.clock.monotonic()
    a.clock.advance(4.0)
    a.agents.on_lease(node, LeaseMsg(seq=1))
    a.clock.advance(4.0)
    a.agents.check_leases(a.clock.monotonic())  # 4 s since the renewal: kept
    assert node.alive
    a.clock.advance(1.5)
    a.agents.check_leases(a.clock.monotonic())
    assert not node.alive and node.failure_times == [a.clock.monotonic()]
