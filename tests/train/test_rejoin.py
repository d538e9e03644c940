"""The worker's side of a generation change (train/rejoin.py) driven against fakes of its
collaborators (tests/worker_fakes.py): what it asks between steps, a migration's boundary pause,
a fault report, and a reconfigure's restore -> restored -> rebuild -> join -> ready."""

from __future__ import annotations

from typing import Any, cast

import pytest

from nonstop.train.link import PeerFailed
from nonstop.train.membership import Membership
from nonstop.train.position import Position
from nonstop.train.rejoin import Rejoin
from nonstop.train.rescue import StepRescue
from tests.worker_fakes import FakeFaults, FakeGroup, FakeLink, FakeSlots, FakeTrainee, order


class _Parts:
    def __init__(
        self, replies: list[dict[str, Any]] | None = None, *, fail: BaseException | None = None
    ) -> None:
        self.link = FakeLink(replies)
        self.slots = FakeSlots()
        self.group = FakeGroup()
        self.trainee = FakeTrainee(fail)
        self.faults = FakeFaults()
        self.members = Membership(None)
        self.members.apply(order({"t": "reconfigure", "rank": 1, "world_size": 2}))
        self.pos = Position(generation=1, step=7)
        self.rejoin = Rejoin(
            cast(Any, SimpleEnv()),
            trainee=cast(Any, self.trainee),
            link=cast(Any, self.link),
            group=cast(Any, self.group),
            snaps=cast(Any, self.slots),
            rescue=StepRescue(cast(Any, self.slots), snapshot="off"),  # (rescues: test_rescue.py)
            faults=cast(Any, self.faults),
            members=self.members,
            position=self.pos,
        )


class SimpleEnv:
    """The WorkerEnv field a rejoin reads itself (a restore from the slots reads more: no
    reconfigure here restores from them)."""

    rebuild_timeout_s = 12.0


def test_between_steps_it_hands_over_a_reconfigure_or_a_leave() -> None:
    p = _Parts()
    assert p.rejoin.between_steps() is None
    p.link.inbox.append({"t": "reconfigure", "gen": 2})
    assert p.rejoin.between_steps() == order({"t": "reconfigure", "gen": 2})
    p.link.leave_gen = 1
    with pytest.raises(PeerFailed):
        p.rejoin.between_steps()
    p.pos.generation = 2  # a leave of an older generation is stale
    assert p.rejoin.between_steps() is None


def test_at_a_swaps_boundary_it_snapshots_the_step_pauses_and_keeps_its_live_state() -> None:
    swap = {"t": "reconfigure", "gen": 2, "rank": 1, "world_size": 2, "restore_step": 7, "live": True}
    p = _Parts([swap])
    p.link.pause_at = 7
    assert p.rejoin.between_steps() == order(swap)
    assert [w.step for w in p.slots.takes] == [7]  # step 7 went unsnapshotted: taken for the joiner
    p.slots.takes[0].complete()
    assert p.link.quiet == [{"t": "step", "gen": 1, "step": 7, "step_s": 0.0, "again": True}]
    assert p.link.kinds() == ["paused"] and p.link.pause_at is None and p.rejoin.live_at == 7
    # the coordinator gave up the swap: train on, from a state no longer the boundary's
    p = _Parts([{"t": "continue"}])
    p.slots.taken = 7
    p.link.pause_at = 7
    assert p.rejoin.between_steps() is None and p.rejoin.live_at is None and p.slots.takes == []


def test_a_step_error_tears_the_group_down_reports_it_and_follows_the_answer() -> None:
    p = _Parts([{"t": "reconfigure", "gen": 2, "failed": [0]}, {"t": "raise"}])
    reply = p.rejoin.on_step_error(RuntimeError("allreduce timed out"))
    assert reply.gen == 2 and p.group.destroyed == [False] and p.link.settled[-1][1] == 2
    (fault,) = p.link.sent
    assert fault == {"t": "fault", "gen": 1, "step": 7, "error": "RuntimeError: allreduce timed out"}
    err = ValueError("the script's own bug")
    with pytest.raises(ValueError) as raised:
        p.rejoin.on_step_error(err)
    assert raised.value is err


def test_a_fresh_jobs_first_generation_joins_and_writes_step_0() -> None:
    first = {"t": "reconfigure", "gen": 1, "rank": 0, "world_size": 3, "shards": [0, 2], "divisor": 3}
    p = _Parts([{"t": "rebuild", "gen": 1}])
    p.pos.generation, p.pos.step = 0, 0
    module = p.rejoin.reconfigure(order(first), None)
    assert module is p.trainee.model
    assert (p.pos.generation, p.pos.step, p.members.rank, p.members.shards) == (1, 0, 0, (0, 2))
    assert p.slots.opened == [0]  # renumbered 1 -> 0: its slots are rank 0's
    assert p.slots.writes == [(0, 1)] and p.group.destroyed == [True]
    assert p.link.kinds() == ["restored", "ready"] and p.link.opened == [(1, 12.0)]
    assert p.trainee.joins[0] | {"timeout_s": None} == {
        "rank": 0,
        "world_size": 3,
        "timeout_s": None,
        "restored": False,
        "divisor": 3,
        "generation": 1,
    }


def test_a_recovery_fires_its_fault_restores_and_redoes_the_join_after_a_failure_in_it() -> None:
    again = {"t": "reconfigure", "gen": 3, "rank": 1, "world_size": 2, "restore_step": 7, "recovery": True}
    msg = {**again, "gen": 2, "live": True}
    p = _Parts(
        [{"t": "rebuild", "gen": 2}, again, {"t": "rebuild", "gen": 3}],
        fail=RuntimeError("a peer died in the rendezvous"),
    )
    p.rejoin.live_at = 7  # paused after step 7: its live state is restored as it is
    p.slots.held[7] = p.trainee.capture.state(7)
    p.rejoin.reconfigure(order(msg), None)
    assert [e for e in p.slots.events if e.startswith("read")] == ["read 7"]  # the second time only
    assert p.faults.asked == [("recovery", 1, 7, 2), ("recovery", 1, 7, 3)]
    assert p.link.kinds() == ["restored", "fault", "restored", "ready"]
    assert (
        p.pos.generation == 3 and p.pos.step == 7 and [j["restored"] for j in p.trainee.joins] == [True, True]
    )
    assert p.rejoin.live_at is None and p.slots.writes == []  # restored: no new step-0 snapshot


def test_a_reconfigure_while_waiting_for_the_rebuild_starts_over() -> None:
    later = {"t": "reconfigure", "gen": 3, "rank": 1, "world_size": 2}
    p = _Parts([later, {"t": "rebuild", "gen": 3}])
    p.rejoin.reconfigure(order({**later, "gen": 2}), None)
    assert p.link.kinds() == ["restored", "restored", "ready"] and p.pos.generation == 3
    assert len(p.trainee.joins) == 1 and p.trainee.joins[0]["generation"] == 3
