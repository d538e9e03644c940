"""The coordinator's routing table (coordinator/routing.py), built alone: every operation it
routes to is a recorder, so a test reads which operation was handed each decoded message, in
what order, and that a malformed message fails its sender only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nonstop.coordinator.executor import Executor
from nonstop.coordinator.routing import Routes
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog, read_events
from tests.coord_fakes import FakeChannel


class Recorder:
    """Any operation: each call is logged as (operation, method); ``returns`` gives a method's answer."""

    def __init__(self, name: str, log: list[tuple[str, str]], **returns: Any) -> None:
        self._name, self._log, self._returns = name, log, returns
        self.channels: dict[int, Any] = {}  # (what the client requests keep)

    def __getattr__(self, method: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self._log.append((self._name, method))
            return self._returns.get(method)

        return call


class Table:
    def __init__(self, tmp_path: Path, **returns: dict[str, Any]) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.path = tmp_path / "events.jsonl"
        self.view = JobView(job_id="j", world_size=1)
        self.agent = FakeChannel({"role": "agent", "node": "n0"})
        self.agent.tag = ("node", "n0")
        self.view.nodes["n0"] = NodeRecord(
            name="n0", chan=self.agent, nproc=1, spares=0, domain="n0", data_addr="x", last_lease=0.0
        )  # type: ignore[arg-type]
        self.w = self.view.add_worker("n0", Role.WORKER, 0, 0.0)
        self.view.members[0] = self.w.spawn_id
        self.worker = FakeChannel({"role": "worker", "spawn_id": self.w.spawn_id})
        self.worker.tag = self.w.spawn_id
        self.w.chan = self.worker  # type: ignore[assignment]
        self.events = EventLog(self.path)
        self.calls: list[tuple[str, str]] = []
        names = ("agents", "workers", "clients", "failures", "health", "swaps", "sources", "replication")
        ops = {n: Recorder(n, self.calls, **returns.get(n, {})) for n in names}
        worker_returns = {"worker_of": self.w, "admit": 0, **returns.get("workers", {})}
        ops["workers"] = Recorder("workers", self.calls, **worker_returns)
        self.routes = Routes(
            view=self.view,
            io=Executor(self.view, self.events),
            events=self.events,
            rounds=Recorder("rounds", self.calls),  # type: ignore[arg-type]
            setup=Recorder("setup", self.calls),
            resize=Recorder("resize", self.calls),  # type: ignore[arg-type]
            kv=Recorder("kv", self.calls),  # type: ignore[arg-type]
            feed=Recorder("feed", self.calls),  # type: ignore[arg-type]
            detector=Recorder("detector", self.calls),  # type: ignore[arg-type]
            monitor=lambda: Recorder("monitor", self.calls),  # type: ignore[arg-type,return-value]
            **ops,  # type: ignore[arg-type]
        )

    def from_agent(self, msg: dict[str, Any]) -> list[tuple[str, str]]:
        self.calls.clear()
        self.routes.dispatch("msg", self.agent, msg)  # type: ignore[arg-type]
        return list(self.calls)

    def from_worker(self, msg: dict[str, Any]) -> list[tuple[str, str]]:
        self.calls.clear()
        self.routes.dispatch("msg", self.worker, {"gen": 0, **msg})  # type: ignore[arg-type]
        assert self.calls[:1] == [("workers", "worker_of")]  # (whose channel it is, first)
        return self.calls[1:]


def test_each_agent_message_goes_to_the_operation_that_owns_it(tmp_path: Path) -> None:
    t = Table(tmp_path)
    assert t.from_agent({"t": "lease", "seq": 1}) == [("agents", "on_lease")]
    assert t.from_agent({"t": "exit", "spawn_id": 0, "rc": 1}) == [("agents", "on_exited")]
    assert t.from_agent({"t": "judged", "spawn_id": 0, "hung": True}) == [("failures", "on_judged")]
    assert t.from_agent({"t": "replicated", "step": 1, "rank": 0, "ok": True}) == [
        ("replication", "on_replicated")
    ]
    assert t.from_agent({"t": "preempt", "grace_s": 30}) == [("swaps", "on_preempt")]
    assert t.from_agent({"t": "fatal", "error": "x"}) == [("agents", "on_fatal")]
    assert t.from_agent({"t": "health", "verdict": "failing"}) == [("health", "on_probe")]
    assert t.from_agent({"t": "persisted", "gen": 0}) == [("rounds", "on_reply")]
    assert t.from_agent({"t": "installed", "id": 3, "ok": True}) == []  # kept by the executor
    assert 3 in t.routes.io.replies


def test_a_fetch_answer_goes_to_the_swap_that_asked_else_to_the_restore_sources(
    tmp_path: Path,
) -> None:
    fetched = {"t": "fetched", "id": 4, "ok": True}
    owned = Table(tmp_path / "a", swaps={"owns": True})
    assert owned.from_agent(fetched) == [("swaps", "owns"), ("swaps", "on_fetched")]
    other = Table(tmp_path / "b", swaps={"owns": False})
    assert other.from_agent(fetched) == [("swaps", "owns"), ("sources", "on_fetched")]


def test_a_step_report_reaches_its_five_owners_in_order(tmp_path: Path) -> None:
    t = Table(tmp_path)
    assert t.from_worker({"t": "step", "step": 3, "step_s": 0.1}) == [
        ("workers", "admit"),
        ("workers", "on_step"),
        ("detector", "record_step"),
        ("swaps", "on_step"),
        ("health", "on_step"),
        ("setup", "report"),
        ("monitor", "on_step"),
        ("workers", "tune"),
    ]


def test_unfenced_messages_skip_the_fence_and_fenced_ones_stop_at_it(tmp_path: Path) -> None:
    t = Table(tmp_path)
    assert t.from_worker({"t": "hb", "coll": False}) == [("workers", "on_heartbeat")]
    assert t.from_worker({"t": "subscribe", "kinds": None}) == [("feed", "subscribe")]
    assert t.from_worker({"t": "fault", "error": "x", "usage": True}) == [("workers", "on_usage_fault")]
    assert t.from_worker({"t": "nonsense"}) == []
    fenced = Table(tmp_path / "fenced", workers={"admit": None})
    assert fenced.from_worker({"t": "done", "step": 9}) == [("workers", "admit")]


def test_a_joiners_preparation_goes_to_the_swaps_and_a_members_restore_to_the_setup(tmp_path: Path) -> None:
    joiner = Table(tmp_path / "a", swaps={"on_restored": True})
    assert joiner.from_worker({"t": "restored"}) == [("swaps", "on_restored")]
    member = Table(tmp_path / "b", swaps={"on_restored": False})
    assert member.from_worker({"t": "restored"}) == [
        ("swaps", "on_restored"),
        ("workers", "admit"),
        ("setup", "report"),
    ]


def test_a_malformed_agent_message_loses_its_node_and_a_workers_closes_its_channel(tmp_path: Path) -> None:
    t = Table(tmp_path)
    assert t.from_agent({"t": "exit", "spawn_id": "zero"}) == [("agents", "lose_node")]
    assert t.from_worker({"t": "step", "step": "three"}) == []
    assert t.worker.closed and t.w.chan_closed_at is not None
    errors = [e for e in read_events(t.path) if e["event"] == "protocol_error"]
    assert [(e.get("node"), e.get("spawn_id")) for e in errors] == [("n0", None), (None, t.w.spawn_id)]


def test_an_agents_hello_close_and_a_workers_go_to_their_operations(tmp_path: Path) -> None:
    t = Table(tmp_path)
    t.routes.dispatch("open", FakeChannel({"role": "agent", "node": "n1"}), None)  # type: ignore[arg-type]
    t.routes.dispatch("close", t.agent, None)  # type: ignore[arg-type]
    t.routes.dispatch("open", FakeChannel({"role": "worker", "spawn_id": 5}), None)  # type: ignore[arg-type]
    t.routes.dispatch("close", t.worker, None)  # type: ignore[arg-type]
    assert t.calls == [
        ("agents", "on_open"),
        ("agents", "on_close"),
        ("workers", "on_open"),
        ("workers", "worker_of"),
        ("workers", "on_close"),
    ]
