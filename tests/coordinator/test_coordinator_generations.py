"""The generations built alone: the planner (:class:`~nonstop.coordinator.generations.Generations`)
and the setup it hands a planned generation to
(:class:`~nonstop.coordinator.generation_setup.GenerationSetup`), each from a real view, a real
executor over fake channels, an event log in a temp dir, and fakes of only the peers it calls.
What is asserted is what each sends, what it logs, and what it asks its peers."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nonstop.config import DetectorConfig
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.detector import FailureDetector
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.generation_setup import GenerationSetup
from nonstop.coordinator.generations import Generations
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.plan_asks import PlanAsks
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog
from nonstop.policy.elastic import ElasticPolicy
from nonstop.policy.phase import Busy, JobPhase
from nonstop.policy.planning import Inventory, Shrink
from nonstop.policy.reconfiguration import (
    Failure,
    Joined,
    Launched,
    Reconfiguration,
    RecoveryEvent,
    Restored,
    Stage,
    Stepped,
    Tick,
)
from nonstop.policy.survivors import SurvivorChoice
from nonstop.protocol.wire import Inventory as InventoryReply
from tests.coord_fakes import FakeChannel, FakeClock, add_member, agent_chan, logged, worker_chan


# -- the parts both are built from ------------------------------------------------------------------
def _job(tmp_path: Path, *, world: int = 2, nodes: int = 2) -> tuple[JobView, Executor, EventLog, JobLife]:
    view = JobView(job_id="j", world_size=world)
    for i in range(nodes):
        chan: Any = FakeChannel({"role": "agent", "node": str(i)}, peer=f"agent-{i}")
        view.nodes[str(i)] = NodeRecord(
            name=str(i), chan=chan, nproc=1, spares=1, domain=str(i), data_addr=f"addr-{i}", last_lease=0.0
        )
    events = EventLog(tmp_path / "events.jsonl")
    io = Executor(view, events)
    return view, io, events, JobLife(view=view, events=events, io=io, replicating=False)


def _worker(view: JobView, node: str, role: Role, rank: int | None) -> FakeChannel:
    w = add_member(view, node, role, rank)
    w.chan = FakeChannel({"role": str(role)}, peer=f"worker-{w.spawn_id}")  # type: ignore[assignment]
    return worker_chan(view, w.spawn_id)


def _events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    return logged(tmp_path / "events.jsonl", kind)


def _failure(rank: int, sid: int) -> Failure:
    return Failure(kind="crash", rank=rank, spawn_id=sid, detail="killed", detected_at=time.time(), step=3)


# -- GenerationSetup ---------------------------------------------------------------------------------
class FakeShards:
    def shards_of(self, rank: int, world_size: int | None = None) -> dict[str, Any]:
        return {"shards": [rank]}

    def reshard_for(self, reshard: dict[str, Any], rank: int) -> dict[str, Any]:
        return {**reshard, "for": rank}


class FakeSwapsDone:
    def __init__(self) -> None:
        self.done: list[int] = []

    def on_generation_done(self, generation: int) -> None:
        self.done.append(generation)


class FakeSpares:
    def __init__(self) -> None:
        self.replenished = 0

    def replenish_spares(self) -> None:
        self.replenished += 1


def _setup(
    tmp_path: Path, *, timeout_s: float = 0.0, clock: Clock = SYSTEM_CLOCK
) -> tuple[GenerationSetup, JobView, FakeSwapsDone, FakeSpares, list[FakeChannel]]:
    view, io, events, life = _job(tmp_path)
    chans = [_worker(view, str(rank), Role.WORKER, rank) for rank in range(2)]
    view.generation, view.phase = 1, JobPhase.RECONFIGURING
    swaps, spares = FakeSwapsDone(), FakeSpares()
    setup = GenerationSetup(
        view=view,
        io=io,
        events=events,
        life=life,
        detector=FailureDetector(DetectorConfig()),
        rebuild_timeout_s=timeout_s,
        shards=FakeShards(),
        swaps=swaps,
        spares=spares,
        clock=clock,
    )
    return setup, view, swaps, spares, chans


def _planned(view: JobView, failures: Sequence[Failure] = ()) -> Reconfiguration:
    r = Reconfiguration(generation=view.generation, world_size=view.world_size, failures=list(failures))
    r.restore_step = 4
    r.marks["detect"] = r.marks["plan"] = time.time()
    return r


def _everyone(setup: GenerationSetup, kind: Callable[[int, float], RecoveryEvent]) -> None:
    for rank in range(2):
        setup.report(kind(rank, time.time()))


def test_a_launched_generation_is_logged_and_each_connected_member_told(tmp_path: Path) -> None:
    setup, view, _, _, chans = _setup(tmp_path)
    view.workers[view.members[1]].chan = None  # rank 1's process is still starting
    r = _planned(view)
    r.from_rank, r.fresh = {0: 1}, {0}
    setup.launch(r, tier="memory", fetches={1: "0:local"}, migration=0)
    [gen] = _events(tmp_path, "generation")
    assert gen["generation"] == 1 and gen["tier"] == "memory" and gen["fetches"] == {"1": "0:local"}
    assert gen["migration"] == 0 and gen["members"] == {"0": view.members[0], "1": view.members[1]}
    [msg] = chans[0].sent
    assert msg["t"] == "reconfigure" and msg["gen"] == 1 and msg["rank"] == 0 and msg["restore_step"] == 4
    assert msg["shards"] == [0] and msg["from_rank"] == 1 and msg["fresh"] is True and "lost" not in msg
    assert r.waiting_launch == {1} and setup.reconf is r and setup.busy() == {Busy.RESUMING}
    setup.report(Launched(1, time.time()))  # its process connected: it is told too (on its channel)
    assert 1 in r.told


def test_a_generation_set_up_resumes_training_and_reports_each_failure(tmp_path: Path) -> None:
    setup, view, swaps, spares, chans = _setup(tmp_path)
    r = _planned(view, [_failure(1, 7)])
    setup.launch(r, tier="memory", fetches={})
    assert chans[1].last("reconfigure")["lost"] == [1]
    _everyone(setup, Restored)
    assert [m["t"] for m in chans[0].sent] == ["reconfigure", "rebuild"]
    assert setup.rebuilding() == {0, 1} and not setup.in_training()
    _everyone(setup, Joined)
    assert view.phase is JobPhase.RUNNING and setup.in_training()
    _everyone(setup, Stepped)
    assert setup.reconf is None and setup.busy() == set()
    assert swaps.done == [1] and spares.replenished == 1
    [rec] = _events(tmp_path, "recovery")
    assert rec["rank"] == 1 and rec["generation"] == 1 and rec["restore_step"] == 4
    [report] = view.reports
    assert report["rank"] == 1 and report["survivor_gap_steps"] is None  # no median step yet
    assert [e["stage"] for e in _events(tmp_path, "stage")] == ["launch", "restore", "rebuild", "resume"]


def test_a_stage_that_overruns_has_its_laggards_killed(tmp_path: Path) -> None:
    setup, view, _, _, _ = _setup(tmp_path, timeout_s=5.0)
    r = _planned(view)
    setup.launch(r, tier="memory", fetches={})
    setup.report(Restored(0, time.time()))
    setup.check_timeouts()  # the stage's deadline is set on the first tick
    setup.report(Tick(time.time() + 6.0))
    [kill] = [m for m in agent_chan(view, "1").sent if m["t"] == "kill"]
    assert kill["spawn_id"] == view.members[1]
    assert view.workers[view.members[1]].killed_for_hang == "stage restore timed out"
    assert [m["t"] for m in agent_chan(view, "0").sent] == []


def test_a_stage_times_out_on_the_setups_clock_with_no_sleep(tmp_path: Path) -> None:
    clock = FakeClock()
    setup, view, _, _, _ = _setup(tmp_path, timeout_s=5.0, clock=clock)
    setup.launch(_planned(view), tier="memory", fetches={})
    setup.report(Restored(0, clock.wall()))
    setup.check_timeouts()  # the stage's deadline is set on the first tick
    clock.advance(4.0)
    setup.check_timeouts()  # within the timeout: nobody is killed
    assert [m for m in agent_chan(view, "1").sent if m["t"] == "kill"] == []
    clock.advance(2.0)
    setup.check_timeouts()
    [kill] = [m for m in agent_chan(view, "1").sent if m["t"] == "kill"]
    assert kill["spawn_id"] == view.members[1]
    assert view.workers[view.members[1]].killed_for_hang == "stage restore timed out"


def test_an_abandoned_generation_hears_nothing_more(tmp_path: Path) -> None:
    setup, view, swaps, _, chans = _setup(tmp_path)
    r = _planned(view)
    setup.launch(r, tier="memory", fetches={})
    setup.abandon()
    _everyone(setup, Restored)
    assert r.stage is Stage.RESTORE and "rebuild" not in chans[0].kinds() and swaps.done == []
    assert setup.busy() == set() and setup.rebuilding() == set()


def test_the_job_finishes_when_every_rank_had_its_last_step_by_the_time_it_is_set_up(tmp_path: Path) -> None:
    setup, view, _, _, chans = _setup(tmp_path)
    setup.launch(_planned(view), tier="memory", fetches={})
    view.done_ranks.update({0, 1})
    for kind in (Restored, Joined, Stepped):
        _everyone(setup, kind)
    assert view.phase is JobPhase.FINISHING and chans[0].kinds()[-1] == "finish"


# -- Generations (the planner) -----------------------------------------------------------------------
class FakeLauncher:
    """The setup as the planner sees it: what it was handed, and the fencing."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.reconf: Reconfiguration | None = None
        self.launched: list[tuple[Reconfiguration, str, dict[int, str], dict[str, Any]]] = []

    def abandon(self) -> None:
        self.log.append("abandon")
        self.reconf = None

    def launch(self, r: Reconfiguration, *, tier: str, fetches: dict[int, str], **extra: Any) -> None:
        self.reconf = r
        self.launched.append((r, tier, fetches, extra))

    def report(self, event: RecoveryEvent) -> None:
        self.log.append(f"report {type(event).__name__}")

    def in_training(self) -> bool:
        return self.reconf is None

    def rebuilding(self) -> set[int]:
        return set()


class FakeRestorePlans:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.durable: list[Callable[[int | None], None]] = []
        self.fetched: list[tuple[int, int]] = []

    def new_generation(self, generation: int) -> None:
        self.log.append(f"sources {generation}")

    def restore_from_durable(self, done: Callable[[int | None], None]) -> None:
        self.durable.append(done)

    def plan_fetches(self, r: Reconfiguration, step: int, avail: Inventory) -> dict[int, str]:
        self.fetched.append((r.generation, step))
        return {}

    def plan_reshard(
        self, r: Reconfiguration, step: int, avail: Inventory, old_world: int
    ) -> dict[str, dict[int, str]]:
        return {}


class FakeResizePlans:
    reshards = False

    def survivor_choice(self, missing: Sequence[int]) -> SurvivorChoice:
        return SurvivorChoice(shrink_first=False, reason="replace")

    def shrink(self, shrink: Shrink, why: str, *, shrink_first: bool = False) -> dict[int, int]:
        raise AssertionError("no shrink expected")

    def reshard_source(self, step: int | None, old_world: int) -> dict[str, Any] | None:
        return None


class Planner:
    """A planner over a two-rank job on two nodes (a spare on each), with its fakes."""

    def __init__(self, tmp_path: Path, *, spares: bool = True, waiting: bool = False) -> None:
        self.tmp_path = tmp_path
        self.view, self.io, events, self.life = _job(tmp_path)
        self.chans = [_worker(self.view, str(rank), Role.WORKER, rank) for rank in range(2)]
        self.spares = [_worker(self.view, str(n), Role.SPARE, None) for n in range(2)] if spares else []
        self.view.phase = JobPhase.RUNNING
        self.log: list[str] = []
        self.setup = FakeLauncher(self.log)
        self.sources = FakeRestorePlans(self.log)
        self.waiting = waiting
        self.gens = Generations(
            view=self.view,
            io=self.io,
            events=events,
            life=self.life,
            asks=PlanAsks(view=self.view, io=self.io, rescue_wait_s=0.0, mesh=None, rescues=lambda: False),
            setup=self.setup,
            sources=self.sources,
            sizes=FakeResizePlans(),
            elastic=ElasticPolicy(full_world_size=2, min_world_size=2, wait_s=0.0),
            durable_url="file:///ckpt",
            initial_step=None,
            exits_waiting=lambda sids: self.waiting,
            fences=[lambda g: self.log.append(f"fence {g}")],
        )

    def lose_rank(self, rank: int) -> Failure:
        sid = self.view.members.pop(rank)
        self.view.workers.pop(sid)
        return _failure(rank, sid)

    def answer_inventories(self, held: dict[int, tuple[int, ...]]) -> None:
        for node in ("0", "1"):
            ask = agent_chan(self.view, node).last("inventory")
            local = {r: st for r, st in held.items() if self.view.rank_node.get(r) == node}
            self.io.replies[ask["id"]] = InventoryReply(id=ask["id"], local=local, replicas={})
        self.gens.inventory_tick()


def test_a_first_generation_is_opened_fenced_and_launched_at_once(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.view.phase = JobPhase.STARTING
    p.gens.begin([])
    assert p.view.generation == 1 and p.log == ["abandon", "sources 1", "fence 1"]
    [(r, tier, fetches, _)] = p.setup.launched
    assert r.generation == 1 and r.restore_step is None and tier == "memory" and fetches == {}
    assert agent_chan(p.view, "0").kinds() == []  # nothing to ask: no restore


def test_a_failure_asks_the_nodes_then_a_spare_takes_the_rank_at_the_step_all_hold(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    spare = p.view.idle_spares()
    failure = p.lose_rank(1)
    p.gens.recover([failure])
    assert p.view.phase is JobPhase.RECONFIGURING and p.setup.launched == []  # waits for answers
    assert [agent_chan(p.view, n).kinds() for n in ("0", "1")] == [["inventory"], ["inventory"]]
    p.answer_inventories({0: (2, 4), 1: (2, 4)})
    [(r, tier, _, _)] = p.setup.launched
    assert r.restore_step == 4 and tier == "memory" and r.failures == [failure]
    assert p.view.members[1] in spare and p.view.workers[p.view.members[1]].role is Role.WORKER
    assert p.sources.fetched == [(1, 4)] and p.gens.pending is None


def test_a_failure_while_the_nodes_answer_is_planned_with_the_first(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    first, second = p.lose_rank(1), p.lose_rank(0)
    p.gens.recover([first])
    p.gens.recover([second])
    assert p.view.generation == 2 and p.gens.pending is not None
    assert p.gens.pending.failures == [first, second] and p.gens.pending.replans == 1


def test_a_failure_during_a_setup_replans_it_keeping_what_it_did(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.view.phase = JobPhase.RECONFIGURING
    first = _failure(1, 9)
    p.setup.reconf = Reconfiguration(
        generation=1, world_size=2, failures=[first], replans=2, replacements={1: "spare"}
    )
    p.gens.recover([p.lose_rank(0)])
    assert p.gens.pending is not None and p.gens.pending.replans == 3
    assert p.gens.pending.failures[0] is first and p.gens.pending.replacements == {1: "spare"}


def test_a_plan_waits_while_exits_of_the_members_are_not_handled_yet(tmp_path: Path) -> None:
    p = Planner(tmp_path, waiting=True)
    p.gens.recover([p.lose_rank(1)])
    p.answer_inventories({0: (4,), 1: (4,)})
    p.gens.inventory_tick()
    assert p.setup.launched == [] and len(_events(tmp_path, "replan_deferred")) == 1
    p.waiting = False
    p.gens.inventory_tick()
    assert len(p.setup.launched) == 1


def test_without_a_spare_a_cold_process_is_started_for_the_rank(tmp_path: Path) -> None:
    p = Planner(tmp_path, spares=False)
    p.gens.recover([p.lose_rank(1)])
    p.answer_inventories({0: (4,), 1: (4,)})
    [spawn] = [m for m in agent_chan(p.view, "1").sent if m["t"] == "spawn"]
    [(r, _, _, _)] = p.setup.launched
    assert spawn["rank"] == 1 and r.waiting_launch == {1} and r.replacements == {1: "cold"}
    assert p.view.members[1] == spawn["spawn_id"]


def test_a_plan_with_no_node_left_to_run_on_fails_the_job(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.gens.recover([p.lose_rank(1)])
    for node in p.view.nodes.values():
        node.quarantined = True  # (they answered)
    p.answer_inventories({0: (4,), 1: (4,)})
    assert p.view.phase is JobPhase.FAILED and p.setup.launched == [] and p.gens.pending is None
    assert "every node is lost" in str(p.life.error)


def test_a_step_no_memory_holds_is_installed_from_the_durable_tier(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.gens.recover([p.lose_rank(1)])
    p.answer_inventories({0: (4,)})  # rank 1's memory is gone with its process's node
    [installed] = p.sources.durable
    assert p.gens.pending is not None and p.gens.pending.installing
    installed(2)
    [(r, tier, _, _)] = p.setup.launched
    assert tier == "durable" and r.restore_step == 2 and p.gens.pending is None


def test_no_durable_step_fails_the_job_naming_the_tier(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.gens.recover([p.lose_rank(1)])
    p.answer_inventories({0: (4,)})
    p.sources.durable[0](None)
    assert p.view.phase is JobPhase.FAILED and "file:///ckpt" in str(p.life.error)


def test_a_boundary_generation_keeps_the_live_state_of_the_paused_ranks(tmp_path: Path) -> None:
    p = Planner(tmp_path)
    p.view.latest_step.update({0: 6, 1: 6})
    p.gens.open_generation()
    r = p.gens.boundary_generation(6, {1: "migration"}, fresh={1})
    assert r.live and r.generation == 1 and r.restore_step == 6 and r.failures == []
    assert r.replacements == {1: "migration"} and r.fresh == {1} and p.setup.launched == []
