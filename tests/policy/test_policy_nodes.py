"""Node-level pure policies: quarantine, replica placement, restore sources, spare choice."""

from __future__ import annotations

import pytest

from nonstop.policy.decisions import (
    Placement,
    QuarantinePolicy,
    ReplacementSource,
    RestoreSource,
    Tier,
    choose_replacements,
    place_replicas,
    restore_source,
)


def test_quarantine_counts_only_the_window() -> None:
    q = QuarantinePolicy(max_failures=3, window_s=60)
    assert not q.should_quarantine([0.0, 10.0], now=20.0)
    assert q.should_quarantine([0.0, 10.0, 20.0], now=20.0)
    assert not q.should_quarantine([0.0, 10.0, 20.0], now=65.0)  # the first one aged out
    assert not q.should_quarantine([0.0, 10.0, 20.0], now=20.0, others_usable=0)  # the last node stays
    with pytest.raises(ValueError):
        QuarantinePolicy(max_failures=0)


def test_replicas_go_to_another_failure_domain() -> None:
    nodes = ["a", "b", "c", "d"]
    domains = {"a": "rack1", "b": "rack1", "c": "rack2", "d": "rack2"}
    out = place_replicas(nodes, domains, 1)
    assert out == {"a": ["c"], "b": ["c"], "c": ["a"], "d": ["a"]}
    for node, holders in place_replicas(nodes, domains, 2).items():
        assert node not in holders and len(holders) == 2
    # one domain only: still another node
    assert place_replicas(["x", "y"], {}, 1) == {"x": ["y"], "y": ["x"]}
    assert place_replicas(["x"], {}, 1) == {"x": []}


def test_restore_source_local_memory_first() -> None:
    """The rank's own slots on the node that plays it (a restart in place): nothing fetched."""
    held = [("a", "local"), ("b", "replica")]
    src = restore_source(target="a", holders=held, durable=True)
    assert src == RestoreSource(tier=Tier.LOCAL, node="a", kind="local") and not src.fetch
    # a survivor's donor on the node itself (a rescued step): read there too
    assert restore_source(target="b", holders=[("b", "local")]) == RestoreSource(
        tier=Tier.LOCAL, node="b", kind="local"
    )


def test_restore_source_fetches_a_peer_replica() -> None:
    """Only replicas hold the step (the rank's node is lost): fetched, the target's own first."""
    held = [("b", "replica"), ("c", "replica")]
    src = restore_source(target="spare", holders=held)
    assert src == RestoreSource(tier=Tier.PEER, node="b", kind="replica") and src.fetch
    assert restore_source(target="c", holders=held) == RestoreSource(tier=Tier.PEER, node="c", kind="replica")
    # another node's replica before a live node's own slots (the rank's node is alive, replaced elsewhere)
    assert restore_source(target="spare", holders=[("a", "local"), ("z", "replica")]) == RestoreSource(
        tier=Tier.PEER, node="z", kind="replica"
    )


def test_restore_source_fetches_a_survivors_rescue() -> None:
    """A missing rank given a donor (``with_rescue``): the donor's own slots, fetched."""
    src = restore_source(target="a", holders=[("b", "local")], durable=True)
    assert src == RestoreSource(tier=Tier.PEER, node="b", kind="local") and src.fetch


def test_restore_source_durable_or_nothing() -> None:
    """Held nowhere in memory: the durable tier when there is one, else nothing."""
    src = restore_source(target="a", holders=[], durable=True)
    assert src == RestoreSource(tier=Tier.DURABLE) and not src.fetch
    assert restore_source(target="a", holders=[]) is None


def test_spare_on_own_node_first_then_replica_holder() -> None:
    out = choose_replacements(
        failed={0: "a", 2: "b"},
        spares={10: "c", 11: "a"},
        data_nodes={0: ["a", "b"], 2: ["c"]},
        live_nodes=["a", "c"],
        load={"a": 1, "c": 1},
    )
    assert out[0] == Placement(node="a", spare=11)  # restart in place on its own node
    assert out[2] == Placement(node="c", spare=10)  # its node is gone: the replica holder's spare
    assert out[2].source is ReplacementSource.SPARE


def test_cold_when_no_spare_and_never_on_quarantined_or_dead_nodes() -> None:
    out = choose_replacements(
        failed={1: "b", 3: "d"},
        spares={5: "q"},
        data_nodes={1: ["q"], 3: []},
        live_nodes=["a", "c", "q"],
        load={"a": 2, "c": 1, "q": 0},
        quarantined=["q"],
    )
    assert out[1] == Placement(node="c", spare=None)  # least loaded usable node
    assert out[3] == Placement(node="a", spare=None)  # c now has 2 as well; ties go in node order
    assert out[3].source is ReplacementSource.COLD
    with pytest.raises(ValueError):
        choose_replacements(
            failed={0: "a"}, spares={}, data_nodes={}, live_nodes=["q"], load={}, quarantined=["q"]
        )


def test_replicas_go_to_another_replica_group_first() -> None:
    """HSDP, 2 replica groups of 2 nodes each (a..b: group 0, c..d: group 1): a rank's copy goes to
    a node of the other group, whose failure is independent of its own group's."""
    nodes = ["a", "b", "c", "d"]
    groups = {"a": 0, "b": 0, "c": 1, "d": 1}
    out = place_replicas(nodes, {}, 1, groups)
    assert out == {"a": ["c"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert place_replicas(nodes, {}, 1) == {"a": ["b"], "b": ["c"], "c": ["d"], "d": ["a"]}  # no groups
    # within the other group, another failure domain first
    doms = {"a": "r1", "b": "r1", "c": "r1", "d": "r2"}
    assert place_replicas(nodes, doms, 1, groups)["a"] == ["d"]
    assert place_replicas(nodes, doms, 3, groups)["a"] == ["d", "c", "b"]


def test_within_the_other_replica_group_the_twin_node_comes_first() -> None:
    """HSDP of 2 replica groups of 2 nodes: a and c hold the same shards (place 0), b and d too
    (place 1). Each node's replica goes to its twin, which takes the shards from its own memory."""
    nodes = ["a", "b", "c", "d"]
    groups = {"a": 0, "b": 0, "c": 1, "d": 1}
    places = {"a": 0, "b": 1, "c": 0, "d": 1}
    assert place_replicas(nodes, {}, 1, groups, places) == {"a": ["c"], "b": ["d"], "c": ["a"], "d": ["b"]}
    # another replica group still comes before a twin-less node of one's own
    assert place_replicas(nodes, {}, 2, groups, places)["b"] == ["d", "c"]
