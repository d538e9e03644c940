"""An elastic sharded job (``--mesh replicate=R,...`` with ``--min-world-size``) shrinks and grows
by whole replica groups: the pure rules (mesh, planner, policy, snapshot layout check) and the
coordinator's side against fake peers (a lost node drops its group, a live rank of that group is
retired, the group comes back through a boundary swap whose joiners restore their coordinates'
shards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nonstop.config import ElasticConfig, JobConfig, job_config_from_flat
from nonstop.coordinator.loop import JobState
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.planning import PlanAction, plan_generation
from nonstop.snapshot.sharded import same_mesh
from tests.coord_fakes import Harness


# -- pure rules -------------------------------------------------------------------------------------
def test_a_smaller_generation_has_fewer_replica_groups() -> None:
    m = MeshSpec.parse("replicate=3,shard=2,tp=2")
    assert m.group_size == 4
    assert m.with_world(12) is m and str(m.with_world(8)) == "replicate=2,shard=2,tp=2"
    assert str(m.with_world(4)) == "replicate=1,shard=2,tp=2"
    for bad in (6, 0, 16):  # not whole groups; none; more than the job
        with pytest.raises(ValueError, match="whole groups of 4 ranks along replicate"):
            m.with_world(bad)
    assert m.elastic_dim == "replicate" and not m.reshards


def test_without_replicas_the_shard_dim_shrinks_and_reshards() -> None:
    m = MeshSpec.parse("shard=3,tp=2")
    assert m.elastic_dim == "shard" and m.reshards and m.group_size == 2  # a TP group
    assert str(m.with_world(4)) == "shard=2,tp=2"
    # shard indices 0..2 over 2: the TP pairs play theirs, the second one two
    assert m.data_shards(4) == ((0,), (0,), (1, 2), (1, 2))
    assert MeshSpec.parse("shard=3").data_shards(1) == ((0, 1, 2),)
    with pytest.raises(ValueError, match="along replicate or shard"):
        MeshSpec.parse("tp=2").with_world(1)


def test_surviving_groups_play_the_dropped_groups_batches() -> None:
    m = MeshSpec.parse("replicate=3,shard=2,tp=2")
    # full size: every rank its dp_rank, a TP pair the same
    assert m.data_shards(12) == tuple((m.dp_rank(r),) for r in range(12))
    # one group left: each shard index plays its index in all three groups
    assert m.data_shards(4) == ((0, 2, 4), (0, 2, 4), (1, 3, 5), (1, 3, 5))
    # two groups: the six dp indices once each, contiguous and balanced
    two = m.data_shards(8)
    assert two == ((0,), (0,), (1,), (1,), (2, 4), (2, 4), (3, 5), (3, 5))
    played = sorted(k for r in range(0, 8, 2) for k in two[r])  # one rank of each TP pair
    assert played == list(range(6))
    # --shrink-batch drop: each rank its own coordinates' index, the third group's skipped
    assert (
        m.data_shards(8, drop=True)
        == tuple((m.dp_rank(r),) for r in range(8))
        == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    )
    assert MeshSpec.parse("shard=3,tp=2").data_shards(4, drop=True) == ((0,), (0,), (1,), (1,))


def test_elastic_meshes_are_checked_at_start() -> None:
    base = {"script": "t.py", "nproc_per_node": 2, "nnodes": 2, "coordinator": "127.0.0.1:0"}
    assert job_config_from_flat({"mesh": "replicate=2,shard=2", "min_world_size": 2, **base}).min_world == 2
    assert job_config_from_flat({"mesh": "shard=4", "min_world_size": 2, **base}).min_world == 2  # resharded
    with pytest.raises(UsageError, match="has neither"):
        JobConfig(script="t.py", nproc_per_node=4, mesh="tp=4", elastic=ElasticConfig(min_world_size=2))
    with pytest.raises(UsageError, match="whole number of replica groups of 2"):
        job_config_from_flat({"mesh": "replicate=2,shard=2", "min_world_size": 3, **base})
    with pytest.raises(UsageError, match="whole number of tensor-parallel groups of 2"):
        job_config_from_flat({"mesh": "shard=2,tp=2", "min_world_size": 3, **base})
    with pytest.raises(UsageError, match="--shards-per-rank is not supported with --mesh"):
        job_config_from_flat({"mesh": "replicate=2,shard=2", "shards_per_rank": 2, **base})


def test_the_policy_grows_by_whole_groups() -> None:
    p = ElasticPolicy(full_world_size=6, min_world_size=2, unit=2)
    assert p.grow_to(world_size=2, idle_spares=1) == 2  # half a group: wait for the rest
    assert p.grow_to(world_size=2, idle_spares=3) == 4
    assert p.grow_to(world_size=2, idle_spares=9) == 6
    with pytest.raises(ValueError, match="whole units"):
        ElasticPolicy(full_world_size=6, min_world_size=3, unit=2)


def test_the_planner_drops_the_whole_group_of_an_unplaced_rank() -> None:
    inv = {r: {5: [(str(r), "local")]} for r in range(6)}
    plan = plan_generation(
        world_size=6,
        present={0, 1, 2, 4, 5},  # rank 3 is gone with its node; rank 2 (its group) lives on
        last_node={3: "3"},
        inventory=inv,
        idle_spares={},
        live_nodes=["0", "1", "2", "4", "5"],
        load={},
        elastic=ElasticPolicy(full_world_size=6, min_world_size=2, unit=2),
        waited_s=0.0,
        recovering=True,
    )
    assert plan.action is PlanAction.SHRINK and plan.shrink is not None
    assert plan.shrink.dropped == (2, 3) and plan.unplaced == (3,)
    assert dict(plan.shrink.new_of) == {0: 0, 1: 1, 4: 2, 5: 3}
    assert plan.restore_step == 5 and plan.placements == {}


def test_a_shard_restores_onto_a_mesh_with_fewer_replicas_only() -> None:
    hsdp = ("Replicate()", "Shard(dim=0)")
    assert same_mesh((1, 2), (2, 2), hsdp)  # one replica group left: the same local shard
    assert not same_mesh((2, 1), (2, 2), hsdp)  # the shard dim changed: another layout
    assert not same_mesh((2,), (2, 2), ("Shard(dim=0)",))


# -- the coordinator, against fakes -----------------------------------------------------------------
def _running(tmp_path: Path, mesh: str, *, nodes: int, **kw: Any) -> Harness:
    """An elastic sharded job on ``nodes`` nodes of one rank and no spare, its first step done."""
    h = Harness(
        tmp_path, nnodes=nodes, nproc_per_node=1, spares=0, coordinator="127.0.0.1:0", lease_ttl_s=60.0,
        mesh=mesh, min_world_size=2, **kw,
    )  # fmt: skip
    for n in range(nodes):
        h.add_node(str(n), nproc=1)
    h.tick()
    h.bring_up()
    return h


def _all_pause(h: Harness, ranks: tuple[int, ...]) -> int:
    """The joiners have restored: the members are told to pause, each stops after the boundary
    (the swap then opens its generation); the boundary step."""
    h.tick()
    boundary = int(h.member(ranks[0]).last("pause")["at"])
    for r in ranks:
        h.worker_says(r, {"t": "paused", "step": boundary})
    h.tick(2)
    return boundary


def test_a_lost_node_drops_its_replica_group_and_the_group_grows_back(tmp_path: Path) -> None:
    """HSDP 2x2 on four nodes of one rank: node 3 is lost with no spare anywhere. Its replica group
    (ranks 2, 3) goes: rank 2 is retired (its place on node 2 waits as a spare), ranks 0 and 1 play
    all four data shards. Node 3 joins again: the group comes back through a boundary swap, each
    joiner restoring the shards of the rank with its coordinates in the group that stayed."""
    h = _running(tmp_path, "replicate=2,shard=2", nodes=4)
    assert [h.member(r).last("reconfigure")["shards"] for r in range(4)] == [[0], [1], [2], [3]]
    h.step_all(2)
    retired = h.coord.view.members[2]
    h.lose_node("3")
    assert h.coord.view.world_size == 2 and h.coord.generation == 2
    [shrink] = h.events("shrink")
    assert shrink["dropped"] == [2, 3] and shrink["shards"] == {"0": [0, 2], "1": [1, 3]}
    assert h.coord.view.workers[retired].role == "retired"
    kills = [m for m in h.agents["2"].sent if m.get("t") == "kill"]
    assert [int(m["spawn_id"]) for m in kills] == [retired]
    assert ("2", "spare") in {(n, role) for n, _, role in h.spawn_requests() if n == "2"}
    assert h.member(1).last("reconfigure")["shards"] == [1, 3]
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    h.exit(retired)  # its exit is no failure
    assert h.coord.state is JobState.RUNNING and h.coord.generation == 2

    h.add_node("3", nproc=1)  # node 3 joins again: with node 2's, two spares -- a whole group
    h.connect_spawned()
    h.tick()
    z = h.coord.swaps.grow
    assert z is not None and [j.rank for j in z.joiners] == [2, 3]
    assert [z.source_of(j)[0] for j in z.joiners] == [0, 1]  # same shard coordinate, group 0
    fetches = [m for a in h.agents.values() for m in a.sent if m.get("t") == "fetch"]
    assert sorted((int(m["rank"]), int(m["as_rank"])) for m in fetches) == [(0, 2), (1, 3)]
    for j in z.joiners:
        assert h.workers[j.sid].last("reconfigure")["shards"] == [j.rank]
        h.put("msg", h.workers[j.sid], {"t": "restored", "gen": h.coord.generation})
    boundary = _all_pause(h, (0, 1))
    assert h.coord.generation == 3 and h.coord.view.world_size == 4
    gen = h.events("generation")[-1]
    assert gen["grow"] == [2, 3] and gen["restore_step"] == boundary
    h.resume_all(boundary + 1)
    assert h.coord.state is JobState.RUNNING and h.coord.swaps.active is None
    [grow] = h.events("grow")
    assert grow["shards"] == {"0": [0], "1": [1], "2": [2], "3": [3]}


def test_a_job_that_drops_its_shrunk_batch_tells_each_rank_the_shards_it_plays_and_the_divisor(
    tmp_path: Path,
) -> None:
    """``--shrink-batch drop``: the group that stays plays only its own data shards, and its ranks
    divide the gradient sum by the 2 shards played (the job's 4 still number the samples); the
    grow brings every shard and the divisor back."""
    h = _running(tmp_path, "replicate=2,shard=2", nodes=4, shrink_batch="drop")
    full = {"shards": [1], "num_shards": 4, "divisor": 4}
    assert {k: h.member(1).last("reconfigure")[k] for k in full} == full
    h.step_all(2)
    h.lose_node("3")
    [shrink] = h.events("shrink")
    assert shrink["dropped"] == [2, 3] and shrink["shards"] == {"0": [0], "1": [1]}
    shrunk = {"shards": [1], "num_shards": 4, "divisor": 2}
    assert {k: h.member(1).last("reconfigure")[k] for k in shrunk} == shrunk
    h.resume_all(3)
    h.add_node("3", nproc=1)
    h.connect_spawned()
    h.tick()
    z = h.coord.swaps.grow
    assert z is not None
    for j in z.joiners:
        assert h.workers[j.sid].last("reconfigure")["divisor"] == 4
        h.put("msg", h.workers[j.sid], {"t": "restored", "gen": h.coord.generation})
    _all_pause(h, (0, 1))
    assert h.coord.view.world_size == 4 and h.member(1).last("reconfigure")["divisor"] == 4


def test_without_replicas_a_shrink_and_a_grow_gather_every_old_ranks_step_on_each_node(
    tmp_path: Path,
) -> None:
    """FSDP2 on three nodes of one rank, no spare: node 2 is lost. The step every OLD rank holds
    (rank 2's from its replica on node 0) is the one resharded; each node that plays a new rank
    reads every old rank's step from its own slots or its replicas, fetching the rest into its
    replica slots first, and its ranks are told their generation only once those fetches are in.
    A node joining brings the job back to 3 ranks at a boundary, every rank resharding again."""
    h = _running(tmp_path, "shard=3", nodes=3)
    h.step_all(2)
    h.step_all(3)
    h.replicas["0"] = {2: {2}}  # rank 2's step 2 is replicated to node 0; step 3 nowhere else
    h.lose_node("2")
    assert h.coord.view.world_size == 2
    [shrink] = h.events("shrink")
    assert shrink["dropped"] == [2] and shrink["shards"] == {"0": [0], "1": [1, 2]}
    fetches = sorted(
        (n, int(m["rank"]), m.get("into"))
        for n, a in h.agents.items()
        for m in a.sent
        if m.get("t") == "fetch"
    )
    # node 0 lacks old rank 1's step; node 1 lacks old ranks 0 and 2 (2 from node 0's replica)
    assert fetches == [("0", 1, "replica"), ("1", 0, "replica"), ("1", 2, "replica")]
    h.tick()  # the agents answered
    told = {r: h.member(r).last("reconfigure") for r in (0, 1)}
    assert all(m["restore_step"] == 2 and m["gen"] == 2 for m in told.values())
    assert told[0]["reshard"] == {
        "step": 2,
        "world": 3,
        "memory": {"0": "local", "1": "replica", "2": "replica"},
    }
    assert told[1]["reshard"]["memory"] == {"0": "replica", "1": "local", "2": "replica"}
    assert told[1]["shards"] == [1, 2] and told[1].get("fresh") is True
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    # node 3 joins: the job grows back to 3 at a boundary, every rank resharding the 2 ranks' step
    h.add_node("3", nproc=1)
    h.connect_spawned()
    h.tick()
    z = h.coord.swaps.grow
    assert z is not None and [j.rank for j in z.joiners] == [2] and z.joiners[0].source is None
    joiner = h.workers[z.joiners[0].sid]
    h.tick()  # the prepare fetch answered
    h.put("msg", joiner, {"t": "restored", "gen": h.coord.generation})
    boundary = _all_pause(h, (0, 1))
    assert h.coord.generation == 3 and h.coord.view.world_size == 3
    sent = [(n, m) for n, a in h.agents.items() for m in a.sent if m.get("t") == "fetch"]
    resharding = sorted((n, int(m["rank"])) for n, m in sent if m.get("into") and m["step"] == boundary)
    assert resharding == [("0", 1), ("1", 0), ("3", 0), ("3", 1)]  # each node gathers both old ranks
    h.tick()
    for r in range(3):
        m = h.member(r).last("reconfigure")
        assert m["gen"] == 3 and m["reshard"]["step"] == boundary and m["reshard"]["world"] == 2
        assert m["shards"] == [r] and m.get("fresh") is True
    h.resume_all(boundary + 1)
    assert h.coord.state is JobState.RUNNING and h.coord.swaps.active is None
    [grow] = h.events("grow")
    assert grow["shards"] == {"0": [0], "1": [1], "2": [2]}


def test_with_layouts_known_each_node_gathers_only_the_old_ranks_its_ranks_cut_from(
    tmp_path: Path,
) -> None:
    """The same shrink and grow as above, once rank 0 has said how the model is laid out (one
    6-row tensor sharded on dim 0 over ``shard``): a node fetches only the old ranks whose rows
    overlap its new rank's, plus the one its rank takes the unsharded rest from. Shrink 3 -> 2
    (old rows [0,2) [2,4) [4,6); new [0,3) [3,6)): node 0 needs old 0 and 1, node 1 old 1 and 2 --
    node 1 no longer fetches old rank 0. Grow 2 -> 3 (old [0,3) [3,6); new [0,2) [2,4) [4,6)):
    node 0 needs only its own old rank 0 and fetches nothing."""
    h = _running(tmp_path, "shard=3", nodes=3)
    layout = [[[6, 4], ["Shard(dim=0)"], ["shard"]]]
    h.worker_says(0, {"t": "ready", "layouts": layout})
    other = [[[99], ["Shard(dim=0)"], ["shard"]]]
    h.worker_says(1, {"t": "ready", "layouts": other})  # not rank 0's: ignored
    h.tick()
    h.step_all(2)
    h.step_all(3)
    h.replicas["0"] = {2: {2}}
    h.lose_node("2")
    sent = [(n, m) for n, a in h.agents.items() for m in a.sent if m.get("t") == "fetch"]
    assert sorted((n, int(m["rank"]), m.get("into")) for n, m in sent) == [
        ("0", 1, "replica"),
        ("1", 2, "replica"),
    ]
    h.tick()
    told = {r: h.member(r).last("reconfigure") for r in (0, 1)}
    assert told[0]["reshard"]["memory"] == {"0": "local", "1": "replica"}
    assert told[1]["reshard"]["memory"] == {"1": "local", "2": "replica"}
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    h.add_node("3", nproc=1)
    h.connect_spawned()
    h.tick()
    z = h.coord.swaps.grow
    assert z is not None
    joiner = h.workers[z.joiners[0].sid]
    h.tick()
    h.put("msg", joiner, {"t": "restored", "gen": h.coord.generation})
    boundary = _all_pause(h, (0, 1))
    sent = [(n, m) for n, a in h.agents.items() for m in a.sent if m.get("t") == "fetch"]
    resharding = sorted((n, int(m["rank"])) for n, m in sent if m.get("into") and m["step"] == boundary)
    assert resharding == [("1", 0), ("3", 0), ("3", 1)]
    h.tick()
    assert h.member(0).last("reconfigure")["reshard"]["memory"] == {"0": "local"}
    assert h.member(1).last("reconfigure")["reshard"]["memory"] == {"0": "replica", "1": "local"}
    h.resume_all(boundary + 1)
    assert h.coord.state is JobState.RUNNING
