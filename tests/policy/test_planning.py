"""plan_generation: the pure recovery plan over a table of situations."""

from __future__ import annotations

from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.planning import (
    Answered,
    NodeGone,
    Pending,
    PlanAction,
    PlanNow,
    Replan,
    SpareIdle,
    Waited,
    plan_generation,
)

FIXED = ElasticPolicy(full_world_size=4, min_world_size=4, wait_s=0.0)  # not elastic
ELASTIC = ElasticPolicy(full_world_size=4, min_world_size=2, wait_s=0.0)
PATIENT = ElasticPolicy(full_world_size=4, min_world_size=2, wait_s=30.0)


def inv(steps: dict[int, list[int]], node_of: dict[int, str]) -> dict[int, dict[int, list[tuple[str, str]]]]:
    return {r: {s: [(node_of[r], "local")] for s in st} for r, st in steps.items()}


NODE_OF = {0: "a", 1: "a", 2: "b", 3: "b"}


def plan(**kw: object):  # type: ignore[no-untyped-def]
    args: dict[str, object] = dict(
        world_size=4,
        present={0, 1, 2},
        last_node=NODE_OF,
        inventory=inv({0: [5, 6], 1: [5, 6], 2: [5, 6], 3: [5]}, NODE_OF),
        idle_spares={10: "b"},
        live_nodes=["a", "b"],
        load={"a": 2, "b": 1},
        elastic=FIXED,
        waited_s=0.0,
        recovering=True,
    )
    args.update(kw)
    return plan_generation(**args)  # type: ignore[arg-type]


def test_replace_with_the_spare_on_the_failed_ranks_node_at_the_newest_common_step() -> None:
    p = plan()
    assert p.action is PlanAction.REPLACE and p.restore_step == 5
    assert p.placements[3].node == "b" and p.placements[3].spare == 10
    assert p.shrink is None


def test_no_spare_a_cold_process_where_the_rank_ran() -> None:
    p = plan(idle_spares={})
    assert p.action is PlanAction.REPLACE and p.placements[3].spare is None and p.placements[3].node == "b"


def test_node_lost_elastic_shrinks_and_renumbers() -> None:
    p = plan(
        present={0, 1},
        idle_spares={},
        live_nodes=["a"],
        load={"a": 2},
        elastic=ELASTIC,
        inventory=inv({0: [7], 1: [7]}, NODE_OF),
    )
    assert p.action is PlanAction.SHRINK and p.shrink is not None
    assert p.shrink.dropped == (2, 3) and dict(p.shrink.new_of) == {0: 0, 1: 1} and p.shrink.world_size == 2
    assert p.restore_step == 7 and not p.placements


def test_shrink_renumbers_a_rank_after_a_dropped_one() -> None:
    p = plan(present={0, 2}, idle_spares={}, live_nodes=["b"], load={"b": 1}, elastic=ELASTIC,
             last_node={0: "b", 1: "a", 2: "b", 3: "a"},
             inventory={0: {4: [("b", "replica")]}, 2: {4: [("b", "local")]}})  # fmt: skip
    assert p.action is PlanAction.SHRINK and p.shrink is not None
    # ranks 1 and 3 ran on the lost node: no process (in an elastic job a node hosts its own ranks)
    assert p.shrink.dropped == (1, 3) and dict(p.shrink.new_of) == {0: 0, 2: 1}
    assert set(p.inventory) == {0, 1} and p.restore_step == 4


def test_elastic_waits_for_a_spare_first() -> None:
    p = plan(present={0, 1}, idle_spares={}, live_nodes=["a"], load={"a": 2}, elastic=PATIENT, waited_s=10.0)
    assert p.action is PlanAction.WAIT and p.wait_s == 20.0 and p.unplaced == (2, 3)
    later = plan(present={0, 1}, idle_spares={}, live_nodes=["a"], load={"a": 2}, elastic=PATIENT,
                 waited_s=31.0, inventory=inv({0: [7], 1: [7]}, NODE_OF))  # fmt: skip
    assert later.action is PlanAction.SHRINK


def test_below_the_minimum_fails() -> None:
    p = plan(present={0}, idle_spares={}, live_nodes=["a"], load={"a": 1},
             elastic=ElasticPolicy(full_world_size=4, min_world_size=3, wait_s=0.0))  # fmt: skip
    assert p.action is PlanAction.FAIL and "3" in p.reason


def test_no_common_step_in_memory_goes_to_the_durable_tier() -> None:
    p = plan(inventory=inv({0: [6], 1: [6], 2: [6]}, NODE_OF))  # rank 3's memory is gone
    assert p.action is PlanAction.FROM_DURABLE and p.restore_step is None
    assert p.placements[3].node == "b"


def test_a_fresh_start_restores_nothing() -> None:
    p = plan(present=set(), inventory=None, recovering=False, idle_spares={})
    assert p.action is PlanAction.REPLACE and p.restore_step is None and len(p.placements) == 4


def test_no_live_node_fails() -> None:
    p = plan(live_nodes=[])
    assert p.action is PlanAction.FAIL and "every node" in p.reason


# -- the wait before a plan (Pending) ------------------------------------------------------------
def pending() -> Pending:
    return Pending(failures=[], replans=0)


def test_a_plan_waits_for_every_asked_node_then_merges_their_inventories() -> None:
    p = pending()
    assert p.ask({"a", "b"}, deadline=10.0) == []
    assert p.on_event(Answered("b", {2: [5]}, {0: [5]}, 1.0)) == []
    assert p.on_event(Waited(2.0)) == []
    [now] = p.on_event(Answered("a", {0: [5, 6]}, {}, 3.0))
    assert isinstance(now, PlanNow) and now.inventory == {
        0: {5: [("a", "local"), ("b", "replica")], 6: [("a", "local")]},
        2: {5: [("b", "local")]},
    }
    assert p.on_event(Waited(4.0)) == [] and not p.inventory_wait  # planned once


def test_a_lost_node_is_not_waited_for_and_its_answer_is_void() -> None:
    p = pending()
    p.ask({"a", "b"}, deadline=10.0)
    p.on_event(Answered("a", {0: [5]}, {}, 1.0))
    [now] = p.on_event(NodeGone("b", 1.5))
    assert isinstance(now, PlanNow) and now.inventory == {0: {5: [("a", "local")]}}
    q = pending()
    q.ask({"a", "b"}, deadline=10.0)
    q.on_event(Answered("a", {0: [5]}, {}, 1.0))
    q.on_event(NodeGone("a", 2.0))
    assert q.on_event(Waited(9.9)) == []
    [late] = q.on_event(Waited(10.0))  # the deadline: plan with what is in (nothing)
    assert isinstance(late, PlanNow) and late.inventory == {}


def test_nothing_to_ask_plans_at_once_and_an_elastic_wait_ends_on_a_spare_or_the_time() -> None:
    p = pending()
    [now] = p.ask(set(), deadline=5.0)
    assert isinstance(now, PlanNow) and now.inventory is None
    p.wait_for_spare(until=30.0)
    assert p.on_event(Waited(29.0)) == []
    assert p.on_event(Waited(30.0)) == [Replan()]
    assert p.on_event(Waited(31.0)) == []  # once
    p.wait_for_spare(until=30.0)
    assert p.on_event(SpareIdle(1.0)) == [Replan()]


def test_shrink_first_goes_on_without_a_rank_a_spare_could_take_at_once() -> None:
    # the spare on node b could take rank 3; shrinking first, the survivors go on without it, at
    # the newest step the three of them hold (6, not the 5 rank 3 held), with no elastic wait
    p = plan(elastic=PATIENT, shrink_first=True)
    assert p.action is PlanAction.SHRINK and p.shrink_first and p.shrink is not None
    assert p.shrink.dropped == (3,) and not p.placements and p.restore_step == 6
    assert "grow" in p.reason
    # not chosen: the spare replaces the rank as always
    assert plan(elastic=PATIENT).action is PlanAction.REPLACE


def test_shrink_first_below_the_minimum_replaces_instead() -> None:
    tight = ElasticPolicy(full_world_size=4, min_world_size=4, wait_s=0.0)
    p = plan(elastic=tight, shrink_first=True)
    assert p.action is PlanAction.REPLACE and not p.shrink_first and p.placements[3].spare == 10
    three = ElasticPolicy(full_world_size=4, min_world_size=3)
    two_lost = plan(present={0, 1}, idle_spares={10: "b", 11: "b"}, elastic=three, shrink_first=True)
    assert two_lost.action is PlanAction.REPLACE and set(two_lost.placements) == {2, 3}


def test_shrink_first_drops_a_sharded_jobs_whole_replica_group() -> None:
    groups = ElasticPolicy(full_world_size=4, min_world_size=2, unit=2)
    p = plan(elastic=groups, shrink_first=True)
    assert p.action is PlanAction.SHRINK and p.shrink is not None and p.shrink.dropped == (2, 3)
    assert dict(p.shrink.new_of) == {0: 0, 1: 1}


def test_a_failure_graded_replace_elsewhere_takes_a_spare_on_another_node() -> None:
    """Rank 3 failed on node b in a way that points at b (a bus error, a degraded probe): the
    spare on a takes it although b has one; with a spare only on b, b's spare still recovers it
    (better than not recovering); with no spare, the cold process starts on a."""
    both = plan(idle_spares={10: "b", 11: "a"}, avoid={3: "b"})
    assert both.placements[3].node == "a" and both.placements[3].spare == 11
    assert plan(idle_spares={10: "b", 11: "a"}).placements[3].spare == 10  # not graded: its own node
    only_b = plan(avoid={3: "b"})
    assert only_b.placements[3].node == "b" and only_b.placements[3].spare == 10
    cold = plan(idle_spares={}, avoid={3: "b"})
    assert cold.placements[3].node == "a" and cold.placements[3].spare is None
    assert plan(avoid={1: "a"}).placements[3].spare == 10  # a rank that is not missing: ignored
