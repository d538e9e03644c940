"""Every message of the agent channel (nonstop/protocol/agent.py, both directions) round-trips
encode -> decode, encodes to the very bytes its sender put on the wire before the channel was
typed (pinned literally: the channel's ``json.dumps(msg, separators=(",", ":"))``), and a
malformed one raises :class:`~nonstop.protocol.base.WireError`."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import pytest

from nonstop.coordinator.executor import Executor
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.events.log import EventLog
from nonstop.protocol import agent
from nonstop.protocol.base import HealthMsg, RawMsg, WireError


def wire(msg: Mapping[str, Any]) -> bytes:
    """What :meth:`nonstop.control.channel.Channel.send` puts in a frame's JSON part."""
    return json.dumps(msg, separators=(",", ":")).encode()


# -- agent -> coordinator -----------------------------------------------------------------------
HELLO = agent.AgentHelloMsg(
    node="1", nproc=2, spares=1, domain="r1", data_addr="127.0.0.1:9000", pid=42, in_process=False,
    devices=None, device_type="cpu",
)  # fmt: skip
HELLO_BYTES = (
    b'{"role":"agent","node":"1","nproc":2,"spares":1,"domain":"r1","data_addr":"127.0.0.1:9000",'
    b'"pid":42,"in_process":false,"devices":null,"device_type":"cpu"'
)


def test_the_hello_keeps_its_bytes_and_round_trips() -> None:
    assert wire(HELLO.encode()) == HELLO_BYTES + b"}"
    assert agent.AgentHelloMsg.decode(json.loads(HELLO_BYTES + b"}")) == HELLO
    resumed = agent.AgentHelloMsg(**{**HELLO.__dict__, "resume": True, "lease_id": 7})
    assert wire(resumed.encode()) == HELLO_BYTES + b',"resume":true,"lease_id":7}'
    assert agent.AgentHelloMsg.decode(resumed.encode()) == resumed


def test_a_sparse_hello_decodes_as_the_coordinator_always_read_one() -> None:
    """The coordinator's fakes (tests/coord_fakes.py) say only some fields."""
    h = agent.AgentHelloMsg.decode({"role": "agent", "node": "n", "nproc": 1, "data_addr": "a:1"})
    assert (h.node, h.nproc, h.spares, h.domain, h.data_addr, h.resume, h.lease_id) == (
        "n",
        1,
        0,
        None,
        "a:1",
        False,
        None,
    )
    assert agent.AgentHelloMsg.decode({"role": "agent"}).node == ""


REPORTS: list[tuple[Any, bytes]] = [
    (agent.LeaseMsg(seq=3), b'{"t":"lease","seq":3}'),
    (
        agent.ExitMsg(spawn_id=2, rc=-9, pid=100, fault_at=None),
        b'{"t":"exit","spawn_id":2,"rc":-9,"pid":100,"fault_at":null}',
    ),
    (
        agent.ExitMsg(spawn_id=2, rc=125, pid=None, fault_at=12.5),
        b'{"t":"exit","spawn_id":2,"rc":125,"pid":null,"fault_at":12.5}',
    ),
    (
        agent.JudgedMsg(spawn_id=2, hung=False, detail="1.0 ms on a CPU"),
        b'{"t":"judged","spawn_id":2,"hung":false,"detail":"1.0 ms on a CPU"}',
    ),
    (agent.SpawnedMsg(spawn_id=1, pid=100, device=0), b'{"t":"spawned","spawn_id":1,"pid":100,"device":0}'),
    (
        agent.SpawnedMsg(spawn_id=1, pid=100, device=None),
        b'{"t":"spawned","spawn_id":1,"pid":100,"device":null}',
    ),
    (
        agent.SpawnedMsg(spawn_id=2, pid=None, error="no free device"),
        b'{"t":"spawned","spawn_id":2,"pid":null,"error":"no free device"}',
    ),
    (
        agent.InventoryMsg(id=3, local={0: (4, 5)}, replicas={1: (5,)}),
        b'{"t":"inventory","id":3,"local":{"0":[4,5]},"replicas":{"1":[5]}}',
    ),
    (agent.InstalledMsg(id=4, ok=True, seconds=0.5), b'{"t":"installed","id":4,"ok":true,"seconds":0.5}'),
    (
        agent.InstalledMsg(id=4, ok=False, error="KeyError: 3"),
        b'{"t":"installed","id":4,"ok":false,"error":"KeyError: 3"}',
    ),
    (  # a copy between the node's own stores
        agent.FetchedMsg(
            id=5,
            rank=0,
            ok=True,
            seconds=0.25,
            moved=agent.FetchedBytes(raw_bytes=10, wire_bytes=0, delta=False),
        ),
        b'{"t":"fetched","id":5,"rank":0,"raw_bytes":10,"wire_bytes":0,"delta":false,"ok":true,"seconds":0.25}',
    ),
    (  # from a peer
        agent.FetchedMsg(
            id=5,
            rank=0,
            ok=True,
            seconds=0.25,
            moved=agent.FetchedBytes(raw_bytes=10, wire_bytes=4, delta=True, capped=False),
        ),
        b'{"t":"fetched","id":5,"rank":0,"raw_bytes":10,"wire_bytes":4,"delta":true,"capped":false,'
        b'"ok":true,"seconds":0.25}',
    ),
    (
        agent.FetchedMsg(id=5, rank=0, ok=False, error="FetchError: gone"),
        b'{"t":"fetched","id":5,"rank":0,"ok":false,"error":"FetchError: gone"}',
    ),
    (  # failed after it moved the bytes (keeping the base of a catch-up)
        agent.FetchedMsg(
            id=5,
            rank=0,
            ok=False,
            error="MemoryError: ",
            moved=agent.FetchedBytes(raw_bytes=10, wire_bytes=4, delta=False, capped=True),
        ),
        b'{"t":"fetched","id":5,"rank":0,"raw_bytes":10,"wire_bytes":4,"delta":false,"capped":true,'
        b'"ok":false,"error":"MemoryError: "}',
    ),
    (
        agent.ReplicatedMsg(step=4, rank=1, ok=True, raw=10, wire=4, seconds=0.5, full=False),
        b'{"t":"replicated","step":4,"rank":1,"ok":true,"raw":10,"wire":4,"seconds":0.5,"full":false}',
    ),
    (
        agent.ReplicatedMsg(step=4, rank=1, ok=False, error="connection closed"),
        b'{"t":"replicated","step":4,"rank":1,"ok":false,"error":"connection closed"}',
    ),
    (agent.PreemptMsg(grace_s=30.0), b'{"t":"preempt","grace_s":30.0}'),
    (agent.RegisteredMsg(lease_id=7), b'{"t":"registered","lease_id":7}'),
    (
        agent.FatalMsg(error="--shm-dir /dev/shm holds 1 GiB; the node needs 2 GiB"),
        b'{"t":"fatal","error":"--shm-dir /dev/shm holds 1 GiB; the node needs 2 GiB"}',
    ),
    (
        HealthMsg(verdict="degraded", probe="host", detail=None),
        b'{"t":"health","verdict":"degraded","probe":"host","detail":null}',
    ),
]


@pytest.mark.parametrize(("msg", "pinned"), REPORTS, ids=lambda x: type(x).__name__)
def test_agent_reports_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert agent.decode_agent(json.loads(pinned)) == msg
    assert type(msg).decode(json.loads(pinned)) == msg


PERSISTED: list[tuple[agent.RanksPersistedMsg, bytes]] = [
    (
        agent.RanksPersistedMsg(
            id=2, ok=True, records=({"rank": 0},), raw=10, stored=4, full=True, seconds=1.5
        ),
        b'{"t":"persisted","id":2,"ok":true,"records":[{"rank":0}],"raw":10,"stored":4,"full":true,"seconds":1.5}',
    ),
    (
        agent.RanksPersistedMsg(id=2, ok=False, error="disk full"),
        b'{"t":"persisted","id":2,"ok":false,"error":"disk full"}',
    ),
    (
        agent.RanksPersistedMsg(id=None, ok=False, error="x"),
        b'{"t":"persisted","id":null,"ok":false,"error":"x"}',
    ),
]


@pytest.mark.parametrize(("msg", "pinned"), PERSISTED)
def test_a_persist_answer_keeps_its_bytes_and_reaches_the_rounds_raw(
    msg: agent.RanksPersistedMsg, pinned: bytes
) -> None:
    assert wire(msg.encode()) == pinned
    assert agent.RanksPersistedMsg.decode(json.loads(pinned)) == msg
    raw = agent.decode_agent(json.loads(pinned))  # coordinator/persistence.py decodes it
    assert isinstance(raw, RawMsg) and raw.msg == json.loads(pinned)


def test_what_the_coordinator_always_accepted_still_decodes() -> None:
    """Old readings kept: a verdict without its word kills; a fetch answer may omit its sizes
    (tests/coord_fakes.py), which then read 0; unknown kinds are None."""
    assert agent.decode_agent({"t": "judged", "spawn_id": 1}) == agent.JudgedMsg(
        spawn_id=1, hung=True, detail=""
    )
    f = agent.decode_agent({"t": "fetched", "id": 1, "ok": True, "seconds": 0.01, "raw_bytes": 100})
    assert isinstance(f, agent.FetchedMsg) and (f.rank, f.raw_bytes, f.wire_bytes, f.delta, f.capped) == (
        None, 100, 0, False, False,
    )  # fmt: skip
    failed = agent.decode_agent({"t": "fetched", "id": 1, "ok": False, "error": "x"})
    assert isinstance(failed, agent.FetchedMsg) and (failed.raw_bytes, failed.delta) == (0, False)
    assert agent.decode_agent({"t": "fatal"}) == agent.FatalMsg(error="a node cannot play its part")
    assert agent.decode_agent({"t": "from-the-future"}) is None


# -- coordinator -> agent -----------------------------------------------------------------------
COMMANDS: list[tuple[Any, bytes]] = [
    (agent.LeaseOkMsg(seq=3), b'{"t":"lease_ok","seq":3}'),
    (
        agent.SpawnMsg(spawn_id=0, role="worker", rank=0, env={"RANK": "0", "WORLD_SIZE": "2"}),
        b'{"t":"spawn","spawn_id":0,"role":"worker","rank":0,"env":{"RANK":"0","WORLD_SIZE":"2"}}',
    ),
    (agent.SpawnMsg(spawn_id=1, role="spare"), b'{"t":"spawn","spawn_id":1,"role":"spare"}'),
    (agent.KillMsg(spawn_id=1, sig=9), b'{"t":"kill","spawn_id":1,"sig":9}'),
    (agent.KillMsg(spawn_id=1, sig=15), b'{"t":"kill","spawn_id":1,"sig":15}'),
    (
        agent.KillMsg(spawn_id=1, unless_moving=True),
        b'{"t":"kill","spawn_id":1,"sig":9,"unless_moving":true}',
    ),
    (agent.ReleaseMsg(), b'{"t":"release"}'),
    (agent.NodeFinishMsg(failed=False), b'{"t":"finish","failed":false}'),
    (agent.NodeFinishMsg(failed=True), b'{"t":"finish","failed":true}'),
    (agent.FencedMsg(error="quarantined"), b'{"t":"fenced","error":"quarantined"}'),
    (agent.InventoryRequestMsg(id=3), b'{"t":"inventory","id":3}'),
    (
        agent.ReplicateMsg(step=4, ranks={0: ("a:1",), 2: ("a:1", "b:2")}),
        b'{"t":"replicate","step":4,"ranks":{"0":["a:1"],"2":["a:1","b:2"]}}',
    ),
    (
        agent.FetchRequestMsg(rank=0, step=5, addr="h:1", kind="local", id=6),
        b'{"t":"fetch","rank":0,"step":5,"addr":"h:1","kind":"local","id":6}',
    ),
    (
        agent.FetchRequestMsg(
            rank=0, step=5, addr="h:1", kind="replica", as_rank=2, base=4, track=True, into="replica", id=6
        ),
        b'{"t":"fetch","rank":0,"step":5,"addr":"h:1","kind":"replica","as_rank":2,"base":4,"track":true,'
        b'"into":"replica","id":6}',
    ),
    (
        agent.InstallDurableMsg(url="file:///d", step=4, ranks=(0, 1), id=7),
        b'{"t":"install_durable","url":"file:///d","step":4,"ranks":[0,1],"id":7}',
    ),
    (
        agent.InstallDurableMsg(url="file:///d", step=4, ranks=(0, 1), sources={1: 0}, id=7),
        b'{"t":"install_durable","url":"file:///d","step":4,"ranks":[0,1],"from":{"1":0},"id":7}',
    ),
    (agent.CommittedMsg(step=4), b'{"t":"committed","step":4}'),
    (agent.CommittedMsg(step=None), b'{"t":"committed","step":null}'),
    (agent.ForgetMsg(rank=1), b'{"t":"forget","rank":1}'),
    (
        agent.PersistRanksMsg(
            id=2, step=4, url="file:///d", world_size=4, ranks=(0, 2), lossy=False, lossy_bits=8
        ),
        b'{"t":"persist","id":2,"step":4,"url":"file:///d","world_size":4,"ranks":[0,2],"lossy":false,"lossy_bits":8}',
    ),
]


@pytest.mark.parametrize(("msg", "pinned"), COMMANDS, ids=lambda x: type(x).__name__)
def test_coordinator_commands_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert agent.decode_command(json.loads(pinned)) == msg


def test_the_data_path_serves_exactly_the_data_commands() -> None:
    kinds = {json.loads(p)["t"] for _, p in COMMANDS}
    assert agent.DATA_COMMANDS == {
        "inventory",
        "replicate",
        "install_durable",
        "forget",
        "committed",
        "fetch",
        "persist",
    }
    assert agent.DATA_COMMANDS <= kinds
    assert agent.decode_command({"t": "from-the-future"}) is None


WELCOMES: list[tuple[Any, bytes]] = [
    (
        agent.NodeWelcomeMsg(
            job_id="j", lease_ttl_s=10.0, num_slots=2, replicas=1, env={"A": "1"}, reconnect_s=30.0
        ),
        b'{"t":"welcome","job_id":"j","lease_ttl_s":10.0,"num_slots":2,"replicas":1,"env":{"A":"1"},'
        b'"store":null,"reconnect_s":30.0}',
    ),
    (
        agent.NodeWelcomeMsg(
            job_id="j", lease_ttl_s=10.0, num_slots=3, store="etcd://h:2379", reconnect_s=5.0
        ),
        b'{"t":"welcome","job_id":"j","lease_ttl_s":10.0,"num_slots":3,"replicas":0,"env":{},'
        b'"store":"etcd://h:2379","reconnect_s":5.0}',
    ),
    (
        agent.NodeWelcomeMsg(job_id="j", lease_ttl_s=10.0, resumed=True),
        b'{"t":"welcome","job_id":"j","resumed":true,"lease_ttl_s":10.0}',
    ),
    (
        agent.NodeRefusedMsg(error="node 1 is already part of the job"),
        b'{"t":"refused","error":"node 1 is already part of the job"}',
    ),
]


@pytest.mark.parametrize(("msg", "pinned"), WELCOMES, ids=lambda x: type(x).__name__)
def test_the_answer_to_a_hello_keeps_its_bytes_and_round_trips(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert agent.decode_welcome(json.loads(pinned)) == msg


def test_any_other_answer_to_a_hello_is_a_refusal() -> None:
    assert agent.decode_welcome({"t": "error"}) == agent.NodeRefusedMsg(error=None)


# -- the coordinator's sends that were dict literals: the same bytes from the classes --------------
_WHY = "node 1 is quarantined after 3 failures"
_ENV = {"NONSTOP_X": "1"}
COORDINATOR_LITERALS: list[tuple[Any, dict[str, Any]]] = [
    # node_agents.py: a refusal, a welcome, a lease's acknowledgement, a quarantine
    (agent.NodeRefusedMsg(error=_WHY), {"t": "refused", "error": _WHY}),
    (
        agent.NodeWelcomeMsg(
            job_id="j", lease_ttl_s=10.0, num_slots=2, replicas=1, env=_ENV, store=None, reconnect_s=30.0
        ),
        {
            "t": "welcome",
            "job_id": "j",
            "lease_ttl_s": 10.0,
            "num_slots": 2,
            "replicas": 1,
            "env": _ENV,
            "store": None,
            "reconnect_s": 30.0,
        },
    ),
    (agent.LeaseOkMsg(seq=7), {"t": "lease_ok", "seq": 7}),
    (agent.LeaseOkMsg(seq=None), {"t": "lease_ok", "seq": None}),  # echoed as it came
    (agent.FencedMsg(error=_WHY), {"t": "fenced", "error": _WHY}),
    # store_sync.py: the welcome of a node that reconnects
    (
        agent.NodeWelcomeMsg(job_id="j", resumed=True, lease_ttl_s=10.0),
        {"t": "welcome", "job_id": "j", "resumed": True, "lease_ttl_s": 10.0},
    ),
    # restore_sources.py: a durable install (its id added last by the executor), with a resize's ranks
    (
        agent.InstallDurableMsg(url="file:///d", step=4, ranks=(0, 1), id=2),
        {"t": "install_durable", "url": "file:///d", "step": 4, "ranks": [0, 1], "id": 2},
    ),
    (
        agent.InstallDurableMsg(url="file:///d", step=4, ranks=(2, 3), sources={3: 1, 2: 0}, id=2),
        {
            "t": "install_durable",
            "url": "file:///d",
            "step": 4,
            "ranks": [2, 3],
            "from": {"3": 1, "2": 0},
            "id": 2,
        },
    ),
    # swaps.py: a drained node released; loop.py: the job's end
    (agent.ReleaseMsg(), {"t": "release"}),
    (agent.NodeFinishMsg(failed=False), {"t": "finish", "failed": False}),
    (agent.NodeFinishMsg(failed=True), {"t": "finish", "failed": True}),
]


@pytest.mark.parametrize(("msg", "literal"), COORDINATOR_LITERALS, ids=lambda x: type(x).__name__)
def test_the_coordinators_typed_sends_keep_the_bytes_of_its_literals(
    msg: Any, literal: dict[str, Any]
) -> None:
    assert wire(msg.encode()) == wire(literal)


def test_a_reconnecting_hello_is_read_as_the_store_sync_always_read_it() -> None:
    """What :meth:`StoreSync.reattach <nonstop.coordinator.store_sync.StoreSync.reattach>` takes
    from a reconnect: the lease id and data address when the hello has them."""
    resumed = agent.AgentHelloMsg(**{**HELLO.__dict__, "resume": True, "lease_id": 7})
    h = agent.AgentHelloMsg.decode(json.loads(wire(resumed.encode())))
    assert (h.lease_id, h.data_addr) == (7, "127.0.0.1:9000")
    bare = agent.AgentHelloMsg.decode({"role": "agent", "node": "1", "resume": True})
    assert (bare.lease_id, bare.data_addr) == (None, None)  # absent: the node keeps what it had


# -- the coordinator's executor sends them as before ----------------------------------------------
class _Chan:
    closed = False

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)


def test_the_executor_puts_a_requests_id_last_as_before(tmp_path: Path) -> None:
    view = JobView(job_id="j", world_size=2)
    chan = _Chan()
    for name, addr in (("0", "h:0"), ("1", "h:1")):
        record = NodeRecord(
            name=name, chan=None, nproc=1, spares=0, domain=name, data_addr=addr, last_lease=0.0
        )
        record.chan = cast(Any, chan)
        view.nodes[name] = record
    io = Executor(view, EventLog(tmp_path / "events.jsonl"))
    assert io.request(view.nodes["0"], agent.InventoryRequestMsg()) == 0
    io.fetch("0", 1, 5, "1", "replica", as_rank=1, base=4, track=True)
    io.fetch("0", 1, 5, "1", "local", as_rank=0, into="replica")
    io.request(view.nodes["0"], agent.InstallDurableMsg(url="u", step=1, ranks=(0,)))
    sid = io.spawn("0", Role.SPARE, None)
    io.kill(sid, signal.SIGKILL, unless_moving=True)
    assert [wire(m) for m in chan.sent] == [
        b'{"t":"inventory","id":0}',
        b'{"t":"fetch","rank":1,"step":5,"addr":"h:1","kind":"replica","base":4,"track":true,"id":1}',
        b'{"t":"fetch","rank":1,"step":5,"addr":"h:1","kind":"local","as_rank":0,"into":"replica","id":2}',
        b'{"t":"install_durable","url":"u","step":1,"ranks":[0],"id":3}',
        b'{"t":"spawn","spawn_id":0,"role":"spare"}',
        b'{"t":"kill","spawn_id":0,"sig":9,"unless_moving":true}',
    ]


# -- malformed ------------------------------------------------------------------------------------
MALFORMED: list[tuple[Callable[[Mapping[str, Any]], object], dict[str, Any]]] = [
    (agent.AgentHelloMsg.decode, {"role": "agent", "node": "1", "nproc": "two"}),
    (agent.AgentHelloMsg.decode, {"role": "agent", "node": "1", "nproc": 1, "devices": 1.5}),
    (agent.decode_agent, {"t": "lease", "seq": "one"}),
    (agent.decode_agent, {"t": "exit", "spawn_id": "x", "rc": 0}),
    (agent.decode_agent, {"t": "exit", "spawn_id": 1}),
    (agent.decode_agent, {"t": "spawned", "pid": 3}),
    (agent.decode_agent, {"t": "inventory", "id": 3, "local": {"0": ["x"]}}),
    (agent.decode_agent, {"t": "installed", "ok": True}),
    (agent.decode_agent, {"t": "fetched", "ok": True}),
    (agent.decode_agent, {"t": "fetched", "id": 1, "ok": True, "raw_bytes": "many"}),
    (agent.decode_agent, {"t": "replicated", "step": 1, "ok": True}),
    (agent.decode_agent, {"t": "replicated", "step": 1, "rank": 0, "ok": True, "raw": "x"}),
    (agent.decode_agent, {"t": "preempt", "grace_s": "soon"}),
    (agent.decode_agent, {"t": "registered"}),
    (agent.RanksPersistedMsg.decode, {"t": "persisted", "id": 1, "ok": True, "records": 5}),
    (agent.RanksPersistedMsg.decode, {"t": "persisted", "id": 1, "ok": True, "records": [], "raw": "x"}),
    (agent.decode_welcome, {"t": "welcome", "lease_ttl_s": 1.0}),
    (agent.decode_welcome, {"t": "welcome", "job_id": "j", "lease_ttl_s": "x"}),
    (agent.decode_welcome, {"t": "welcome", "job_id": "j", "lease_ttl_s": 1.0, "env": ["A=1"]}),
    (agent.decode_command, {"t": "lease_ok"}),
    (agent.decode_command, {"t": "spawn", "spawn_id": 1}),
    (agent.decode_command, {"t": "spawn", "spawn_id": 1, "role": "worker", "env": [1]}),
    (agent.decode_command, {"t": "kill", "spawn_id": None}),
    (agent.decode_command, {"t": "inventory"}),
    (agent.decode_command, {"t": "replicate", "step": 1, "ranks": [1]}),
    (agent.decode_command, {"t": "replicate", "step": 1, "ranks": {"x": ["a"]}}),
    (agent.decode_command, {"t": "fetch", "rank": 0, "step": 1, "kind": "local", "id": 1}),
    (agent.decode_command, {"t": "install_durable", "url": "u", "step": 1, "ranks": "01", "id": 1}),
    (
        agent.decode_command,
        {"t": "install_durable", "url": "u", "step": 1, "ranks": [0], "from": {"a": "b"}, "id": 1},
    ),
    (
        agent.decode_command,
        {"t": "persist", "id": 1, "step": 1, "url": "u", "world_size": 2, "ranks": [True]},
    ),
    (agent.decode_command, {"t": "forget"}),
]


@pytest.mark.parametrize(
    ("decode", "raw"), MALFORMED, ids=lambda x: getattr(x, "__qualname__", None) or str(x)[:40]
)
def test_a_malformed_agent_channel_message_is_a_wire_error(
    decode: Callable[[Mapping[str, Any]], object], raw: dict[str, Any]
) -> None:
    with pytest.raises(WireError):
        decode(raw)


def test_a_request_that_cannot_be_read_is_answered_by_its_id_if_it_has_one() -> None:
    assert agent.request_id({"t": "persist", "id": 4}) == 4
    assert agent.request_id({"t": "persist", "id": "4"}) is None
    assert agent.request_id({"t": "persist"}) is None
