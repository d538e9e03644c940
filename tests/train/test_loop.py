"""The training loop (train/loop.py) driven against fakes of the session's collaborators
(tests/worker_fakes.py) and a real Rejoin: the steps it yields through a generation, what it
counts and reports of each, a failed step's recovery, a reconfigure between steps or answering
``done``, the script's mistake, and the job's end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest

from nonstop.errors import UsageError
from nonstop.train.eventhooks import EventHooks
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.link import PeerFailed
from nonstop.train.loop import RunResult, TrainingLoop
from nonstop.train.membership import Membership
from nonstop.train.position import Position
from nonstop.train.rescue import StepRescue
from nonstop.train.steps import Step
from tests.worker_fakes import FakeFaults, FakeGroup, FakeLink, FakeSlots, FakeTrainee, order

FIRST = {"t": "reconfigure", "gen": 1, "rank": 0, "world_size": 1}
REBUILD_1 = {"t": "rebuild", "gen": 1}
FINISH = {"t": "finish"}


class SimpleEnv:
    """The WorkerEnv fields the loop and its rejoin read (no restore here reads more)."""

    rebuild_timeout_s = 12.0
    elastic = False


class FakeReports:
    """StepReports: each completed step as the loop hands it over."""

    def __init__(self) -> None:
        self.completed_steps: list[dict[str, Any]] = []

    def completed(self, step: int, **kw: Any) -> None:
        self.completed_steps.append({"step": step, **kw})

    def steps(self) -> list[tuple[int, int, float | None]]:
        return [(c["step"], c["generation"], c["loss"]) for c in self.completed_steps]


class _Parts:
    def __init__(self, replies: list[dict[str, Any]], *, first: dict[str, Any] | None = FIRST) -> None:
        self.link = FakeLink(replies)
        self.slots = FakeSlots()
        self.group = FakeGroup()
        self.trainee = FakeTrainee()
        self.faults = FakeFaults()
        self.members = Membership(None)
        self.pos = Position()
        self.beat = HeartbeatWords(self.pos)
        self.reports = FakeReports()
        self.usage: list[UsageError] = []
        self.results: list[RunResult] = []
        self.first = order(first) if first is not None else None
        self.asked_first = 0
        self.loop = TrainingLoop(
            cast(Any, SimpleEnv()),
            cast(Any, self.trainee),
            link=cast(Any, self.link),
            group=cast(Any, self.group),
            snaps=cast(Any, self.slots),
            rescue=StepRescue(cast(Any, self.slots), snapshot="off"),
            faults=cast(Any, self.faults),
            members=self.members,
            position=self.pos,
            beat=self.beat,
            hooks=EventHooks(),
            reports=cast(Any, self.reports),
            device_type="cpu",
            fail_usage=self.usage.append,
            finished=self.results.append,
        )

    def take_first(self) -> Any:
        self.asked_first += 1
        return self.first

    def steps(self, num_steps: int) -> Iterator[Step]:
        return self.loop.steps(num_steps, None, self.take_first)


def test_it_starts_watched_and_yields_each_step_of_a_generation_then_finishes() -> None:
    p = _Parts([REBUILD_1, FINISH])
    assert p.slots.opened == [0] and p.beat.clock is not None  # a model without sync: sampled
    it = p.steps(3)
    assert p.asked_first == 0  # the first reconfigure is taken when the loop runs
    seen: list[tuple[int, int, bool]] = []
    in_step: list[bool] = []
    for step in it:
        with step:
            in_step.append(p.link.in_step)
            seen.append((int(step), step.generation, step.new_generation))
            assert step.model is p.trainee.model
            step.loss = 0.5 * int(step)
        assert not p.link.in_step  # left at the with's end
    assert seen == [(0, 1, True), (1, 1, False), (2, 1, False)] and in_step == [True] * 3
    assert p.asked_first == 1
    assert p.reports.steps() == [(1, 1, 0.0), (2, 1, 0.5), (3, 1, 1.0)]
    assert {c["num_steps"] for c in p.reports.completed_steps} == {3}
    assert p.faults.asked == [("step", 0, s, 1) for s in range(3)] and p.faults.stretched == 3
    assert len(p.faults.observed) == 3
    assert p.link.kinds() == ["restored", "ready", "done"]
    assert p.link.sent[-1] == {"t": "done", "gen": 1, "step": 3}
    assert p.results == [RunResult(step=3, last_loss=1.0, generation=1)]
    assert p.pos.done and p.link.closing
    assert p.trainee.closed and p.slots.events[-2:] == ["drain", "close"] and p.beat.clock is None


def test_a_failed_step_is_reported_restored_and_redone_in_the_new_generation() -> None:
    again = {"t": "reconfigure", "gen": 2, "rank": 0, "world_size": 1, "restore_step": 1, "recovery": True}
    p = _Parts([REBUILD_1, again, {"t": "rebuild", "gen": 2}, FINISH])
    p.slots.held[1] = p.trainee.capture.state(1)
    seen: list[tuple[int, int, bool]] = []
    failed = False
    for step in p.steps(3):
        with step:
            seen.append((int(step), step.generation, step.new_generation))
            if int(step) == 2 and not failed:
                failed = True
                raise RuntimeError("allreduce timed out")
    assert seen == [(0, 1, True), (1, 1, False), (2, 1, False), (1, 2, True), (2, 2, False)]
    assert p.link.kinds() == ["restored", "ready", "fault", "restored", "ready", "done"]
    assert p.link.sent[2] == {"t": "fault", "gen": 1, "step": 2, "error": "RuntimeError: allreduce timed out"}
    assert p.reports.steps() == [(1, 1, None), (2, 1, None), (2, 2, None), (3, 2, None)]  # not the failed one
    assert p.results == [RunResult(step=3, last_loss=None, generation=2)]


def test_a_step_run_on_a_severed_group_is_never_counted() -> None:
    p = _Parts([REBUILD_1, {"t": "raise"}])
    it = p.steps(3)
    step = next(it)
    with step:
        p.group.severed = True  # a recovery aborted the group's collectives meanwhile
    with pytest.raises(PeerFailed, match="aborted during the step"):  # the coordinator said raise
        next(it)
    assert p.reports.steps() == [] and p.pos.step == 0 and p.link.kinds()[-1] == "fault"
    assert p.trainee.closed and p.results == []


def test_a_reconfigure_between_steps_ends_the_generation_before_the_next_step() -> None:
    grow = {"t": "reconfigure", "gen": 2, "rank": 0, "world_size": 2, "restore_step": 1}
    p = _Parts([REBUILD_1, {"t": "rebuild", "gen": 2}, FINISH])
    p.slots.held[1] = p.trainee.capture.state(1)
    seen: list[tuple[int, int, bool]] = []
    for step in p.steps(2):
        with step:
            seen.append((int(step), step.generation, step.new_generation))
        if int(step) == 0:
            p.link.inbox.append(grow)
    assert seen == [(0, 1, True), (1, 2, True)] and p.members.world_size == 2
    assert "fault" not in p.link.kinds() and p.results[0].generation == 2


def test_a_reconfigure_answering_done_goes_on_until_finish() -> None:
    later = {"t": "reconfigure", "gen": 2, "rank": 0, "world_size": 1, "restore_step": 1}
    p = _Parts([REBUILD_1, later, {"t": "rebuild", "gen": 2}, FINISH])
    p.slots.held[1] = p.trainee.capture.state(1)
    assert [int(s) for s in _run(p.steps(1))] == [0]
    assert p.link.kinds() == ["restored", "ready", "done", "restored", "ready", "done"]
    assert p.link.sent[-1] == {"t": "done", "gen": 2, "step": 1}
    assert p.results == [RunResult(step=1, last_loss=None, generation=2)]


def test_the_scripts_mistake_fails_the_job_and_is_raised() -> None:
    p = _Parts([REBUILD_1])
    it = p.steps(3)
    next(it)  # never entered `with step:`
    with pytest.raises(UsageError, match="outside `with step:`") as raised:
        next(it)
    assert p.usage == [raised.value] and "fault" not in p.link.kinds()
    assert p.trainee.closed and p.beat.clock is None and p.results == []


def _run(it: Iterator[Step]) -> list[Step]:
    out = []
    for step in it:
        with step:
            out.append(step)
    return out
