"""Rescue snapshots (``--snapshot-every K`` > 1): a survivor writes the state after its last
completed step when the failed step left it untouched, and the plan restores it -- the pure
pieces (policy/rescue.py, the plan, the wait) and the worker's head (train/rescue.py)."""

from __future__ import annotations

import queue
import random

import pytest
import torch

from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.planning import Answered, Pending, PlanAction, PlanNow, Reported, Waited, plan_generation
from nonstop.policy.rescue import Rescue, gather, with_rescue
from nonstop.protocol import wire
from nonstop.protocol.base import WireError
from nonstop.protocol.worker import LeaveMsg, ResumeMsg, decode_order
from nonstop.snapshot import StateCapture
from nonstop.train.rescue import StepHead, digest

FIXED = ElasticPolicy(full_world_size=3, min_world_size=3, wait_s=0.0)
ELASTIC = ElasticPolicy(full_world_size=3, min_world_size=2, wait_s=0.0)
NODE_OF = {0: "a", 1: "b", 2: "c"}
# every rank snapshotted step 5 (K = 5); rank 0 was lost during step 8
INVENTORY = {r: {5: [(NODE_OF[r], "local")]} for r in range(3)}


def _plan(rescue: Rescue | None, *, elastic: ElasticPolicy = FIXED, shrink_first: bool = False):  # type: ignore[no-untyped-def]
    return plan_generation(
        world_size=3,
        present={1, 2},
        last_node=NODE_OF,
        inventory=INVENTORY,
        idle_spares={9: "a"},
        live_nodes=["a", "b", "c"],
        load={"a": 0, "b": 1, "c": 1},
        elastic=elastic,
        waited_s=0.0,
        recovering=True,
        shrink_first=shrink_first,
        rescue=rescue,
    )


def test_gather_needs_every_present_rank_at_one_step() -> None:
    both = {1: (8, "d"), 2: (8, "d")}
    assert gather(both, {1, 2}, NODE_OF) == Rescue(step=8, holders={1: "b", 2: "c"}, alike=True)
    assert gather({1: (8, "d")}, {1, 2}, NODE_OF) is None  # rank 2 did not report
    assert gather({1: (8, "d"), 2: (None, None)}, {1, 2}, NODE_OF) is None  # rank 2 could not rescue
    assert gather({1: (8, "d"), 2: (7, "d")}, {1, 2}, NODE_OF) is None  # different steps
    unlike = gather({1: (8, "d"), 2: (8, "e")}, {1, 2}, NODE_OF)
    assert unlike is not None and not unlike.alike  # per-rank RNGs: nobody takes another's state
    alone = gather({1: (8, "d")}, {1}, NODE_OF)
    assert alone is not None and not alone.alike  # one survivor cannot show the ranks are alike


def test_with_rescue_adds_the_step_and_gives_each_missing_rank_a_donor() -> None:
    rescue = Rescue(step=8, holders={1: "b", 2: "c"}, alike=True)
    avail, donors = with_rescue(INVENTORY, rescue, [0], donors=True)
    assert avail[1][8] == [("b", "local")] and avail[2][8] == [("c", "local")]
    assert avail[0][8] == [("b", "local")] and donors == {0: 1}
    assert avail[0][5] == [("a", "local")] and INVENTORY[0] == {5: [("a", "local")]}  # not changed
    _, none = with_rescue(INVENTORY, rescue, [0], donors=False)
    assert none == {}
    # a missing rank that rescued the step itself (it raised its own error) keeps its own
    own = {**INVENTORY, 0: {5: [("a", "local")], 8: [("a", "local")]}}
    avail, donors = with_rescue(own, rescue, [0], donors=True)
    assert donors == {} and avail[0][8] == [("a", "local")]


def test_the_plan_restores_the_rescued_step_and_the_replacement_takes_a_donors() -> None:
    p = _plan(Rescue(step=8, holders={1: "b", 2: "c"}, alike=True))
    assert p.action is PlanAction.REPLACE and p.restore_step == 8 and p.donors == {0: 1}
    # without the rescue (or unlike ranks) the survivors go back to the last snapshot
    assert _plan(None).restore_step == 5 and _plan(None).donors == {}
    unlike = _plan(Rescue(step=8, holders={1: "b", 2: "c"}, alike=False))
    assert unlike.restore_step == 5 and unlike.donors == {}


def test_a_shrink_keeps_the_rescued_step_without_donors() -> None:
    for alike in (True, False):
        p = _plan(Rescue(step=8, holders={1: "b", 2: "c"}, alike=alike), elastic=ELASTIC, shrink_first=True)
        assert p.action is PlanAction.SHRINK and p.shrink is not None
        assert p.restore_step == 8 and p.donors == {}
        assert set(p.inventory) == {0, 1} and 8 in p.inventory[0]  # renumbered: old 1 and 2


def test_the_wait_ends_when_every_present_rank_reported_or_at_its_deadline() -> None:
    p = Pending(failures=[])
    assert p.ask({"b"}, deadline=3.0, rescuing={1, 2}, rescue_deadline=2.0) == []
    assert p.on_event(Answered("b", {1: [5]}, {}, 0.1)) == []  # rank 1 and 2 not reported yet
    assert p.on_event(Reported(1, 8, "d", 0.2)) == []
    (now,) = p.on_event(Reported(2, 8, "d", 0.3))
    assert isinstance(now, PlanNow) and now.rescues == {1: (8, "d"), 2: (8, "d")}
    late = Pending(failures=[])
    late.ask({"b"}, deadline=3.0, rescuing={1, 2}, rescue_deadline=2.0)
    late.on_event(Answered("b", {1: [5]}, {}, 0.1))
    late.on_event(Reported(1, 8, "d", 0.2))
    assert late.on_event(Waited(1.9)) == []
    (now,) = late.on_event(Waited(2.0))  # rank 2 never reported: plan with what came in
    assert isinstance(now, PlanNow) and now.rescues == {1: (8, "d")}


def test_a_fault_report_carries_its_rescue() -> None:
    m = wire.decode_worker({"t": "fault", "gen": 3, "error": "x", "rescued": 8, "rest": "ab" * 100})
    assert isinstance(m, wire.Fault) and m.rescue == (8, ("ab" * 100)[:64])
    none = wire.decode_worker({"t": "fault", "gen": 3, "error": "x", "rescued": None})
    assert isinstance(none, wire.Fault) and none.rescue == (None, None)
    old = wire.decode_worker({"t": "fault", "gen": 3, "error": "x"})  # K = 1: no rescue asked
    assert isinstance(old, wire.Fault) and old.rescue is None
    with pytest.raises(wire.WireError):
        wire.decode_worker({"t": "fault", "gen": 3, "error": "x", "rescued": "eight"})


def _trained(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, StateCapture]:
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # the optimizer's state exists
    opt.zero_grad()
    return opt, StateCapture(model=model, optimizer=opt)


def test_a_step_that_failed_before_writing_the_state_is_rescued_with_its_start() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt, capture = _trained(model)
    head = StepHead()
    head.arm(capture, 1)
    rng, py = torch.get_rng_state(), random.getstate()
    random.random()
    model(torch.randn(4, 3)).sum().backward()  # the step consumed RNGs, made gradients, then failed
    found = head.rescue(capture, 1)
    assert found is not None and found.step == 1
    assert torch.equal(found.state["rng"]["torch"], rng)  # the RNGs of the step's start, not now
    assert found.state["rng"]["python"][1].tolist() == list(py[1])
    assert found.state["model"]["weight"] is model.weight  # the live tensors, copied by the write
    assert found.state["optimizer"]["state"][0]["exp_avg"] is opt.state[model.weight]["exp_avg"]
    assert head.rescue(capture, 2) is None  # armed for another step


def test_no_rescue_once_the_step_wrote_the_state() -> None:
    model = torch.nn.Linear(3, 2)
    opt, capture = _trained(model)
    head = StepHead()
    head.arm(capture, 1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # the optimizer step ran: the state is the next step's, half done or not
    assert head.rescue(capture, 1) is None
    bn = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    _, capture = _trained(bn)
    head.arm(capture, 1)
    bn(torch.randn(4, 3))  # a forward in training mode updates the running statistics
    assert head.rescue(capture, 1) is None
    head.arm(capture, 1)
    head.disarm()
    assert head.rescue(capture, 1) is None


def test_digest_is_equal_for_equal_states_only() -> None:
    a = {"rng": {"torch": torch.arange(4, dtype=torch.uint8)}, "extras": {"n": 1}, "objects": {}}
    b = {"objects": {}, "extras": {"n": 1}, "rng": {"torch": torch.arange(4, dtype=torch.uint8)}}
    assert digest(a) == digest(b)
    assert digest(a) != digest({**a, "extras": {"n": 2}})
    assert digest(a) != digest({**a, "rng": {"torch": torch.arange(4, dtype=torch.int32)}})


def test_the_simulator_rescues_where_the_runtime_finds_a_donor() -> None:
    from nonstop.sim.api import JobSpec
    from nonstop.sim.nonstop_costs import has_donors
    from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams

    assert has_donors(5, 2) and not has_donors(1, 8) and not has_donors(5, 1)
    job = JobSpec(num_gpus=1024)  # 128 nodes
    rescued = Nonstop(job=job, params=NonstopParams(snapshot_every=8))
    assert rescued.describe()["rescue"] is True  # model copies of 16 nodes (the default HSDP job)
    one_copy = Nonstop(job=job, params=NonstopParams(snapshot_every=8, replica_nodes=128))
    assert one_copy.describe()["rescue"] is False  # FSDP over the whole job: no rank has a donor
    assert (
        Nonstop(job=job, params=NonstopParams(snapshot_every=8, rescue=False)).describe()["rescue"] is False
    )
    every_step = NonstopParams(snapshot_budget=0.0)  # every step snapshotted: nothing to rescue
    assert Nonstop(job=job, params=every_step).describe()["rescue"] is False
    assert Nonstop(job=job).describe()["rescue"] is True  # the default budget widens the interval


def _leaving_link(gen: int, *, in_step: bool) -> tuple[object, list[object]]:
    from nonstop.train.link import CoordinatorLink

    severed: list[object] = []
    link = CoordinatorLink.__new__(CoordinatorLink)  # _on_leave needs only these
    link._resume = lambda: ResumeMsg(gen=gen, step=8, done=False)
    link._inbox = queue.Queue()
    link._sever = lambda lost: severed.append(lost) or []  # type: ignore[func-returns-value]
    link._settle_store = None
    link._can_interrupt = False
    link.in_step = in_step
    link.leave_gen = None
    return link, severed


def test_a_leave_severs_a_rank_in_its_step_and_marks_one_between_steps() -> None:
    from nonstop.train.link import CoordinatorLink

    link, severed = _leaving_link(3, in_step=True)
    CoordinatorLink._on_leave(link, LeaveMsg(gen=4, recovery=True, lost=(2,)))  # type: ignore[arg-type]
    assert severed == [[2]] and link.leaving(3) and not link.leaving(4)  # type: ignore[attr-defined]
    link, severed = _leaving_link(3, in_step=False)
    CoordinatorLink._on_leave(link, LeaveMsg(gen=4, recovery=True, lost=(2,)))  # type: ignore[arg-type]
    assert severed == [] and link.leaving(3)  # type: ignore[attr-defined]  # the loop leaves before its next step
    link, severed = _leaving_link(3, in_step=True)
    CoordinatorLink._on_leave(link, LeaveMsg(gen=3))  # type: ignore[arg-type]
    assert severed == [] and not link.leaving(3)  # type: ignore[attr-defined]  # stale
    for bad in ({"t": "leave", "gen": "x"}, {"t": "leave"}):  # the reader drops one it cannot read
        with pytest.raises(WireError) as e:
            decode_order(bad)
        link, severed = _leaving_link(3, in_step=True)
        CoordinatorLink._malformed(link, "leave", e.value)  # type: ignore[arg-type]
        assert severed == [] and not link.leaving(3) and link._inbox.empty()  # type: ignore[attr-defined]


def test_the_rescue_keeps_the_hyperparameters_of_the_steps_start() -> None:
    model = torch.nn.Linear(3, 2)
    opt, capture = _trained(model)
    head = StepHead()
    head.arm(capture, 1)
    opt.param_groups[0]["lr"] = 0.5  # a schedule set at the start of the failed step
    found = head.rescue(capture, 1)
    assert found is not None
    (group,) = found.state["optimizer"]["param_groups"]
    assert group["lr"] == 0.1 and group["params"] == [0, 1]


class _Slots:
    """LoopSnapshots as StepRescue uses it: whether steps go unsnapshotted, the newest begun,
    and the live store's writes."""

    def __init__(self, *, may_skip: bool, taken: int | None) -> None:
        self.may_skip, self.taken = may_skip, taken
        self.written: list[tuple[int, dict[str, object]]] = []
        self.drained = 0
        self.live = self

    def drain(self) -> None:
        self.drained += 1

    def write(self, step: int, state: dict[str, object]) -> None:
        self.written.append((step, state))


def test_the_loops_rescue_writes_the_step_its_failed_successor_left_untouched() -> None:
    from typing import Any, cast

    from nonstop.train.rescue import StepRescue

    model = torch.nn.Linear(3, 2)
    opt, capture = _trained(model)
    slots = _Slots(may_skip=True, taken=0)
    rescue = StepRescue(cast(Any, slots), snapshot="overlapped")
    assert rescue.enabled
    rescue.arm(capture, 1)  # step 2 begins; step 1 went unsnapshotted
    model(torch.randn(4, 3)).sum().backward()  # it failed after its backward
    report = rescue.rescue(capture, 1)
    assert report is not None and report[0] == 1 and report[1] is not None and len(report[1]) == 32
    assert slots.drained == 1 and [s for s, _ in slots.written] == [1] and slots.taken == 1
    again = rescue.rescue(capture, 1)
    assert again is not None and again[0] == 1  # disarmed: the live state as it is, now
    assert len(slots.written) == 1  # already in the slots: not written again
    rescue.arm(capture, 1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()  # this time the step wrote the state
    assert rescue.rescue(capture, 1) == (None, None)


def test_no_rescue_when_every_step_is_snapshotted_snapshots_are_off_or_no_model_is_built() -> None:
    from typing import Any, cast

    from nonstop.train.rescue import StepRescue

    model = torch.nn.Linear(3, 2)
    _, capture = _trained(model)
    every = _Slots(may_skip=False, taken=1)
    rescue = StepRescue(cast(Any, every), snapshot="overlapped")
    rescue.arm(None, 1)  # (not asked for a capture: a sharded model may have none yet)
    assert not rescue.enabled and rescue.rescue(capture, 1) is None and every.written == []
    off = StepRescue(cast(Any, _Slots(may_skip=True, taken=None)), snapshot="off")
    assert not off.enabled and off.rescue(capture, 1) is None
    built_later = StepRescue(cast(Any, _Slots(may_skip=True, taken=None)), snapshot="sync")
    assert built_later.rescue(None, 1) is None
