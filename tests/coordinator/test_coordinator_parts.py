"""The coordinator's operations built alone, from fakes of their collaborators (issue 46: no
operation holds the coordinator). Each test constructs one operation with a real view, a real
executor over fake channels and an event log in a temp dir, and fakes of only the peers it calls.
The whole coordinator driven through fake channels is tests/coordinator/test_coordinator_ops.py."""

from __future__ import annotations

import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import pytest

from nonstop import events as ev
from nonstop.config import DetectorConfig
from nonstop.coordinator.client_requests import ClientRequests, JobFacts
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.failures import Failures, ProcessEnd
from nonstop.coordinator.health import Health
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.persistence import PersistOps
from nonstop.coordinator.plan_asks import PlanAsks
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog, read_events
from nonstop.policy.decisions import FailureKind, QuarantinePolicy
from nonstop.policy.grading import Grade, Graded
from nonstop.policy.phase import Busy, JobPhase, Op
from nonstop.policy.planning import Pending
from nonstop.policy.reconfiguration import Failure
from nonstop.policy.straggler import StragglerConfig
from tests.coord_fakes import FakeChannel, agent_chan


# -- the parts every operation is built from --------------------------------------------------------
def _job(tmp_path: Path, *, world: int = 2, nodes: int = 1) -> tuple[JobView, Executor, EventLog, JobLife]:
    view = JobView(job_id="j", world_size=world)
    for i in range(nodes):
        chan = FakeChannel({"role": "agent", "node": str(i)}, peer=f"agent-{i}")
        view.nodes[str(i)] = NodeRecord(
            name=str(i), chan=chan, nproc=world, spares=0, domain=str(i), data_addr="x", last_lease=0.0
        )  # type: ignore[arg-type]
    events = EventLog(tmp_path / "events.jsonl")
    io = Executor(view, events)
    return view, io, events, JobLife(view=view, events=events, io=io, replicating=False)


def _member(view: JobView, rank: int, node: str = "0") -> FakeChannel:
    w = view.add_worker(node, Role.WORKER, rank, 0.0)
    w.chan = FakeChannel({"role": "worker"}, peer=f"worker-{rank}")  # type: ignore[assignment]
    view.members[rank] = w.spawn_id
    view.rank_node[rank] = node
    return w.chan  # type: ignore[return-value]


def _kinds(tmp_path: Path) -> list[str]:
    return [str(e["event"]) for e in read_events(tmp_path / "events.jsonl")]


def _agent(view: JobView, node: str = "0") -> FakeChannel:
    return agent_chan(view, node)


# -- JobLife ------------------------------------------------------------------------------------------
def test_job_life_asks_each_operation_what_it_has_under_way(tmp_path: Path) -> None:
    view, _, _, life = _job(tmp_path)
    view.phase = JobPhase.RUNNING
    swapping: set[Busy] = set()
    life.busy_from(lambda: set(swapping))
    assert life.may_start(Op.REPLICATE) and life.busy() == set()
    swapping.add(Busy.SWAPPING)
    assert life.busy() == {Busy.SWAPPING}
    view.done_ranks.add(0)
    assert life.busy() == {Busy.SWAPPING, Busy.ENDING}


def test_job_life_fails_once_and_tells_every_worker(tmp_path: Path) -> None:
    view, _, _, life = _job(tmp_path)
    chans = [_member(view, 0), _member(view, 1)]
    life.fail("first", usage=True)
    life.fail("second")
    assert view.phase is JobPhase.FAILED and life.error == "first" and life.usage_error
    assert [c.kinds() for c in chans] == [["abort"], ["abort"]]
    assert _kinds(tmp_path).count("job_failed") == 1


def test_job_life_finishes_after_its_hooks(tmp_path: Path) -> None:
    view, _, _, life = _job(tmp_path)
    view.phase = JobPhase.RUNNING
    chan = _member(view, 0)
    order: list[str] = []
    life.before_finish(lambda: order.append(f"hook in {view.phase}"))
    life.finish()
    assert order == ["hook in running"] and view.phase is JobPhase.FINISHING
    assert chan.kinds() == ["finish"]


def test_the_committed_step_is_the_slowest_ranks_or_the_replicated_one(tmp_path: Path) -> None:
    view, io, events, _ = _job(tmp_path)
    view.latest_step.update({0: 7, 1: 5})
    view.replicated_step = 3
    assert JobLife(view=view, events=events, io=io, replicating=False).committed() == 5
    assert JobLife(view=view, events=events, io=io, replicating=True).committed() == 3


def test_the_view_adopts_a_record_in_place(tmp_path: Path) -> None:
    view, io, _, _ = _job(tmp_path)
    other = JobView(job_id="j", world_size=2, generation=9)
    view.adopt(other)
    assert io.view is view and view.generation == 9


# -- Failures -------------------------------------------------------------------------------------------
class FakeSwaps:
    def __init__(self) -> None:
        self.exits: list[tuple[int, bool]] = []
        self.aborted: list[tuple[str, list[int]]] = []

    def on_exit(self, sid: int, *, member: bool, how: str) -> None:
        self.exits.append((sid, member))

    def abort(self, why: str, *, failed: Collection[int] = ()) -> None:
        self.aborted.append((why, list(failed)))


class FakeGrader:
    def __init__(self, grade: Grade = Grade.RESTART_IN_PLACE) -> None:
        self.grade_as = grade
        self.graded: list[tuple[int | None, FailureKind]] = []

    def grade(self, *, rank: int | None, kind: FailureKind, **_: Any) -> Graded:
        self.graded.append((rank, kind))
        return Graded(grade=self.grade_as, reason="fake")


class FakeNodes:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.lost: list[tuple[str, str, bool]] = []

    def node_failed(self, name: str) -> None:
        self.failed.append(name)

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None:
        self.lost.append((node.name, why, quarantine))


class FakeRecovery:
    def __init__(self) -> None:
        self.recovered: list[list[Failure]] = []
        self.training = True
        self.still_rebuilding: set[int] = set()

    def recover(self, failures: list[Failure]) -> None:
        self.recovered.append(failures)

    def in_training(self) -> bool:
        return self.training

    def rebuilding(self) -> set[int]:
        return set(self.still_rebuilding)


def _failures(
    tmp_path: Path, *, max_restarts: int = 3, grade: Grade = Grade.RESTART_IN_PLACE
) -> tuple[Failures, JobView, FakeSwaps, FakeGrader, FakeNodes, FakeRecovery]:
    view, io, events, life = _job(tmp_path)
    swaps, grader, nodes, recovery = FakeSwaps(), FakeGrader(grade), FakeNodes(), FakeRecovery()
    failures = Failures(
        view=view,
        io=io,
        events=events,
        life=life,
        detector=FailureDetector(DetectorConfig()),
        max_restarts=max_restarts,
        faults_dir=tmp_path / "faults",
        swaps=swaps,
        grader=grader,
        nodes=nodes,
        recovery=recovery,
    )
    return failures, view, swaps, grader, nodes, recovery


def test_a_members_exit_is_graded_recorded_and_handed_to_the_recovery(tmp_path: Path) -> None:
    failures, view, swaps, grader, nodes, recovery = _failures(tmp_path)
    view.phase = JobPhase.RUNNING
    _member(view, 0)
    _member(view, 1)
    sid = view.members[1]
    failures.on_exit(ProcessEnd(sid=sid, rc=-9, pid=None, fault_at=None))
    assert failures.waiting({sid}) and not failures.waiting({view.members[0]})
    failures.handle_exits()
    assert not failures.waiting({sid})
    assert swaps.exits == [(sid, True)] and swaps.aborted and swaps.aborted[0][1] == [sid]
    assert grader.graded == [(1, FailureKind.KILLED)] and nodes.failed == ["0"]
    (batch,) = recovery.recovered
    assert [(f.rank, f.kind) for f in batch] == [(1, FailureKind.KILLED.value)]
    assert 1 not in view.members and view.failures_total == 1
    assert "failure" in _kinds(tmp_path)


def test_past_the_restart_budget_the_job_fails_instead_of_recovering(tmp_path: Path) -> None:
    failures, view, _, _, _, recovery = _failures(tmp_path, max_restarts=0)
    view.phase = JobPhase.RUNNING
    _member(view, 0)
    failures.on_exit(ProcessEnd(sid=view.members[0], rc=1, pid=None, fault_at=None))
    failures.handle_exits()
    assert recovery.recovered == [] and view.phase is JobPhase.FAILED


def test_a_failure_graded_fail_job_ends_the_job(tmp_path: Path) -> None:
    failures, view, _, _, _, recovery = _failures(tmp_path, grade=Grade.FAIL_JOB)
    view.phase = JobPhase.RUNNING
    _member(view, 0)
    failures.on_exit(ProcessEnd(sid=view.members[0], rc=1, pid=None, fault_at=None))
    failures.handle_exits()
    assert recovery.recovered == [] and view.phase is JobPhase.FAILED


def test_a_spares_exit_costs_a_new_spare_and_no_recovery(tmp_path: Path) -> None:
    failures, view, _, _, _, recovery = _failures(tmp_path)
    view.phase = JobPhase.RUNNING
    spare = view.add_worker("0", Role.SPARE, None, 0.0)
    spare.chan = FakeChannel({"role": "worker"})  # type: ignore[assignment]
    failures.on_exit(ProcessEnd(sid=spare.spawn_id, rc=1, pid=None, fault_at=None))
    failures.handle_exits()
    assert recovery.recovered == [] and _agent(view).kinds() == ["spawn"]


def test_a_silent_member_is_judged_by_its_agent_and_a_speaking_one_is_left(tmp_path: Path) -> None:
    failures, view, _, _, _, recovery = _failures(tmp_path)
    view.phase = JobPhase.RECONFIGURING
    _member(view, 0)
    _member(view, 1)
    recovery.training = False  # a generation being set up: only silence counts
    view.workers[view.members[0]].last_hb = time.monotonic()
    failures.detect()
    (kill,) = _agent(view).sent
    assert kill["t"] == "kill" and kill["spawn_id"] == view.members[1] and kill["unless_moving"]
    assert view.workers[view.members[1]].judging_since is not None


# -- Health ---------------------------------------------------------------------------------------------
class FakeMover:
    def __init__(self, moving: bool = False) -> None:
        self.moving = moving
        self.asked: list[tuple[int, str | None, str]] = []

    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        self.asked.append((rank, target, reason))
        return None


def test_health_grades_a_failure_and_shows_it_in_status(tmp_path: Path) -> None:
    view, _, events, _ = _job(tmp_path)
    health = Health(
        view=view,
        events=events,
        config=StragglerConfig(),
        quarantine=QuarantinePolicy(max_failures=3, window_s=60.0),
        mover=FakeMover(),
    )
    graded = health.grade(rank=0, spawn_id=1, node="0", kind=FailureKind.EXIT, returncode=1, exception=None)
    assert graded.grade is Grade.RESTART_IN_PLACE
    assert health.status()["grades"][0]["rank"] == 0
    assert "failure_graded" in _kinds(tmp_path)


def test_health_hears_of_a_finished_migration_through_the_events(tmp_path: Path) -> None:
    view, _, events, _ = _job(tmp_path)
    health = Health(
        view=view,
        events=events,
        config=StragglerConfig(migration_cost_s=9.0),
        quarantine=QuarantinePolicy(max_failures=3, window_s=60.0),
        mover=FakeMover(),
    )
    assert health.cost_s is None
    events.emit(
        ev.MigrationDone(
            rank=0,
            source="0",
            target="1",
            boundary=5,
            stages={},
            max_step_gap_s=2.0,
            median_step_s=1.0,
            pause_ratio=2.0,
            reason="test",
            catchup_rounds=0,
            swap_delta=False,
        )
    )
    assert health.cost_s is not None


# -- PersistOps -----------------------------------------------------------------------------------------
class FakeRounds:
    def __init__(self) -> None:
        self.round: Any = None
        self.last_step: int | None = None
        self.last_error: str | None = None
        self.started: list[int] = []

    def check(self, alive: set[str]) -> None:
        pass

    def wanted(self, committed: int) -> bool:
        return True

    def start(self, step: int, placement: dict[int, str]) -> None:
        self.started.append(step)
        self.last_step = step

    def request(self) -> int:
        return 0

    def abort(self, why: str) -> None:
        self.round = None


class FakeStore:
    def __init__(self, busy: set[Busy]) -> None:
        self.under_way = busy

    def busy(self) -> set[Busy]:
        return set(self.under_way)


class FakeClients:
    def __init__(self) -> None:
        self.answered = 0

    def answer_persists(self) -> None:
        self.answered += 1


@pytest.mark.parametrize("resyncing", [False, True])
def test_persist_rounds_start_when_due_unless_the_store_resyncs(tmp_path: Path, resyncing: bool) -> None:
    view, _, _, life = _job(tmp_path)
    view.phase = JobPhase.RUNNING
    view.latest_step.update({0: 4, 1: 4})
    view.rank_node.update({0: "0", 1: "0"})
    rounds, clients = FakeRounds(), FakeClients()
    ops = PersistOps(
        view=view,
        life=life,
        rounds=rounds,  # type: ignore[arg-type]
        timeout_s=1.0,
        store=FakeStore({Busy.RESYNCING} if resyncing else set()),
        clients=clients,
    )
    ops.tick()
    assert rounds.started == ([] if resyncing else [4])


def test_the_final_persist_answers_the_waiting_clients(tmp_path: Path) -> None:
    view, _, _, life = _job(tmp_path)
    view.phase = JobPhase.DONE
    view.latest_step.update({0: 6, 1: 6})
    view.rank_node.update({0: "0", 1: "0"})
    rounds, clients = FakeRounds(), FakeClients()
    ops = PersistOps(
        view=view,
        life=life,
        rounds=rounds,
        timeout_s=1.0,
        store=FakeStore(set()),
        clients=clients,  # type: ignore[arg-type]
    )
    assert ops.final_tick() and rounds.started == [6] and clients.answered == 1


# -- PlanAsks -------------------------------------------------------------------------------------------
def test_plan_asks_every_live_node_and_the_survivors_only_when_they_have_rescues(tmp_path: Path) -> None:
    view, io, _, _ = _job(tmp_path, nodes=2)
    chans = [_member(view, 0, "0"), _member(view, 1, "1")]
    rescues = {"on": False}
    asks = PlanAsks(view=view, io=io, rescue_wait_s=2.0, mesh=None, rescues=lambda: rescues["on"])
    fail = Failure(kind="exit", rank=1, spawn_id=99, detail="x", detected_at=0.0, fault_at=None, step=3)
    asks.ask(Pending(failures=[fail], replans=0, replacements={}, rescue=True), now=0.0)
    assert [_agent(view, n).kinds() for n in ("0", "1")] == [["inventory"], ["inventory"]]
    assert [c.kinds() for c in chans] == [[], []]
    asks.drop()
    rescues["on"] = True
    asks.ask(Pending(failures=[fail], replans=0, replacements={}, rescue=True), now=0.0)
    assert [c.kinds() for c in chans] == [["leave"], ["leave"]]


# -- ClientRequests -------------------------------------------------------------------------------------
class FakeDesk:
    def __init__(self) -> None:
        self.clients: dict[int, list[Any]] = {}
        self.asked: list[tuple[int, str | None, str]] = []

    def request_migration(self, rank: int, target: str | None, reason: str) -> str | None:
        self.asked.append((rank, target, reason))
        return "refused for the test" if rank == 1 else None

    def status(self) -> dict[str, Any]:
        return {"migrations": []}


class FakePart:
    def status(self) -> dict[str, Any]:
        return {"health": {}}

    def data_shards(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r,) for r in range(world_size))


def _clients(tmp_path: Path) -> tuple[ClientRequests, JobView, FakeDesk]:
    view, io, _, life = _job(tmp_path)
    desk = FakeDesk()
    facts = JobFacts(
        job_id="j", durable_url=None, num_shards=2, full_world_size=2, min_world_size=1, store=None
    )
    part = FakePart()
    req = ClientRequests(
        view=view,
        io=io,
        life=life,
        facts=facts,
        persister=None,
        rounds=None,
        swaps=desk,
        health=part,
        resize=part,
    )
    return req, view, desk


def test_a_drain_asks_to_move_every_rank_of_the_node_and_says_which_it_accepted(tmp_path: Path) -> None:
    req, view, desk = _clients(tmp_path)
    _member(view, 0)
    _member(view, 1)
    client = FakeChannel({"role": "client"})
    req.on_request(client, {"t": "drain", "node": "0"})  # type: ignore[arg-type]
    assert desk.asked == [(0, None, "drain"), (1, None, "drain")]
    assert client.kinds() == ["migrated", "accepted"] and client.last("migrated")["rank"] == 1
    assert desk.clients == {0: [client]}


def test_status_and_persist_requests_are_answered_from_the_parts(tmp_path: Path) -> None:
    req, view, _ = _clients(tmp_path)
    _member(view, 0)
    client = FakeChannel({"role": "client"})
    req.on_request(client, {"t": "status"})  # type: ignore[arg-type]
    st = client.last("status")
    assert st["job_id"] == "j" and st["shards"] == {"0": [0], "1": [1]} and st["health"] == {}
    req.on_request(client, {"t": "persist"})  # type: ignore[arg-type]
    assert "no durable tier" in client.last("persisted")["error"]
