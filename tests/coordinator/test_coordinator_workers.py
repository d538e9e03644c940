"""The workers' protocol on the coordinator (coordinator/workers.py), built alone (issue 46): a
real view, a real executor over fake channels, an event log in a temp dir, and fakes of only the
peers it calls (the job's start, the generation being set up, store mode's resume). What is
asserted is what it sent, what it emitted and what it told its peers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nonstop.config import JobConfig, SnapshotConfig, SnapshotMode
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.view import JobView, NodeRecord, Role, WorkerRecord
from nonstop.coordinator.workers import WorkerProtocol, cadence_tuner
from nonstop.events.log import EventLog
from nonstop.policy.cadence import Cadence
from nonstop.policy.phase import JobPhase
from nonstop.policy.reconfiguration import Joined, Launched, Reconfiguration, RecoveryEvent, Stepped
from nonstop.protocol.base import RawMsg
from nonstop.protocol.worker import DoneMsg, FaultMsg, HeartbeatMsg, InjectedMsg, ReadyMsg, ResumeMsg, StepMsg
from tests.coord_fakes import FakeChannel, add_member, logged


class FakeStart:
    def __init__(self) -> None:
        self.connects = 0

    def connected(self) -> None:
        self.connects += 1


class FakeSetup:
    def __init__(self, reconf: Reconfiguration | None = None) -> None:
        self.reconf = reconf
        self.reports: list[RecoveryEvent] = []

    def report(self, event: RecoveryEvent) -> None:
        self.reports.append(event)


class FakeResumes:
    def __init__(self) -> None:
        self.resumed: list[tuple[int, ResumeMsg]] = []

    def on_worker_resumed(self, w: WorkerRecord, resume: ResumeMsg) -> None:
        self.resumed.append((w.spawn_id, resume))


class FakeTuner:
    """A cadence tuner that widens the interval at the step it is told to."""

    def __init__(self, *, widen_at: int) -> None:
        self.widen_at = widen_at
        self.current = Cadence(every=1)
        self.refusal: str | None = None
        self.measured: tuple[float, float] | None = (0.2, 1.0)
        self.budget = 0.05

    def on_step(self, *, step: int, **_: Any) -> Cadence | None:
        if step != self.widen_at:
            return None
        self.current = Cadence(every=4, since=step + 2)
        return self.current


class Workers:
    """A WorkerProtocol over a view with node ``n0`` (world 2), with its fakes."""

    def __init__(
        self, tmp_path: Path, *, reconf: Reconfiguration | None = None, cadence: Any = None, every: int = 1
    ) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.path = tmp_path / "events.jsonl"
        self.view = JobView(job_id="j", world_size=2)
        self.agent = FakeChannel({"role": "agent", "node": "n0"})
        self.view.nodes["n0"] = NodeRecord(
            name="n0", chan=self.agent, nproc=2, spares=1, domain="n0", data_addr="x", last_lease=0.0
        )  # type: ignore[arg-type]
        self.events = EventLog(self.path)
        self.io = Executor(self.view, self.events)
        self.life = JobLife(view=self.view, events=self.events, io=self.io, replicating=False)
        self.start, self.setup, self.resumes = FakeStart(), FakeSetup(reconf), FakeResumes()
        self.workers = WorkerProtocol(
            view=self.view,
            io=self.io,
            events=self.events,
            life=self.life,
            cadence=cadence,
            snapshot_every=every,
            start=self.start,
            setup=self.setup,
            resumes=self.resumes,
        )

    def process(self, rank: int | None, role: Role = Role.WORKER) -> WorkerRecord:
        return add_member(self.view, "n0", role, rank)

    def connect(self, w: WorkerRecord, **hello: Any) -> FakeChannel:
        chan = FakeChannel({"role": str(w.role), "spawn_id": w.spawn_id, **hello})
        self.workers.on_open(chan)  # type: ignore[arg-type]
        return chan

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return logged(self.path, kind)


# -- connections --------------------------------------------------------------------------------------
def test_a_launched_process_connects_and_while_the_job_starts_the_start_hears_of_it(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    chan = s.connect(w)
    assert w.chan is chan and chan.tag == w.spawn_id and not chan.closed
    assert s.workers.worker_of(chan) is w and s.start.connects == 1
    (connect,) = s.events_of("connect")
    assert (connect["spawn_id"], connect["rank"], connect["resumed"]) == (w.spawn_id, 0, False)


def test_an_unknown_duplicate_or_fenced_spawn_id_is_refused_and_closed(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    s.connect(w)
    stranger = FakeChannel({"role": "worker", "spawn_id": 77})
    s.workers.on_open(stranger)  # type: ignore[arg-type]
    duplicate = s.connect(w)
    lost = s.process(1)
    s.view.nodes["n0"].alive = False
    on_lost_node = s.connect(lost)
    assert stranger.closed and duplicate.closed and on_lost_node.closed
    assert [e["reason"] for e in s.events_of("refused")] == [
        "unknown, duplicate or fenced spawn id 77",
        f"unknown, duplicate or fenced spawn id {w.spawn_id}",
        f"unknown, duplicate or fenced spawn id {lost.spawn_id}",
    ]
    assert s.workers.worker_of(duplicate) is None and s.start.connects == 1


def test_a_worker_reconnecting_to_a_restarted_coordinator_is_handed_to_store_mode(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    old = s.connect(w)
    old.closed = True
    chan = s.connect(w, resume={"gen": 3, "step": 9})
    assert w.chan is chan and s.resumes.resumed == [(w.spawn_id, ResumeMsg(gen=3, step=9))]
    assert s.start.connects == 1 and s.events_of("connect")[-1]["resumed"] is True


def test_a_spare_that_comes_up_first_takes_the_rank_a_cold_process_was_launched_for(tmp_path: Path) -> None:
    r = Reconfiguration(generation=1, world_size=2, failures=[], waiting_launch={1})
    s = Workers(tmp_path, reconf=r)
    s.view.phase = JobPhase.RECONFIGURING
    s.process(0)
    cold = s.process(1)
    spare = s.process(None, Role.SPARE)
    s.connect(spare)
    assert (spare.role, spare.rank, s.view.members[1]) == (Role.WORKER, 1, spare.spawn_id)
    assert (cold.role, cold.rank) == (Role.SPARE, None) and r.replacements == {1: "spare"}
    (took,) = s.events_of("spare_takes_over")
    assert (took["rank"], took["spawn_id"], took["cold_spawn_id"]) == (1, spare.spawn_id, cold.spawn_id)
    assert [type(e) for e in s.setup.reports] == [Launched] and s.setup.reports[0].rank == 1
    assert s.start.connects == 0


def test_a_closed_channel_is_timed_for_the_detector(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    s.connect(w)
    s.workers.on_close(w)
    assert w.chan_closed_at is not None


# -- unfenced messages ---------------------------------------------------------------------------------
def test_a_heartbeat_says_where_the_worker_is_and_clears_its_excuse(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    w.excused = True
    s.workers.on_heartbeat(w, HeartbeatMsg(coll=True, idle_s=0.5, moving=False), now=42.0)
    assert (w.last_hb, w.coll, w.idle_s, w.moving, w.excused) == (42.0, True, 0.5, False, False)


def test_an_injected_fault_is_timed_and_logged(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(1)
    s.workers.on_injected(w, InjectedMsg(ts=12.5, rank=1, step=3, kind="kill"))
    (fired,) = s.events_of("fault_injected")
    assert w.fault_at == 12.5 and (fired["rank"], fired["step"], fired["kind"]) == (1, 3, "kill")


def test_a_usage_fault_fails_the_job_as_the_scripts_mistake(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    spare = s.process(None, Role.SPARE)
    s.workers.on_usage_fault(spare, FaultMsg(gen=0, error="state= is not Stateful", usage=True))
    assert s.view.phase is JobPhase.FAILED and s.life.usage_error
    assert s.life.error == f"process {spare.spawn_id}: state= is not Stateful"


# -- the fence ------------------------------------------------------------------------------------------
def test_only_a_member_of_the_current_generation_is_admitted(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    s.view.generation = 2
    w = s.process(0)
    chan = s.connect(w)
    assert s.workers.admit(w, StepMsg(gen=2, step=1, step_s=0.1), {}) == 0
    assert s.workers.admit(w, StepMsg(gen=1, step=1, step_s=0.1), {}) is None
    spare = s.process(None, Role.SPARE)
    assert s.workers.admit(spare, DoneMsg(gen=2, step=1), {}) is None
    assert chan.sent == []  # fenced reports are dropped silently ...


def test_a_fenced_rendezvous_request_is_answered_why(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    s.view.generation = 2
    w = s.process(0)
    chan = s.connect(w)
    raw = {"t": "kv", "id": 5, "gen": 1, "op": "get", "key": "k"}
    assert s.workers.admit(w, RawMsg(gen=1, msg=raw), raw) is None
    (answer,) = chan.sent  # ... but a rendezvous caller must not wait
    assert answer["id"] == 5 and "fenced: not a member of this generation" in answer["error"]


def test_a_members_rescue_report_counts_from_the_generation_a_plan_leaves(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    s.view.generation = 3
    w = s.process(0)
    w.told_gen = 2
    rescue: Any = ("a report",)
    assert s.workers.admit(w, FaultMsg(gen=2, error="peer died", rescue=rescue), {}) is None
    assert w.rescue == rescue


# -- a member's reports -------------------------------------------------------------------------------
def test_a_step_is_committed_only_once_snapshotted(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    s.workers.on_step(w, 0, StepMsg(gen=0, step=4, step_s=0.1), now=9.0)
    s.workers.on_step(w, 0, StepMsg(gen=0, step=5, step_s=0.1, snapped=False), now=10.0)
    assert s.view.latest_step[0] == 4 and s.view.reached_step[0] == 5
    assert (w.last_progress, w.stepped) == (10.0, True)
    s.workers.on_snapshot_again(0, StepMsg(gen=0, step=5, step_s=0.1, again=True))
    assert s.view.latest_step[0] == 5


def test_ready_is_reported_to_the_setup_with_the_interval_and_the_groups_it_joined(tmp_path: Path) -> None:
    tuner: Any = FakeTuner(widen_at=-1)
    tuner.current = Cadence(every=4, since=10)
    s = Workers(tmp_path, reconf=Reconfiguration(generation=1, world_size=2, failures=[]), cadence=tuner)
    w = s.process(1)
    chan = s.connect(w)
    s.workers.on_ready(w, 1, ReadyMsg(gen=1, rebuild_s=0.3, groups=(2, 1, 0.1)), now=5.0)
    assert [type(e) for e in s.setup.reports] == [Joined] and s.view.latest_step[1] == 0  # (a fresh start)
    assert chan.sent == [{"t": "cadence", "every": 4, "since": 10}]
    (joined,) = s.events_of("groups_joined")
    assert (joined["gen"], joined["rank"], joined["kept"], joined["built"]) == (1, 1, 2, 1)
    idle = Workers(tmp_path / "idle")
    idle.workers.on_ready(w, 1, ReadyMsg(gen=1), now=5.0)  # no generation being set up: ignored
    assert idle.setup.reports == []


def test_the_job_finishes_when_every_rank_is_done(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    s.view.phase = JobPhase.RUNNING
    chans = [s.connect(s.process(rank)) for rank in (0, 1)]
    s.workers.on_done(0, DoneMsg(gen=0, step=20))
    assert s.view.phase is JobPhase.RUNNING
    s.workers.on_done(1, DoneMsg(gen=0, step=20))
    assert s.view.phase is JobPhase.FINISHING and [c.kinds() for c in chans] == [["finish"], ["finish"]]
    assert [type(e) for e in s.setup.reports] == [Stepped, Stepped]


def test_a_reported_exception_is_kept_for_the_failure(tmp_path: Path) -> None:
    s = Workers(tmp_path)
    w = s.process(0)
    s.workers.on_fault(w, 0, FaultMsg(gen=0, error="CUDA error"), now=3.0)
    assert w.fault_report == (3.0, "CUDA error")
    assert s.events_of("fault_report")[0]["error"] == "CUDA error"


# -- the snapshot interval -------------------------------------------------------------------------------
def test_a_widened_interval_goes_to_every_member_and_arms_the_rescues(tmp_path: Path) -> None:
    tuner: Any = FakeTuner(widen_at=8)
    s = Workers(tmp_path, cadence=tuner)
    chans = [s.connect(s.process(rank)) for rank in (0, 1)]
    assert not s.workers.rescues
    s.workers.tune(StepMsg(gen=0, step=7, step_s=1.0), 0)
    assert [c.sent for c in chans] == [[], []]
    s.workers.tune(StepMsg(gen=0, step=8, step_s=1.0), 0)
    assert [c.sent for c in chans] == [[{"t": "cadence", "every": 4, "since": 10}]] * 2
    (said,) = s.events_of("snapshot_cadence")
    assert (said["every"], said["since"], said["stall_s"], said["budget"]) == (4, 10, 0.2, 0.05)
    assert s.workers.rescues


def test_rescues_follow_the_fixed_interval_without_a_tuner(tmp_path: Path) -> None:
    assert Workers(tmp_path / "a", every=3).workers.rescues
    assert not Workers(tmp_path / "b").workers.rescues


def test_a_budget_makes_a_tuner_unless_snapshots_are_off() -> None:
    assert cadence_tuner(JobConfig(script="x", snapshot=SnapshotConfig(budget=0.0)), None) is None
    assert cadence_tuner(JobConfig(script="x", snapshot=SnapshotConfig(budget=0.01)), None) is not None
    off = SnapshotConfig(budget=0.01, mode=SnapshotMode.OFF)
    assert cadence_tuner(JobConfig(script="x", snapshot=off), None) is None
