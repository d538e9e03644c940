"""The coordinator's operations driven tick by tick against fake peers (no process, no socket):
start, recovery (and a failure during it), a migration aborted by its joiner's death, a shrink,
and requests built wrong by authenticated peers, which must never take the coordinator down."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nonstop.control.embedded import EmbeddedStore
from nonstop.control.jobstore import JobStore
from nonstop.control.rdzv import KeyValueTable
from nonstop.coordinator.failures import MAX_ERROR_DETAIL
from nonstop.coordinator.loop import JobState
from tests.coord_fakes import FakeChannel, Harness


def two_nodes(tmp_path: Path, **cfg: object) -> Harness:
    cfg.setdefault("lease_ttl_s", 60.0)
    h = Harness(tmp_path, nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", **cfg)
    h.add_node("0", nproc=1, spares=1)
    h.add_node("1", nproc=1, spares=1)
    h.tick()
    h.bring_up()
    assert h.coord.state is JobState.RUNNING
    return h


def test_job_starts_on_two_nodes(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    assert sorted(h.coord.view.members) == [0, 1]
    assert {h.coord.view.rank_node[0], h.coord.view.rank_node[1]} == {"0", "1"}
    roles = sorted(role for _, _, role in h.spawn_requests())
    assert roles == ["spare", "spare", "worker", "worker"]
    assert h.coord.generation == 1
    gen = h.events("generation")
    assert len(gen) == 1 and gen[0]["restore_step"] is None


def test_recovery_takes_the_spare_on_the_failed_ranks_node(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    h.step_all(2)
    failed = h.coord.view.members[1]
    h.exit(failed)
    assert h.coord.state is JobState.RECONFIGURING and h.coord.generation == 2
    new = h.coord.view.members[1]
    assert new != failed and h.coord.view.workers[new].role == "worker"
    assert h.coord.view.node_of(new) == h.coord.view.rank_node[1]  # the spare on the node holding its data
    reconf = h.member(1).last("reconfigure")
    assert reconf["gen"] == 2 and reconf["restore_step"] == 2 and reconf["recovery"] is True
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    [rec] = h.events("recovery")
    assert rec["rank"] == 1 and rec["replacement"] == "spare" and rec["restore_step"] == 2


def test_a_rank_that_raised_fails_with_its_exception_in_the_detail(tmp_path: Path) -> None:
    """A rank reports the exception its step raised, is told to raise it, and exits 1: the
    failure (and so a job that runs out of restarts on it) says what it raised, not only its
    exit code."""
    h = two_nodes(tmp_path)
    h.step_all(2)
    sid = h.coord.view.members[1]
    h.worker_says(1, {"t": "fault", "step": 3, "error": "RuntimeError: " + "x" * 1000})
    h.exit(sid, rc=1)
    [f] = h.events("failure")
    assert f["kind"] == "error" and f["rank"] == 1
    assert f["detail"] == "exit code 1 after RuntimeError: " + "x" * (MAX_ERROR_DETAIL - 14)


def test_a_failure_during_recovery_replans_with_both(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    h.step_all(2)
    h.exit(h.coord.view.members[1])
    assert h.coord.generation == 2
    h.exit(h.coord.view.members[0])  # before anyone restored
    assert h.coord.generation == 3
    assert h.coord.gens.reconf is not None and h.coord.gens.reconf.replans == 1
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    recs = h.events("recovery")
    assert sorted(r["rank"] for r in recs) == [0, 1] and all(r["replans"] == 1 for r in recs)


def test_migration_aborted_by_the_joiners_death(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    h.step_all(2)
    assert h.coord.swaps.request_migration(0, "1", "migrate") is None
    h.tick()
    m = h.coord.swaps.migration
    assert m is not None and m.target == "1"
    joiner = m.joiners[0].sid
    h.tick()  # the target's agent answered the prepare fetch
    assert h.workers[joiner].last("reconfigure")["prepare"] is True  # the fetch answered: it prepares
    h.exit(joiner)
    assert h.coord.swaps.migration is None
    [ab] = h.events("migration_aborted")
    assert ab["rank"] == 0 and "joiner" in ab["error"]
    assert h.coord.state is JobState.RUNNING and h.coord.generation == 1  # nothing else changed


def test_shrink_when_no_spare_is_left(tmp_path: Path) -> None:
    h = Harness(
        tmp_path, nnodes=2, nproc_per_node=1, spares=0, coordinator="127.0.0.1:0",
        lease_ttl_s=60.0, min_world_size=1,
    )  # fmt: skip
    h.add_node("0", nproc=1)
    h.add_node("1", nproc=1)
    h.tick()
    h.bring_up()
    h.step_all(2)
    h.lose_node("1")  # no spare anywhere: rank 1's shard goes to rank 0
    assert h.coord.view.world_size == 1 and h.coord.generation == 2
    [shrink] = h.events("shrink")
    assert shrink["dropped"] == [1] and shrink["shards"] == {"0": [0, 1]}
    assert h.member(0).last("reconfigure")["shards"] == [0, 1]
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING


# -- requests built wrong -------------------------------------------------------------------------
def test_kv_add_on_text_is_an_error_reply() -> None:
    kv = KeyValueTable(generation=3)
    sent: list[dict[str, object]] = []
    out = kv.handle({"id": 1, "gen": 3, "op": "set", "key": "k", "value": "dGV4dA=="}, sent.append)
    assert out[0][1] == {"t": "kv", "id": 1}
    [(_, reply)] = kv.handle({"id": 2, "gen": 3, "op": "add", "key": "k", "amount": 1}, sent.append)
    assert reply["id"] == 2 and "not a counter" in str(reply["error"])
    [(_, reply)] = kv.handle({"id": 3, "gen": 3, "op": "add", "key": "n", "amount": "x"}, sent.append)
    assert reply["id"] == 3 and "bad 'add' request" in str(reply["error"])
    [(_, reply)] = kv.handle({"id": 4, "gen": 3, "op": "set", "key": "k", "value": "%%"}, sent.append)
    assert reply["id"] == 4 and "error" in reply
    [(_, reply)] = kv.handle({"id": "x", "gen": 3, "op": "get"}, sent.append)
    assert "malformed request id" in str(reply["error"])
    [(_, reply)] = kv.handle({"id": 5, "gen": 3, "op": "add", "key": "n", "amount": 2}, sent.append)
    assert reply["value"] == 2  # the table still works


def test_kv_misuse_by_a_worker_leaves_the_job_running(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    h.worker_says(0, {"t": "kv", "id": 7, "op": "set", "key": "k", "value": "dGV4dA=="})
    h.worker_says(0, {"t": "kv", "id": 8, "op": "add", "key": "k", "amount": 1})
    h.tick()
    reply = h.member(0).last("kv")
    assert reply["id"] == 8 and "not a counter" in reply["error"]
    assert h.coord.state is JobState.RUNNING
    h.step_all(2)
    assert h.coord.view.latest_step == {0: 2, 1: 2}


def test_a_malformed_worker_message_fails_only_its_sender(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    bad = h.member(1)
    sid = h.coord.view.members[1]
    h.put("msg", bad, {"t": "step", "gen": h.coord.generation})  # no step number
    h.tick()
    assert bad.closed and h.coord.state is JobState.RUNNING
    [err] = h.events("protocol_error")
    assert err["spawn_id"] == sid and err["rank"] == 1 and "without 'step'" in err["error"]
    time.sleep(0.6)  # the detector fails a worker whose channel stays closed (CLOSE_GRACE_S)
    h.tick()
    kill = h.agents[h.coord.view.node_of(sid)].last("kill")
    assert kill["spawn_id"] == sid
    h.exit(sid)
    assert h.coord.generation == 2 and h.coord.view.members[1] != sid  # recovered like any failure
    h.resume_all(2)
    assert h.coord.state is JobState.RUNNING


def test_a_malformed_agent_message_loses_only_that_node(tmp_path: Path) -> None:
    h = two_nodes(tmp_path)
    h.step_all(2)
    h.replicas["0"] = {1: {2}}  # node 0 holds rank 1's replica of step 2
    h.put("msg", h.agents["1"], {"t": "exit"})  # no spawn id
    h.tick()
    assert not h.coord.view.nodes["1"].alive and h.coord.view.nodes["0"].alive
    assert h.events("protocol_error")[0]["node"] == "1"
    assert h.coord.state is JobState.RECONFIGURING and h.coord.generation == 2
    assert h.coord.view.rank_node[1] == "0"  # its rank went to the spare on node 0
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING


@pytest.mark.parametrize(
    "msg",
    [{"t": "migrate"}, {"t": "migrate", "rank": "x"}, {"t": "drain"}, {"t": "status", "x": 1}, {"t": 5}],
)
def test_a_malformed_client_request_gets_an_error(tmp_path: Path, msg: dict[str, object]) -> None:
    h = two_nodes(tmp_path)
    client = FakeChannel({"role": "client"}, peer="client")
    h.put("open", client)
    h.put("msg", client, msg)
    h.tick()
    assert h.coord.state is JobState.RUNNING
    assert any(m.get("t") in ("error", "status") for m in client.sent)


# -- a coordinator restarted (store mode) with an operation in flight -----------------------------
def test_a_restarted_coordinator_aborts_a_migration_it_finds_unswapped(tmp_path: Path) -> None:
    jobs = JobStore(EmbeddedStore(), "fakejob")  # what etcd would hold, in process
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    cfg: dict[str, object] = dict(
        nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:1", lease_ttl_s=60.0,
        store="etcd://127.0.0.1:1", secret_file=secret,
    )  # fmt: skip
    keepers = [jobs.register_node(n, "127.0.0.1:1", ttl=60.0) for n in ("0", "1")]
    try:
        a = Harness(tmp_path / "a", jobs=jobs, **cfg)
        a.coord.store.open()
        a.add_node("0", nproc=1, spares=1)
        a.add_node("1", nproc=1, spares=1)
        a.tick()
        a.bring_up()
        a.step_all(2)
        assert a.coord.swaps.request_migration(0, "1", "migrate") is None
        a.tick(2)
        m = a.coord.swaps.migration
        assert m is not None and "fetched" in m.marks  # the joiner took rank 0 to prepare
        joiner = m.joiners[0].sid
        assert a.coord.swaps.request_migration(0, "1", "migrate") is not None  # already moving
        jobs.save(a.coord.store.record())
        assert a.coord.store.leader is not None
        a.coord.store.leader.stop(revoke=True)  # the coordinator dies; its record stays in the store

        b = Harness(tmp_path / "b", jobs=jobs, **cfg)
        b.agents, b.workers, b.held = a.agents, a.workers, a.held
        b.coord.store.open()
        assert b.coord.view.workers[joiner].role == "joiner"
        b.reattach_node("0")
        b.reattach_node("1")
        b.tick()
        assert b.coord.view.workers[joiner].role == "retired"
        assert b.agents["1"].last("kill")["spawn_id"] == joiner
        assert any(role == "spare" and node == "1" for node, _, role in b.spawn_requests())
        [ab] = b.events("migration_aborted")
        assert ab["rank"] == 0 and ab["error"] == "the coordinator restarted"
        for rank in (0, 1):
            sid = b.coord.view.members[rank]
            chan = b.reconnect_worker(sid, {"gen": b.coord.generation, "step": 2})
            assert chan.last("continue")  # paused ranks go on
        assert b.coord.state is JobState.RUNNING
        assert b.coord.swaps.request_migration(0, "1", "migrate") is None  # it can be asked again
        b.coord.store.close()
    finally:
        for k in keepers:
            k.stop(revoke=True)


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        ({"t": "step", "gen": 1, "step": "x", "step_s": 0.1}, "must be an integer"),
        ({"t": "step", "gen": 1, "step": 3, "step_s": True}, "must be a number"),
        ({"t": "paused", "gen": 1}, "without 'step'"),
        ({"t": "injected", "ts": "now"}, "must be a number"),
        ({"t": "done", "gen": "1", "step": 3}, "must be an integer"),
    ],
)
def test_typed_decoding_names_the_bad_field(tmp_path: Path, msg: dict[str, object], why: str) -> None:
    h = two_nodes(tmp_path)
    h.put("msg", h.member(0), msg)
    h.tick()
    [err] = h.events("protocol_error")
    assert why in err["error"] and h.member(0).closed and h.coord.state is JobState.RUNNING


def test_agent_and_client_messages_are_typed() -> None:
    from nonstop.protocol import wire

    inv = wire.decode_agent({"t": "inventory", "id": 3, "local": {"0": [4, 5]}, "replicas": {}})
    assert inv == wire.Inventory(id=3, local={0: (4, 5)}, replicas={})
    with pytest.raises(wire.WireError, match="map ranks to step lists"):
        wire.decode_agent({"t": "inventory", "id": 3, "local": {"0": ["x"]}})
    assert wire.decode_agent({"t": "from-the-future"}) is None
    assert wire.decode_client({"t": "drain", "node": 2}) == wire.Drain(node="2")
    with pytest.raises(wire.WireError):
        wire.decode_client({"t": "drain", "node": [1]})


def test_a_node_lost_while_the_nodes_answer_is_planned_with_the_first(tmp_path: Path) -> None:
    """Inventory replies are events: while they are awaited the coordinator serves everything
    else, and a second loss merges into the plan instead of a recovery of its own."""
    h = Harness(tmp_path, nnodes=3, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", lease_ttl_s=60.0)
    for n in ("0", "1", "2"):
        h.add_node(n, nproc=1, spares=1)
    h.tick()
    h.bring_up()
    h.step_all(2)
    h.replicas["0"] = {1: {2}, 2: {2}}  # node 0 holds the replicas of ranks 1 and 2
    h.hold_inventories = True
    h.lose_node("1")
    assert h.coord.gens.asks.inventory_reqs and h.coord.gens.reconf is None  # planning waits for answers
    h.worker_says(0, {"t": "hb", "coll": True})  # served meanwhile
    h.lose_node("2")
    assert h.coord.generation == 3  # the first plan was never made
    h.release_inventories()
    r = h.coord.gens.reconf
    assert r is not None and sorted(f.rank for f in r.failures) == [1, 2] and r.replans == 1
    assert r.restore_step == 2 and {h.coord.view.rank_node[k] for k in (1, 2)} == {"0"}
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    assert sorted(e["rank"] for e in h.events("recovery")) == [1, 2]


def _grown_to_the_swap(tmp_path: Path) -> tuple[Harness, int, int]:
    """Elastic: a lost node shrinks the job; a node joining brings its rank slots as spares; the
    joiner prepares (rank 0's committed step fetched to it, restored), every rank pauses at a
    boundary, and the grow's generation starts there. Returns the harness, the joiner's spawn id
    and the boundary, with the grow's generation open and no step of it done yet."""
    h = Harness(
        tmp_path, nnodes=2, nproc_per_node=1, spares=0, coordinator="127.0.0.1:0", lease_ttl_s=60.0,
        min_world_size=1,
    )  # fmt: skip
    h.add_node("0", nproc=1)
    h.add_node("1", nproc=1)
    h.tick()
    h.bring_up()
    h.step_all(2)
    h.lose_node("1")
    h.resume_all(3)
    assert h.coord.view.world_size == 1 and h.coord.state is JobState.RUNNING
    h.add_node("2", nproc=1)  # a node joins the running job: its rank slot waits as a spare
    h.connect_spawned()
    h.tick()
    z = h.coord.swaps.grow
    assert z is not None and [j.rank for j in z.joiners] == [1]
    joiner = h.workers[z.joiners[0].sid]
    h.tick()  # the joiner's node answered the prepare fetch: it is told its rank
    prep = joiner.last("reconfigure")
    assert prep["prepare"] is True and prep["rank"] == 1 and prep["world_size"] == 2
    h.put("msg", joiner, {"t": "restored", "gen": h.coord.generation})
    h.tick()
    pause = h.member(0).last("pause")
    boundary = pause["at"]
    h.worker_says(0, {"t": "paused", "step": boundary})  # the source rank: its boundary is fetched now
    h.tick(2)
    assert h.coord.generation == 3 and h.coord.view.world_size == 2
    assert h.coord.view.members[1] == z.joiners[0].sid
    return h, z.joiners[0].sid, boundary


def test_a_shrunk_job_grows_back_through_a_boundary_swap(tmp_path: Path) -> None:
    """The grow's generation starts at the boundary without a rollback (_grown_to_the_swap)."""
    h, _, boundary = _grown_to_the_swap(tmp_path)
    gen = h.events("generation")[-1]
    assert gen["grow"] == [1] and gen["restore_step"] == boundary
    h.resume_all(boundary + 1)
    assert h.coord.state is JobState.RUNNING and h.coord.swaps.active is None
    [done] = h.events("grow_done")
    assert done["world_size"] == 2 and done["boundary"] == boundary


def test_a_failure_right_after_a_grows_swap_leaves_the_grow_done(tmp_path: Path) -> None:
    """Rank 0 dies in the grow's generation before its first step: the joiner already holds
    rank 1, so the grow took effect -- reported done, interrupted -- and recovery replaces rank 0."""
    h, joiner, boundary = _grown_to_the_swap(tmp_path)
    assert h.coord.view.members[1] == joiner
    h.exit(h.coord.view.members[0])
    assert h.events("grow_aborted") == []
    [done] = h.events("grow_done")
    assert done["boundary"] == boundary and "rank 0 failed" in done["interrupted"]
    assert done.get("pause_ratio") is None
    assert h.coord.swaps.active is None and h.coord.generation == 4
    assert h.coord.view.members[1] == joiner  # the grown rank stays where the grow put it


class _Durable:
    """What the coordinator asks of a durable tier: its steps and their world sizes."""

    def __init__(self, url: str) -> None:
        self.url = url

    def steps(self) -> list[int]:
        return [2, 4]

    def world_size_at(self, step: int) -> int:
        return 2


def test_memory_lost_with_its_node_falls_back_to_the_durable_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No replica holds the lost node's rank: every node installs the newest checkpoint that
    installs everywhere (the nodes' answers are events; a corrupt step 4 is skipped for 2)."""
    import nonstop.snapshot.durable as durable

    monkeypatch.setattr(durable, "DurableStore", _Durable)
    h = Harness(tmp_path, nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", lease_ttl_s=60.0)
    h.coord.durable_url = h.coord.sources.durable_url = str(tmp_path / "ckpt")  # (given at start)
    h.add_node("0", nproc=1, spares=1)
    h.add_node("1", nproc=1, spares=1)
    h.tick()
    h.bring_up()
    h.step_all(5)
    h.bad_durable_steps = {4}
    h.lose_node("1")
    h.tick(3)
    r = h.coord.gens.reconf
    assert r is not None and r.restore_step == 2
    [gen] = [e for e in h.events("generation") if e["generation"] == 2]
    assert gen["tier"] == "durable" and gen["restore_step"] == 2
    [bad] = h.events("durable_install_failed")
    assert bad["step"] == 4 and "corrupt" in bad["errors"][0]
    assert h.events("restore_from_durable")[0]["step"] == 2
    h.resume_all(3)
    assert h.coord.state is JobState.RUNNING
    [rec] = h.events("recovery")
    assert rec["restore_step"] == 2 and rec["lost_steps"] == 3


def test_nothing_durable_fails_the_job_with_what_to_do(tmp_path: Path) -> None:
    h = Harness(tmp_path, nnodes=2, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", lease_ttl_s=60.0)
    h.add_node("0", nproc=1, spares=1)
    h.add_node("1", nproc=1, spares=1)
    h.tick()
    h.bring_up()
    h.step_all(5)
    h.lose_node("1")
    h.tick()
    assert h.coord.state is JobState.FAILED and "--persist-every" in str(h.coord.error)


def test_status_of_a_member_planned_but_not_spawned_yet(tmp_path: Path) -> None:
    """Early in a job a rank's spawn id is a member before its process record exists: status
    (``nonstop status``, the metrics endpoint) shows it without a pid instead of failing."""
    h = Harness(tmp_path, nnodes=1, nproc_per_node=2)
    h.add_node("0", nproc=2)
    h.coord.view.members[1] = 999  # planned, no WorkerRecord yet
    st = h.coord.clients.status()
    assert st["ranks"]["1"] == {
        "node": h.coord.view.rank_node.get(1),
        "spawn_id": 999,
        "pid": None,
        "connected": False,
        "step": h.coord.view.latest_step.get(1),
    }


def _silent_until_asked(h: Harness, rank: int, timeout_s: float) -> int:
    """Rank ``rank`` goes silent while the other beats, until its agent is asked to judge it."""
    sid = h.coord.view.members[rank]
    agent = h.agents[h.coord.view.node_of(sid)]
    end = time.monotonic() + 20 * timeout_s
    while "kill" not in agent.kinds():
        assert time.monotonic() < end, "the silent rank was never judged"
        for other in h.coord.view.members:
            if other != rank:
                h.worker_says(other, {"t": "hb", "coll": True, "step": 2, "idle": 0.0})
        h.tick()
        time.sleep(timeout_s / 10)
    return sid


def test_a_silent_rank_its_agent_saw_move_is_spared_then_killed_at_the_longer_limit(tmp_path: Path) -> None:
    """The kill of a silent rank goes to its agent as 'unless_moving' (agent/silence.py). The
    agent says it moves: no hang, no kill, 'silence_excused'; still silent at JOB_STALL_FACTOR x
    the timeout, it is killed outright; its exit is a hang like any other."""
    from nonstop.config import DetectorConfig
    from nonstop.policy.decisions import JOB_STALL_FACTOR

    timeout = 0.3
    h = two_nodes(tmp_path, detector=DetectorConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=timeout))
    h.step_all(2)
    sid = _silent_until_asked(h, 1, timeout)
    agent = h.agents[h.coord.view.node_of(sid)]
    asked_at = time.monotonic()
    assert agent.last("kill") == {"t": "kill", "spawn_id": sid, "sig": 9, "unless_moving": True}
    assert h.events("hang_detected") == []
    h.put("msg", agent, {"t": "judged", "spawn_id": sid, "hung": False, "detail": "5.0 ms on a CPU"})
    h.tick()
    [excused] = h.events("silence_excused")
    assert excused["spawn_id"] == sid and excused["rank"] == 1 and excused["detail"] == "5.0 ms on a CPU"
    assert h.coord.view.workers[sid].killed_for_hang is None
    while len([m for m in agent.sent if m.get("t") == "kill"]) < 2:
        assert time.monotonic() - asked_at < 10 * JOB_STALL_FACTOR * timeout, "never killed"
        h.worker_says(0, {"t": "hb", "coll": True, "step": 2, "idle": 0.0})
        h.tick()
        time.sleep(timeout / 10)
    assert time.monotonic() - asked_at >= (JOB_STALL_FACTOR - 1) * timeout * 0.9
    assert agent.last("kill") == {"t": "kill", "spawn_id": sid, "sig": 9}  # no second opinion now
    [hang] = h.events("hang_detected")
    assert hang["spawn_id"] == sid and "no heartbeat" in hang["reason"]
    h.exit(sid)
    [failure] = h.events("failure")
    assert failure["kind"] == "hang" and failure["rank"] == 1


def test_a_silent_rank_its_agent_found_stopped_is_a_hang_with_what_the_agent_saw(tmp_path: Path) -> None:
    from nonstop.config import DetectorConfig

    timeout = 0.3
    h = two_nodes(tmp_path, detector=DetectorConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=timeout))
    h.step_all(2)
    sid = _silent_until_asked(h, 1, timeout)
    agent = h.agents[h.coord.view.node_of(sid)]
    h.put("msg", agent, {"t": "judged", "spawn_id": sid, "hung": True, "detail": "stopped (state T)"})
    h.tick()
    [hang] = h.events("hang_detected")
    assert hang["spawn_id"] == sid and hang["reason"].endswith("; stopped (state T)"), hang
    h.exit(sid)
    [failure] = h.events("failure")
    assert failure["kind"] == "hang" and "stopped (state T)" in failure["detail"]
    assert h.events("silence_excused") == []


def _every_4_snapshotted(tmp_path: Path) -> Harness:
    """3 nodes of one rank and one spare each, ``--snapshot-every 4``, step 4 snapshotted."""
    h = Harness(
        tmp_path, nnodes=3, nproc_per_node=1, spares=1, coordinator="127.0.0.1:0", lease_ttl_s=60.0,
        snapshot_every=4,
    )  # fmt: skip
    for n in ("0", "1", "2"):
        h.add_node(n, nproc=1, spares=1)
    h.tick()
    h.bring_up()
    h.step_all(4)
    return h


def test_a_recovery_with_rescues_asks_the_survivors_to_leave_and_plans_their_step(tmp_path: Path) -> None:
    """``--snapshot-every 4``: rank 2's node is lost after step 6 (the last snapshot: 4). The
    survivors are asked to leave their step; each reports the step it rescued (6, its head's
    digest alike); the plan restores 6, and rank 2's replacement takes rank 0's (its donor)."""
    h = _every_4_snapshotted(tmp_path)
    h.replicas["0"] = {2: {4}}  # node 0 holds rank 2's replica of step 4
    h.lose_node("2")
    assert h.coord.gens.reconf is None  # the plan waits for the survivors' reports
    gen = h.coord.generation
    for rank in (0, 1):
        assert h.member(rank).last("leave") == {"t": "leave", "gen": gen, "recovery": True, "lost": [2]}
    report = {"gen": gen - 1, "t": "fault", "step": 6, "error": "x", "rescued": 6, "rest": "d"}
    h.put("msg", h.member(0), report)
    h.tick()
    assert h.coord.gens.reconf is None  # rank 1 has not reported
    h.put("msg", h.member(1), report)
    h.tick()
    r = h.coord.gens.reconf
    assert r is not None and r.restore_step == 6
    node = h.coord.view.rank_node[2]
    fetches = [m for m in h.agents[node].sent if m.get("t") == "fetch"]
    if node == h.coord.view.rank_node[0]:  # beside its donor: it reads rank 0's slots there
        assert r.from_rank == {2: 0} and not fetches
    else:  # elsewhere: its node fetches rank 0's step 6 as rank 2's
        (f,) = fetches
        assert (f["rank"], f["step"], f["as_rank"]) == (0, 6, 2) and 2 not in r.from_rank
    h.resume_all(7)
    (rec,) = h.events("recovery")
    assert rec["restore_step"] == 6 and rec["lost_steps"] == 0


def test_a_failure_during_a_generations_setup_asks_no_rescue(tmp_path: Path) -> None:
    """No survivor is in a step while a generation is set up: the plan does not wait for them."""
    h = _every_4_snapshotted(tmp_path)
    h.exit(h.coord.view.members[2])  # a kill: the spare on node 2 takes rank 2 once planned
    gen = h.coord.generation
    for rank in (0, 1):
        h.put("msg", h.member(rank), {"gen": gen - 1, "t": "fault", "step": 4, "error": "x", "rescued": 4})
    h.tick()
    assert h.coord.gens.reconf is not None  # planned; its setup begins
    h.exit(h.coord.view.members[1])  # rank 1 dies during the setup
    assert h.coord.generation == gen + 1 and h.coord.gens.reconf is not None  # planned at once
    assert not [m for m in h.member(0).sent if m.get("t") == "leave" and m.get("gen") == gen + 1]
