"""The restore sources (:mod:`nonstop.coordinator.restore_sources`) built alone: a real view, a
real executor over fake agent channels, an event log in a temp dir, and fakes of the generation
being set up, the job's size and the durable tier. What is asserted is what the operation sends
to the nodes, what it logs, and what it reports to the generation it serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nonstop.coordinator.executor import Executor
from nonstop.coordinator.job import JobLife
from nonstop.coordinator.restore_sources import RestoreSources
from nonstop.coordinator.view import JobView, NodeRecord
from nonstop.errors import NonstopError
from nonstop.events.log import EventLog
from nonstop.policy.phase import JobPhase
from nonstop.policy.reconfiguration import FetchDone, Reconfiguration, RecoveryEvent
from nonstop.protocol.agent import FetchedBytes
from nonstop.protocol.wire import Fetched, Installed
from tests.coord_fakes import FakeChannel, FakeClock, agent_chan, logged


class FakeSetup:
    """The generation being set up: which one, and what it was told."""

    def __init__(self, r: Reconfiguration | None) -> None:
        self.reconf = r
        self.reports: list[RecoveryEvent] = []

    def report(self, ev: RecoveryEvent) -> None:
        self.reports.append(ev)


class FakeNeeds:
    def __init__(self, needed: dict[str, set[int]]) -> None:
        self.needed = needed

    def needed_on(self, node: str, old_world: int) -> set[int]:
        return self.needed.get(node, set(range(old_world)))


class FakeDurable:
    """A durable tier: its committed steps and the world size each was written at."""

    def __init__(self, worlds: dict[int, int], *, broken: bool = False) -> None:
        self.worlds = worlds
        self.broken = broken
        self.opened: list[str] = []

    def __call__(self, url: str) -> FakeDurable:
        self.opened.append(url)
        if self.broken:
            raise NonstopError("the tier is unreachable")
        return self

    def steps(self) -> list[int]:
        return sorted(self.worlds)

    def latest_step(self) -> int | None:
        return max(self.worlds, default=None)

    def world_size_at(self, step: int) -> int:
        return self.worlds[step]


def _sources(
    tmp_path: Path,
    *,
    nodes: int = 2,
    world: int = 2,
    durable: FakeDurable | None = None,
    elastic: bool = False,
    reconf: Reconfiguration | None = None,
    needed: dict[str, set[int]] | None = None,
    clock: FakeClock | None = None,
) -> tuple[RestoreSources, JobView, FakeSetup]:
    view = JobView(job_id="j", world_size=world)
    view.phase = JobPhase.RECONFIGURING
    for i in range(nodes):
        chan: Any = FakeChannel({"role": "agent", "node": str(i)}, peer=f"agent-{i}")
        view.nodes[str(i)] = NodeRecord(
            name=str(i),
            chan=chan,
            nproc=world,
            spares=0,
            domain=str(i),
            data_addr=f"addr-{i}",
            last_lease=0.0,
        )
    for rank in range(world):
        view.rank_node[rank] = str(rank % nodes)
    events = EventLog(tmp_path / "events.jsonl")
    io = Executor(view, events)
    life = JobLife(view=view, events=events, io=io, replicating=False)
    sources = RestoreSources(
        view=view,
        io=io,
        events=events,
        life=life,
        durable_url="file:///ckpt" if durable is not None else None,
        elastic=elastic,
        install_timeout_s=30.0,
        **({"durable": durable} if durable is not None else {}),
        **({"clock": clock} if clock is not None else {}),
    )
    setup = FakeSetup(reconf)
    sources.bind(setup=setup, needs=FakeNeeds(needed or {}))
    return sources, view, setup


def _gen(generation: int = 1, world: int = 2) -> Reconfiguration:
    return Reconfiguration(generation=generation, world_size=world, failures=[], restore_step=5)


def _fetched(req: int, *, ok: bool = True, error: str | None = None) -> Fetched:
    moved = FetchedBytes(raw_bytes=10, wire_bytes=10, delta=False, capped=False)
    return Fetched(id=req, ok=ok, error=error, seconds=0.1, moved=moved)


def _events(tmp_path: Path, kind: str) -> list[dict[str, object]]:
    return logged(tmp_path / "events.jsonl", kind)


def test_a_rank_whose_node_lacks_its_step_fetches_it_from_the_holder(tmp_path: Path) -> None:
    r = _gen()
    sources, view, _ = _sources(tmp_path, reconf=r)
    # rank 0 is on node 0, which holds its step; rank 1's node 1 does not: node 0 holds a replica
    avail = {0: {5: [("0", "local")]}, 1: {5: [("0", "replica")]}}
    fetches = sources.plan_fetches(r, 5, avail)
    assert fetches == {1: "0:replica"}
    [msg] = [m for m in agent_chan(view, "1").sent if m["t"] == "fetch"]
    assert msg["rank"] == 1 and msg["step"] == 5 and msg["addr"] == "addr-0" and msg["kind"] == "replica"
    assert agent_chan(view, "0").sent == []
    assert r.waiting_fetch == {1} and sources.waiting_fetch == {msg["id"]: (1, 1)}


def test_a_finished_fetch_is_logged_and_reported_to_the_generation_waiting(tmp_path: Path) -> None:
    r = _gen()
    sources, view, setup = _sources(tmp_path, reconf=r)
    sources.fetch_for(r, 1, 5, "0", "local")
    [req] = sources.waiting_fetch
    sources.on_fetched(view.nodes["1"], _fetched(req))
    [done] = setup.reports
    assert isinstance(done, FetchDone) and done.rank == 1
    [logged] = _events(tmp_path, "fetched")
    assert logged["node"] == "1" and logged["rank"] == 1 and logged["ok"] is True
    assert sources.waiting_fetch == {} and req not in sources.io.pending


def test_a_failed_fetch_fails_the_job(tmp_path: Path) -> None:
    r = _gen()
    sources, view, setup = _sources(tmp_path, reconf=r)
    sources.fetch_for(r, 1, 5, "0", "local")
    [req] = sources.waiting_fetch
    sources.on_fetched(view.nodes["1"], _fetched(req, ok=False, error="gone"))
    assert setup.reports == [] and view.phase is JobPhase.FAILED
    assert "rank 1 could not be fetched to node 1: gone" in str(sources.life.error)


def test_a_fetch_of_an_older_generation_is_only_logged(tmp_path: Path) -> None:
    sources, view, setup = _sources(tmp_path, reconf=_gen(1))
    sources.fetch_for(_gen(1), 1, 5, "0", "local")
    [req] = sources.waiting_fetch
    setup.reconf = _gen(2)  # a newer generation opened meanwhile
    sources.on_fetched(view.nodes["1"], _fetched(req, ok=False, error="late"))
    assert setup.reports == [] and view.phase is JobPhase.RECONFIGURING
    assert len(_events(tmp_path, "fetched")) == 1


def test_a_new_generation_forgets_the_older_fetches_and_the_install(tmp_path: Path) -> None:
    durable = FakeDurable({4: 2})
    sources, _, _ = _sources(tmp_path, reconf=_gen(1), durable=durable)
    sources.fetch_for(_gen(1), 1, 5, "0", "local")
    sources.restore_from_durable(lambda step: None)
    assert sources.installing is not None and sources.io.pending
    sources.new_generation(2)
    assert sources.waiting_fetch == {} and sources.installing is None and sources.io.pending == {}


def test_an_early_boundary_fetch_done_before_its_generation_is_adopted_without_asking_again(
    tmp_path: Path,
) -> None:
    sources, view, _ = _sources(tmp_path)
    req = sources.fetch_early("1", 0, 5, "0", as_rank=1)
    sources.on_fetched(view.nodes["1"], _fetched(req))
    [logged] = _events(tmp_path, "fetched")
    assert logged["early"] is True and logged["rank"] == 1
    r = _gen(2)
    assert sources.fetch_for(r, 1, 5, "0", "local", early=req) == "0:local"
    assert r.waiting_fetch == set()  # nothing to wait for
    assert [m["t"] for m in agent_chan(view, "1").sent] == ["fetch"]  # asked once


def test_an_early_fetch_that_failed_is_asked_again_and_one_in_flight_is_waited_for(tmp_path: Path) -> None:
    sources, view, _ = _sources(tmp_path)
    failed = sources.fetch_early("1", 0, 5, "0", as_rank=1)
    sources.on_fetched(view.nodes["1"], _fetched(failed, ok=False, error="x"))
    r = _gen(2)
    sources.fetch_for(r, 1, 5, "0", "local", early=failed)
    assert [m["t"] for m in agent_chan(view, "1").sent] == ["fetch", "fetch"] and r.waiting_fetch == {1}
    in_flight = sources.fetch_early("0", 1, 5, "1", as_rank=0)
    sources.fetch_for(r, 0, 5, "1", "local", early=in_flight)
    assert sources.waiting_fetch[in_flight] == (0, 2) and r.waiting_fetch == {0, 1}


def test_a_reshard_fetches_what_a_node_lacks_into_its_replica_slots_and_waits_for_all(tmp_path: Path) -> None:
    r = _gen(world=2)
    sources, view, setup = _sources(tmp_path, reconf=r, needed={"0": {0, 1}, "1": {1}})
    held = {0: {5: [("0", "local")]}, 1: {5: [("1", "local")]}}
    where = sources.plan_reshard(r, 5, held, 2)
    assert where == {"0": {0: "local", 1: "replica"}, "1": {1: "local"}}
    [msg] = agent_chan(view, "0").sent
    assert msg["t"] == "fetch" and msg["rank"] == 1 and msg["into"] == "replica" and msg["addr"] == "addr-1"
    assert r.waiting_fetch == {0}  # node 0's ranks wait for its fetches
    sources.on_fetched(view.nodes["0"], _fetched(msg["id"]))
    assert setup.reports == [FetchDone(0, setup.reports[0].t)]


def test_the_newest_checkpoint_that_installs_everywhere_is_the_one_restored(tmp_path: Path) -> None:
    durable = FakeDurable({2: 2, 4: 2})
    sources, view, _ = _sources(tmp_path, durable=durable)
    done: list[int | None] = []
    sources.restore_from_durable(done.append)
    asks = {n: agent_chan(view, n).last("install_durable") for n in ("0", "1")}
    assert {n: (m["step"], m["ranks"]) for n, m in asks.items()} == {"0": (4, [0]), "1": (4, [1])}
    sources.io.replies[asks["0"]["id"]] = Installed(id=asks["0"]["id"], ok=True, error=None)
    sources.io.replies[asks["1"]["id"]] = Installed(id=asks["1"]["id"], ok=False, error="corrupt")
    sources.install_tick()  # step 4 failed on node 1: the older one is asked for
    assert [e["step"] for e in _events(tmp_path, "durable_install_failed")] == [4] and done == []
    for n in ("0", "1"):
        m = agent_chan(view, n).last("install_durable")
        assert m["step"] == 2
        sources.io.replies[m["id"]] = Installed(id=m["id"], ok=True, error=None)
    sources.install_tick()
    assert done == [2] and sources.installing is None
    [restored] = _events(tmp_path, "restore_from_durable")
    assert restored["step"] == 2 and restored["url"] == "file:///ckpt"


def test_a_checkpoint_of_another_size_serves_only_an_elastic_job(tmp_path: Path) -> None:
    durable = FakeDurable({4: 1})
    (tmp_path / "rigid").mkdir()
    rigid, view, _ = _sources(tmp_path / "rigid", durable=durable)
    done: list[int | None] = []
    rigid.restore_from_durable(done.append)
    assert done == [None] and "1 ranks, the job 2" in str(
        _events(tmp_path / "rigid", "durable_install_failed")
    )
    elastic, view, _ = _sources(tmp_path, durable=durable, elastic=True)
    elastic.restore_from_durable(done.append)
    m = agent_chan(view, "1").last("install_durable")
    assert m["step"] == 4 and m["from"] == {"1": 0}  # rank 1 loads the only rank written


def test_no_durable_tier_or_an_unreachable_one_restores_nothing(tmp_path: Path) -> None:
    none, _, _ = _sources(tmp_path)
    done: list[int | None] = []
    none.restore_from_durable(done.append)
    assert done == [None] and none.newest_durable() is None
    broken, _, _ = _sources(tmp_path, durable=FakeDurable({}, broken=True))
    broken.restore_from_durable(done.append)
    assert done == [None, None] and broken.newest_durable() is None
    assert len(_events(tmp_path, "durable_unavailable")) == 2
    ok, _, _ = _sources(tmp_path, durable=FakeDurable({3: 2, 6: 4}))
    assert ok.newest_durable() == (6, 4)


def test_an_install_a_node_never_answers_times_out_on_the_clock_it_was_given(tmp_path: Path) -> None:
    """Issue 46, the clock comes in: the install's deadline is read on the operation's clock, so
    a fake one drives it past ``install_timeout_s`` (30 s here) without a sleep."""
    clock = FakeClock()
    durable = FakeDurable({2: 2, 4: 2})
    sources, view, _ = _sources(tmp_path, durable=durable, clock=clock)
    done: list[int | None] = []
    sources.restore_from_durable(done.append)
    asks = {n: agent_chan(view, n).last("install_durable") for n in ("0", "1")}
    assert {m["step"] for m in asks.values()} == {4}
    sources.io.replies[asks["0"]["id"]] = Installed(id=asks["0"]["id"], ok=True, error=None)  # node 1: silent
    clock.advance(29.9)
    sources.install_tick()  # within the timeout: still waiting
    assert (
        _events(tmp_path, "durable_install_failed") == []
        and agent_chan(view, "1").last("install_durable") == asks["1"]
    )
    clock.advance(0.2)
    sources.install_tick()  # past it: step 4 timed out, the older one is asked for
    [failed] = _events(tmp_path, "durable_install_failed")
    assert failed["step"] == 4 and failed["errors"] == ["timed out"]
    for n in ("0", "1"):
        m = agent_chan(view, n).last("install_durable")
        assert m["step"] == 2
        sources.io.replies[m["id"]] = Installed(id=m["id"], ok=True, error=None)
    clock.advance(5.0)
    sources.install_tick()
    assert done == [2] and sources.installing is None
