"""Fakes that drive a real :class:`~nonstop.coordinator.loop.Coordinator` tick by tick with no
process, socket or thread: the control server is a queue the test fills, every peer (agent,
worker, client) is a :class:`FakeChannel` that records what the coordinator sent it."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

from nonstop.config import job_config_from_flat
from nonstop.control.jobstore import JobStore
from nonstop.coordinator.loop import Coordinator
from nonstop.coordinator.view import JobView, Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.events.log import EventLog, read_events

Message = dict[str, Any]


class FakeChannel:
    """One peer's end of a control channel, as the coordinator sees it."""

    def __init__(self, hello: Message, peer: str = "fake", on_send: Any = None) -> None:
        self.hello = hello
        self.peer = peer
        self.tag: Any = None
        self.closed = False
        self.sent: list[Message] = []
        self.on_send = on_send  # called with each message sent (an agent's automatic answers)

    def send(self, msg: Message) -> None:
        if self.closed:
            raise ControlError("channel closed")
        self.sent.append(msg)
        if self.on_send is not None:
            self.on_send(self, msg)

    def close(self) -> None:
        self.closed = True

    def kinds(self) -> list[str]:
        return [str(m.get("t")) for m in self.sent]

    def last(self, kind: str) -> Message:
        return next(m for m in reversed(self.sent) if m.get("t") == kind)


def logged(path: Path, kind: str) -> list[dict[str, Any]]:
    """The events of ``kind`` in the event log at ``path``, in order."""
    return [e for e in read_events(path) if e["event"] == kind]


def add_member(view: JobView, node: str, role: Role, rank: int | None) -> WorkerRecord:
    """A process on ``node`` in ``view``; one with a rank is that rank's member."""
    w = view.add_worker(node, role, rank, 0.0)
    if rank is not None:
        view.members[rank] = w.spawn_id
        view.rank_node[rank] = node
    return w


def agent_chan(view: JobView, node: str) -> FakeChannel:
    """The fake channel of ``node``'s agent in ``view``."""
    chan = view.nodes[node].chan
    assert isinstance(chan, FakeChannel)
    return chan


def worker_chan(view: JobView, sid: int) -> FakeChannel:
    """The fake channel of process ``sid`` in ``view``."""
    chan = view.workers[sid].chan
    assert isinstance(chan, FakeChannel)
    return chan


class FakeClock:
    """A :class:`~nonstop.coordinator.clock.Clock` a test moves by hand (:meth:`advance`)."""

    def __init__(self, monotonic: float = 1000.0, wall: float = 1.7e9) -> None:
        self.now = monotonic
        self.unix = wall

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.unix

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.unix += seconds


class FakeServer:
    """What the coordinator uses of a ``ControlServer``: its event queue and address."""

    def __init__(self) -> None:
        self.events: queue.Queue[tuple[str, Any, Message | None]] = queue.Queue()
        self.address = ("127.0.0.1", 0)


class Harness:
    """A coordinator, its fake peers, and helpers to play the agents' and workers' parts."""

    def __init__(self, job_dir: Path, *, jobs: JobStore | None = None, **cfg: Any) -> None:
        cfg.setdefault("script", "train.py")
        job_dir.mkdir(parents=True, exist_ok=True)
        self.config = job_config_from_flat({"job_dir": job_dir, **cfg})
        self.server = FakeServer()
        self.log = EventLog(job_dir / "events.jsonl")
        self.coord = Coordinator(
            config=self.config,
            server=self.server,
            events=self.log,
            job_id="fakejob",
            worker_env={},
            jobs=jobs,
        )
        self.agents: dict[str, FakeChannel] = {}
        self.workers: dict[int, FakeChannel] = {}  # spawn id -> its channel
        self._spawned: set[int] = set()
        self.held: dict[str, dict[int, set[int]]] = {}  # node -> rank -> steps in its memory
        self.replicas: dict[str, dict[int, set[int]]] = {}  # node -> rank -> replicated steps it holds
        self.fail_fetches = False
        self.bad_durable_steps: set[int] = set()  # agents fail to install these checkpoints
        self.hold_inventories = False  # agents answer inventories only when released
        self.held_replies: list[tuple[FakeChannel, Message]] = []

    # -- the peers' side ------------------------------------------------------------------------
    def put(self, kind: str, chan: FakeChannel, msg: Message | None = None) -> None:
        self.server.events.put((kind, chan, msg))

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.coord.tick(0)

    def reattach_node(self, name: str) -> FakeChannel:
        """Node ``name``'s agent reconnects to a restarted coordinator."""
        old = self.agents[name]
        chan = FakeChannel({**old.hello, "resume": {}}, peer=f"agent-{name}", on_send=self._agent_answers)
        self.agents[name] = chan
        self.put("open", chan)
        self.tick()
        return chan

    def reconnect_worker(self, sid: int, resume: Message) -> FakeChannel:
        """Worker ``sid`` reconnects to a restarted coordinator, saying where it is."""
        old = self.workers[sid]
        chan = FakeChannel({**old.hello, "resume": resume}, peer=f"worker-{sid}")
        self.workers[sid] = chan
        self.put("open", chan)
        self.tick()
        return chan

    def add_node(self, name: str, *, nproc: int = 1, spares: int = 0) -> FakeChannel:
        hello = {
            "role": "agent",
            "node": name,
            "nproc": nproc,
            "spares": spares,
            "data_addr": f"127.0.0.1:{9000 + len(self.agents)}",
        }
        chan = FakeChannel(hello, peer=f"agent-{name}", on_send=self._agent_answers)
        self.agents[name] = chan
        self.put("open", chan)
        self.tick()
        return chan

    def _agent_answers(self, chan: FakeChannel, msg: Message) -> None:
        """An agent answers requests at once: its memory holds its ranks' reported steps (they
        outlive the workers); fetches and installs succeed unless ``fail_fetches``."""
        name = str(chan.hello["node"])
        t = msg.get("t")
        if t == "inventory":
            local = {str(r): sorted(st) for r, st in self.held.get(name, {}).items()}
            reps = {str(r): sorted(st) for r, st in self.replicas.get(name, {}).items()}
            reply = {"t": "inventory", "id": msg["id"], "local": local, "replicas": reps}
            if self.hold_inventories:
                self.held_replies.append((chan, reply))
            else:
                self.put("msg", chan, reply)
        elif t == "fetch":
            ok = not self.fail_fetches
            self.held.setdefault(name, {}).setdefault(int(msg.get("as_rank", msg["rank"])), set()).add(
                int(msg["step"])
            )
            reply = {"t": "fetched", "id": msg["id"], "ok": ok, "seconds": 0.01, "raw_bytes": 100}
            self.put("msg", chan, reply if ok else {**reply, "error": "injected fetch failure"})
        elif t == "install_durable":
            ok = int(msg["step"]) not in self.bad_durable_steps
            reply = {"t": "installed", "id": msg["id"], "ok": ok}
            self.put("msg", chan, reply if ok else {**reply, "error": f"step {msg['step']} is corrupt"})

    def release_inventories(self) -> None:
        self.hold_inventories = False
        for chan, reply in self.held_replies:
            if not chan.closed:
                self.put("msg", chan, reply)
        self.held_replies.clear()
        self.tick()

    def spawn_requests(self) -> list[tuple[str, int, str]]:
        """(node, spawn id, role) of every spawn the coordinator asked for so far."""
        return [
            (name, int(m["spawn_id"]), str(m["role"]))
            for name, chan in self.agents.items()
            for m in chan.sent
            if m.get("t") == "spawn"
        ]

    def connect_spawned(self) -> list[int]:
        """Connect a worker channel for every spawn not connected yet; their spawn ids."""
        new = []
        for _, sid, role in self.spawn_requests():
            if sid in self._spawned:
                continue
            self._spawned.add(sid)
            chan = FakeChannel({"role": role, "spawn_id": sid, "pid": 1000 + sid}, peer=f"worker-{sid}")
            self.workers[sid] = chan
            self.put("open", chan)
            new.append(sid)
        self.tick()
        return new

    def member(self, rank: int) -> FakeChannel:
        return self.workers[self.coord.view.members[rank]]

    def worker_says(self, rank: int, msg: Message) -> None:
        chan = self.member(rank)
        self.put("msg", chan, {"gen": self.coord.generation, **msg})

    def bring_up(self) -> None:
        """Every member restores, joins and steps once: the first generation runs."""
        self.connect_spawned()
        ranks = sorted(self.coord.view.members)
        for kind in ("restored", "ready"):
            for rank in ranks:
                self.worker_says(rank, {"t": kind})
            self.tick()
        self.step_all(1)

    def step_all(self, step: int) -> None:
        for rank in sorted(self.coord.view.members):
            self.worker_says(rank, {"t": "step", "step": step, "step_s": 0.01})
            node = self.coord.view.rank_node[rank]
            self.held.setdefault(node, {}).setdefault(rank, set()).add(step)
        self.tick()

    def resume_all(self, step: int) -> None:
        """Every member restores, rebuilds and completes ``step`` in the current generation."""
        self.connect_spawned()
        for kind in ("restored", "ready"):
            for rank in sorted(self.coord.view.members):
                self.worker_says(rank, {"t": kind})
            self.tick()
        self.step_all(step)

    def lose_node(self, name: str) -> None:
        """Node ``name``'s agent connection closes (it died): the node is lost."""
        self.put("close", self.agents[name])
        self.tick()

    def exit(self, sid: int, rc: int = -9) -> None:
        """The agent of ``sid``'s node reports it exited with ``rc``."""
        node = self.coord.view.node_of(sid)
        self.put("msg", self.agents[node], {"t": "exit", "spawn_id": sid, "rc": rc, "pid": 1000 + sid})
        self.tick()

    def events(self, name: str) -> list[dict[str, Any]]:
        return logged(self.log.path, name)
