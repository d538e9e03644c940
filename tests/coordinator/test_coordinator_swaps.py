"""The boundary swaps built alone (issue 46: no operation holds the coordinator):
:class:`~nonstop.coordinator.swaps.Swaps` and :class:`~nonstop.coordinator.swap_actions.SwapActions`
with a real view, a real executor over fake channels, an event log in a temp dir, and fakes of only
the peers they call (the restore sources, the generations, the job's sizes, the node agents, the
persist rounds). A whole coordinator migrating and growing is tests/coordinator/test_coordinator_ops.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nonstop.config import DetectorConfig
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.swap_actions import SwapActions
from nonstop.coordinator.swaps import Swaps
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog
from nonstop.policy.boundary_swap import BoundarySwap, Continue, Joiner, Pause, Retire, SwapKind, SwapNow
from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.phase import Busy, JobPhase
from nonstop.policy.reconfiguration import Reconfiguration
from nonstop.protocol.agent import FetchedBytes
from nonstop.protocol.wire import Fetched
from tests.coord_fakes import FakeChannel, FakeClock, agent_chan, logged, worker_chan


# -- fakes of the peers -----------------------------------------------------------------------------
class FakeSources:
    def __init__(self) -> None:
        self.early: list[tuple[str, int, int, str, int]] = []
        self.dropped: list[int] = []
        self.fetches: list[tuple[int, int, str, int | None, int | None]] = []

    def fetch_early(
        self, target: str, rank: int, step: int, source: str, *, as_rank: int, base: int | None = None
    ) -> int:
        self.early.append((target, rank, step, source, as_rank))
        return 900 + len(self.early)

    def fetch_for(
        self,
        r: Reconfiguration,
        rank: int,
        step: int,
        source: str,
        kind: str,
        *,
        src_rank: int | None = None,
        base: int | None = None,
        early: int | None = None,
    ) -> str:
        self.fetches.append((rank, step, source, src_rank, early))
        return f"fetch-{rank}"

    def drop_early(self, req: int) -> None:
        self.dropped.append(req)


class FakeGens:
    """Opens generations on the view as the real ones do; records the swap's generation."""

    def __init__(self, view: JobView) -> None:
        self.view = view
        self.launched: list[tuple[Reconfiguration, str, dict[int, str], dict[str, Any]]] = []

    def open_generation(self) -> None:
        self.view.generation += 1
        self.view.phase = JobPhase.RECONFIGURING

    def boundary_generation(
        self, step: int, replacements: dict[int, str], *, fresh: set[int] | None = None
    ) -> Reconfiguration:
        return Reconfiguration(
            generation=self.view.generation,
            world_size=self.view.world_size,
            failures=[],
            restore_step=step,
            replacements=replacements,
            fresh=fresh or set(),
        )

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        self.launched.append((r, tier, fetches, extra))


class FakeResize:
    def __init__(self, *, reshards: bool = False) -> None:
        self._reshards = reshards
        self.asked: list[tuple[dict[int, str], int]] = []
        self.resharded: list[tuple[int, int]] = []

    @property
    def reshards(self) -> bool:
        return self._reshards

    def joiners(self, idle: Mapping[int, str], target: int) -> list[Joiner]:
        self.asked.append((dict(idle), target))
        first = target - len(idle)
        return [
            Joiner(sid=sid, rank=first + i, node=node) for i, (sid, node) in enumerate(sorted(idle.items()))
        ]

    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]:
        return {"shards": [rank], "num_shards": world_size}

    def data_shards(self, world_size: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r,) for r in range(world_size))

    def reshard_at_boundary(self, r: Reconfiguration, step: int, old_world: int) -> None:
        self.resharded.append((step, old_world))


class FakeNodes:
    def __init__(self) -> None:
        self.lost: list[tuple[str, str, bool]] = []

    def lose_node(
        self, node: NodeRecord, why: str, *, quarantine: bool = False, failure: bool = True
    ) -> None:
        self.lost.append((node.name, why, failure))


class FakePersist:
    def __init__(self) -> None:
        self.requests = 0

    def request(self) -> int:
        self.requests += 1
        return self.requests


# -- the parts --------------------------------------------------------------------------------------
class Parts:
    """A job of ``world`` members on node 0, a connected idle spare on each other node, and the
    swaps built from fakes."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        world: int = 1,
        full: int | None = None,
        nodes: int = 2,
        timeout_s: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.tmp_path = tmp_path
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.view = view = JobView(job_id="j", world_size=world)
        for i in range(nodes):
            chan = FakeChannel({"role": "agent", "node": str(i)}, peer=f"agent-{i}")
            view.nodes[str(i)] = NodeRecord(
                name=str(i),
                chan=chan,
                nproc=world,
                spares=1,
                domain=str(i),
                data_addr=f"addr-{i}",
                last_lease=0.0,
            )  # type: ignore[arg-type]
        self.events = EventLog(tmp_path / "events.jsonl")
        self.io = Executor(view, self.events)
        self.life = JobLife(view=view, events=self.events, io=self.io, replicating=False)
        self.members = [self._worker("0", Role.WORKER, rank) for rank in range(world)]
        self.spares = [self._worker(str(i), Role.SPARE, None) for i in range(1, nodes)]
        view.phase = JobPhase.RUNNING
        self.sources, self.gens, self.resize = FakeSources(), FakeGens(view), FakeResize()
        self.nodes, self.persist = FakeNodes(), FakePersist()
        self.actions = SwapActions(view=view, io=self.io, events=self.events, sources=self.sources)
        self.actions.bind(gens=self.gens, resize=self.resize)
        full = world if full is None else full
        self.swaps = Swaps(
            view=view,
            io=self.io,
            events=self.events,
            life=self.life,
            actions=self.actions,
            elastic=ElasticPolicy(full_world_size=full, min_world_size=1),
            detector=FailureDetector(DetectorConfig()),
            full_world_size=full,
            rebuild_timeout_s=timeout_s,
            swap_transfer="auto",
            persist=self.persist,
            clock=clock,
        )
        self.swaps.bind(resize=self.resize, nodes=self.nodes)

    def _worker(self, node: str, role: Role, rank: int | None) -> int:
        w = self.view.add_worker(node, role, rank, 0.0)
        w.chan = FakeChannel({"role": str(role)}, peer=f"worker-{w.spawn_id}")  # type: ignore[assignment]
        return w.spawn_id

    def chan(self, sid: int) -> FakeChannel:
        return worker_chan(self.view, sid)

    def agent(self, node: str) -> FakeChannel:
        return agent_chan(self.view, node)

    def events_named(self, name: str) -> list[dict[str, Any]]:
        return logged(self.tmp_path / "events.jsonl", name)


def _fetched(req: int, *, ok: bool = True) -> Fetched:
    return Fetched(
        id=req,
        ok=ok,
        error=None if ok else "no",
        seconds=0.1,
        moved=FetchedBytes(raw_bytes=10, wire_bytes=10, delta=False, capped=False),
    )


# -- Swaps: requests ----------------------------------------------------------------------------------
def test_a_migration_request_is_checked_then_queued(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    assert p.swaps.request_migration(3, None, "migrate") == "no rank 3: the job has ranks 0..0"
    assert (
        p.swaps.request_migration(0, "9", "migrate") == "node 9 is not a live node of the job (nodes: 0, 1)"
    )
    assert p.swaps.request_migration(0, "0", "migrate") == "rank 0 already runs on node 0"
    assert p.swaps.request_migration(0, "1", "drain") is None
    assert p.swaps.request_migration(0, "1", "drain") == "rank 0 is already being moved"
    assert [(q[0], q[1], q[2]) for q in p.swaps.queue] == [(0, "1", "drain")]
    assert p.swaps.moving and Busy.MIGRATING in p.swaps.busy()
    assert [e["rank"] for e in p.events_named("migration_requested")] == [0]


def test_a_preempted_node_asks_a_persist_and_queues_a_move_of_each_rank(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=2, nodes=3)
    p.swaps.on_preempt(p.view.nodes["0"], 20.0)
    assert p.view.nodes["0"].draining and p.persist.requests == 1
    assert [(q[0], q[1], q[2]) for q in p.swaps.queue] == [(0, None, "preempt"), (1, None, "preempt")]
    assert p.events_named("preempt_notice")[0]["ranks"] == [0, 1]
    assert p.nodes.lost == []  # it still plays its ranks: not released
    p.swaps.on_preempt(p.view.nodes["0"], 20.0)  # a second notice changes nothing
    assert p.persist.requests == 1 and len(p.swaps.queue) == 2


def test_a_drained_node_that_plays_no_rank_is_released_not_failed(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.view.nodes["1"].draining = True
    p.swaps.tick()
    assert p.agent("1").kinds() == ["release"]
    assert p.nodes.lost == [("1", "released after draining", False)]
    assert [e["node"] for e in p.events_named("node_released")] == ["1"]
    assert p.agent("0").kinds() == []


# -- Swaps: a migration -------------------------------------------------------------------------------
def test_a_queued_migration_takes_the_idle_spare_and_fetches_the_committed_step(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.view.latest_step[0] = 7
    assert p.swaps.request_migration(0, None, "migrate") is None
    p.swaps.tick()
    m = p.swaps.migration
    assert m is not None and m.target == "1" and m.prepare_step == 7 and m.leaver_sid == p.members[0]
    joiner = p.view.workers[p.spares[0]]
    assert (joiner.role, joiner.rank) == (Role.JOINER, 0) and not p.swaps.queue
    fetch = p.agent("1").last("fetch")
    assert (fetch["rank"], fetch["step"], fetch["addr"], fetch["track"]) == (0, 7, "addr-0", True)
    assert p.swaps.owns(fetch["id"]) and p.events_named("migration_start")


def test_the_prepare_fetch_answered_tells_the_joiner_its_rank(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.view.latest_step[0] = 7
    p.swaps.request_migration(0, "1", "migrate")
    p.swaps.tick()
    req = p.agent("1").last("fetch")["id"]
    p.swaps.on_fetched(_fetched(req))
    assert not p.swaps.owns(req) and req not in p.io.pending
    told = p.chan(p.spares[0]).last("reconfigure")
    assert (told["rank"], told["world_size"], told["restore_step"], told["prepare"]) == (0, 1, 7, True)
    assert told["shards"] == [0] and told["recovery"] is False  # the job's sizes answered for it


def test_a_catch_up_answered_as_a_delta_is_logged_and_counted_as_one(tmp_path: Path) -> None:
    """The agent's answer reaches the swap's machine with its measure (its delta, its sizes)."""
    p = Parts(tmp_path)
    p.view.latest_step[0] = 7
    p.swaps.request_migration(0, "1", "migrate")
    p.swaps.tick()
    p.swaps.on_fetched(_fetched(p.agent("1").last("fetch")["id"]))
    p.view.latest_step[0] = 9  # the job went on while the joiner restored step 7
    assert p.swaps.on_restored(p.view.workers[p.spares[0]]) is not False
    catchup = p.agent("1").last("fetch")
    assert (catchup["step"], catchup["base"]) == (9, 7)
    p.swaps.on_fetched(
        Fetched(
            id=catchup["id"],
            ok=True,
            seconds=0.2,
            moved=FetchedBytes(raw_bytes=100, wire_bytes=30, delta=True, capped=False),
        )
    )
    [round_] = p.events_named("catchup")
    assert round_["ok"] and round_["delta"] and (round_["raw_bytes"], round_["wire_bytes"]) == (100, 30)
    m = p.swaps.migration
    assert m is not None and m.catch is not None and m.catch.held == 9
    assert [t.wire_bytes for t in m.catch.catchups] == [30]


def test_no_spare_within_the_timeout_refuses_the_migration_and_answers_its_client(tmp_path: Path) -> None:
    p = Parts(tmp_path, nodes=1, timeout_s=0.0)
    client = FakeChannel({"role": "client"})
    p.swaps.request_migration(0, None, "drain")
    p.swaps.clients[0] = [client]  # type: ignore[list-item]
    p.swaps.tick()
    assert p.swaps.active is None and not p.swaps.queue
    assert p.events_named("migration_refused")[0]["reason"] == "no node has an idle spare"
    assert client.sent == [{"t": "migrated", "rank": 0, "ok": False, "error": "no node has an idle spare"}]


def test_a_migration_waits_for_a_spare_until_the_swaps_clock_passes_the_timeout(tmp_path: Path) -> None:
    clock = FakeClock()
    p = Parts(tmp_path, nodes=1, timeout_s=30.0, clock=clock)
    client = FakeChannel({"role": "client"})
    p.swaps.request_migration(0, None, "drain")
    p.swaps.clients[0] = [client]  # type: ignore[list-item]
    p.swaps.tick()
    clock.advance(29.0)
    p.swaps.tick()  # no spare yet, but within the timeout: asked again later
    assert p.swaps.active is None and [q[0] for q in p.swaps.queue] == [0]
    assert not p.events_named("migration_refused") and client.sent == []
    clock.advance(2.0)
    p.swaps.tick()
    assert not p.swaps.queue
    assert p.events_named("migration_refused")[0]["reason"] == "no node has an idle spare"
    assert client.sent == [{"t": "migrated", "rank": 0, "ok": False, "error": "no node has an idle spare"}]


def test_a_joiner_exit_aborts_the_migration_and_frees_the_spare(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    client = FakeChannel({"role": "client"})
    p.swaps.request_migration(0, "1", "migrate")
    p.swaps.clients[0] = [client]  # type: ignore[list-item]
    p.swaps.tick()
    req = p.agent("1").last("fetch")["id"]
    p.swaps.on_exit(p.spares[0], member=False, how="killed by SIGKILL")
    assert p.swaps.active is None and not p.swaps.owns(req) and req not in p.io.pending
    assert p.view.workers[p.spares[0]].role is Role.SPARE  # never told: idle again
    assert p.events_named("migration_aborted")[0]["error"].startswith("the joiner (spawn 1) exited")
    assert client.sent[0]["ok"] is False


def test_finishing_ends_the_swap_and_answers_the_queued_migrations(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=2, nodes=3)
    clients = {rank: FakeChannel({"role": "client"}) for rank in (0, 1)}
    for rank, chan in clients.items():
        p.swaps.request_migration(rank, None, "migrate")
        p.swaps.clients[rank] = [chan]  # type: ignore[list-item]
    p.swaps.tick()  # rank 0's starts, rank 1's waits
    p.swaps.finish()
    assert p.swaps.active is None and not p.swaps.queue
    assert [c.sent[0]["error"] for c in clients.values()] == ["the job finished first"] * 2


def test_the_record_keeps_the_queue_and_a_restarted_swaps_takes_it_back(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=2, nodes=3)
    p.swaps.request_migration(0, None, "migrate")
    p.swaps.request_migration(1, "2", "drain")
    p.swaps.tick()
    rec = p.swaps.record()
    assert rec["migrate_queue"] == [[1, "2", "drain"]]
    assert rec["migration"] == {"rank": 0, "joiners": [2], "told": [], "phase": "prepare", "swapped": False}
    q = Parts(tmp_path / "again", world=2, nodes=3)
    q.swaps.requeue(rec, 5.0)
    assert q.swaps.queue == [(1, "2", "drain", 5.0)] and q.swaps.active is None


# -- Swaps: a grow ------------------------------------------------------------------------------------
def test_a_shrunk_job_grows_with_the_idle_spares_the_sizes_choose(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=1, full=2)
    p.swaps.tick()
    z = p.swaps.grow
    assert z is not None and z.new_world_size == 2 and z.fetch_boundary
    assert p.resize.asked == [({p.spares[0]: "1"}, 2)]
    assert p.view.workers[p.spares[0]].role is Role.JOINER and Busy.GROWING in p.swaps.busy()
    assert p.agent("1").last("fetch")["as_rank"] == 1
    assert p.events_named("grow_start")


def test_a_full_size_job_does_not_grow(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=1, full=1)
    p.swaps.tick()
    assert p.swaps.active is None and p.resize.asked == []


# -- SwapActions ----------------------------------------------------------------------------------------
def _migration(p: Parts, *, told: bool = False) -> BoundarySwap:
    return BoundarySwap(
        kind=SwapKind.MIGRATION,
        joiners=[Joiner(sid=p.spares[0], rank=0, node="1", told=told, boundary_req=901)],
        world_size=1,
        new_world_size=1,
        source_rank=0,
        source_node="0",
        prepare_step=3,
        started=0.0,
        leaver_sid=p.members[0],
    )


def test_pause_and_continue_go_to_every_member(tmp_path: Path) -> None:
    p = Parts(tmp_path, world=2)
    a = _migration(p)
    p.actions.do(a, Pause(at=12))
    p.actions.do(a, Continue())
    for sid in p.members:
        assert p.chan(sid).sent == [{"t": "pause", "at": 12}, {"t": "continue"}]


def test_a_retired_joiner_is_killed_and_replaced_by_a_fresh_spare(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    a = _migration(p, told=True)
    p.actions.do(a, Retire(sid=p.spares[0], respawn=True))
    assert p.view.workers[p.spares[0]].role is Role.RETIRED
    kill, spawn = p.agent("1").sent
    assert (kill["t"], kill["spawn_id"], spawn["t"], spawn["role"]) == ("kill", p.spares[0], "spawn", "spare")


def test_the_swap_opens_a_generation_with_the_joiner_in_the_leavers_rank(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    a = _migration(p, told=True)
    leaver, joiner = p.members[0], p.spares[0]
    now = SwapNow(
        step=10,
        world_size=1,
        ranks={0: (joiner, "1")},
        source_rank=0,
        source="0",
        leaver=leaver,
        base=None,
        fresh=False,
    )
    p.actions.do(a, now)
    assert p.view.workers[leaver].role is Role.RETIRED and p.agent("0").last("kill")["spawn_id"] == leaver
    assert p.view.members == {0: joiner} and p.view.rank_node == {0: "1"} and a.generation == 1
    assert p.sources.fetches == [(0, 10, "0", 0, 901)]  # the boundary fetch asked early is adopted
    ((r, tier, fetches, extra),) = p.gens.launched
    assert (r.restore_step, r.replacements, tier, fetches, extra) == (
        10,
        {0: "migration"},
        "memory",
        {0: "fetch-0"},
        {"migration": 0},
    )


def test_an_ended_swap_forgets_its_fetches_and_drops_its_early_boundary(tmp_path: Path) -> None:
    p = Parts(tmp_path)
    p.swaps.request_migration(0, "1", "migrate")
    p.swaps.tick()
    a = p.swaps.active
    assert a is not None
    a.joiners[0].boundary_req = 905
    req = p.agent("1").last("fetch")["id"]
    p.actions.forget(a, ok=False)
    assert not p.actions.owns(req) and req not in p.io.pending and p.sources.dropped == [905]
