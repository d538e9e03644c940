"""Every message of the worker channel (nonstop/protocol/worker.py, both directions) encodes to
the very dict its sender put on the wire before the channel was typed (pinned literally, key
order included: the channel's ``json.dumps`` keeps it, so the bytes are the same), round-trips
encode -> decode, and a malformed one raises :class:`~nonstop.protocol.base.WireError`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from nonstop.protocol import worker
from nonstop.protocol.base import HealthMsg, MigrateMsg, RawMsg, WireError
from nonstop.reshardplan import TensorLayout


def wire(msg: Mapping[str, Any]) -> bytes:
    """What :meth:`nonstop.control.channel.Channel.send` puts in a frame's JSON part."""
    return json.dumps(msg, separators=(",", ":")).encode()


def same(encoded: Mapping[str, Any], literal: Mapping[str, Any]) -> None:
    """Same keys, same values, same order: the same bytes."""
    assert wire(encoded) == wire(literal)


# -- coordinator -> worker: (message, the literal its sender wrote) -------------------------------
ENV = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"}
RESHARD = {"step": 40, "world": 4, "memory": {"0": "local", "1": "replica"}}
ORDERS: list[tuple[worker.WorkerOrder, dict[str, Any]]] = [
    (  # generation_setup.py: a recovery's, every optional field
        worker.ReconfigureMsg(
            gen=3, rank=1, world_size=3, env=ENV, restore_step=40, recovery=True, lost=(2,),
            shards=(1, 4), num_shards=4, divisor=4, from_rank=2, fresh=True, live=True, reshard=RESHARD,
        ),
        {
            "t": "reconfigure", "gen": 3, "rank": 1, "world_size": 3, "env": ENV, "restore_step": 40,
            "recovery": True, "lost": [2], "shards": [1, 4], "num_shards": 4, "divisor": 4,
            "from_rank": 2, "fresh": True, "live": True, "reshard": RESHARD,
        },
    ),
    (  # generation_setup.py: a fresh start
        worker.ReconfigureMsg(
            gen=0, rank=0, world_size=2, env=ENV, restore_step=None, recovery=False,
            shards=(0,), num_shards=2, divisor=2,
        ),
        {
            "t": "reconfigure", "gen": 0, "rank": 0, "world_size": 2, "env": ENV, "restore_step": None,
            "recovery": False, "shards": [0], "num_shards": 2, "divisor": 2,
        },
    ),
    (  # swap_actions.py: a joiner's prepare
        worker.ReconfigureMsg(
            gen=5, rank=2, world_size=3, env=ENV, restore_step=12, recovery=False, prepare=True,
            shards=(2,), num_shards=3, divisor=3,
        ),
        {
            "t": "reconfigure", "gen": 5, "rank": 2, "world_size": 3, "env": ENV, "restore_step": 12,
            "recovery": False, "prepare": True, "shards": [2], "num_shards": 3, "divisor": 3,
        },
    ),
    (worker.RebuildMsg(gen=4), {"t": "rebuild", "gen": 4}),
    (
        worker.LeaveMsg(gen=4, recovery=True, lost=(0, 2)),
        {"t": "leave", "gen": 4, "recovery": True, "lost": [0, 2]},
    ),
    (worker.RaiseMsg(), {"t": "raise"}),
    (worker.PauseMsg(at=17), {"t": "pause", "at": 17}),
    (worker.ContinueMsg(), {"t": "continue"}),
    (worker.CadenceMsg(every=4, since=20), {"t": "cadence", "every": 4, "since": 20}),
    (worker.FinishMsg(), {"t": "finish"}),
    (worker.AbortMsg(error="UsageError: no"), {"t": "abort", "error": "UsageError: no"}),
    (
        worker.EventMsg(event={"ts": 1.5, "event": "committed", "step": 3}),
        {"t": "event", "event": {"ts": 1.5, "event": "committed", "step": 3}},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "literal"), ORDERS, ids=lambda x: getattr(x, "T", ""))
def test_an_order_keeps_its_bytes_and_round_trips(msg: Any, literal: dict[str, Any]) -> None:
    same(msg.encode(), literal)
    assert worker.decode_order(json.loads(wire(literal))) == msg


def test_a_sparse_reconfigure_decodes_as_the_worker_read_one() -> None:
    """An older coordinator's: no env, no shards (the worker assumes its rank, the world size)."""
    r = worker.ReconfigureMsg.decode({"t": "reconfigure", "gen": 1, "rank": 2, "world_size": 3})
    assert (r.env, r.restore_step, r.recovery, r.shards, r.num_shards, r.divisor, r.lost) == (
        {}, None, False, None, None, None, None,
    )  # fmt: skip


def test_a_kv_reply_passes_raw_and_an_unknown_kind_is_none() -> None:
    kv = {"t": "kv", "id": 3, "ok": True}
    assert worker.decode_order(kv) == RawMsg(gen=-1, msg=kv)
    assert worker.decode_order({"t": "what"}) is None
    assert worker.decode_order({}) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"t": "reconfigure", "rank": 0, "world_size": 1},  # no gen
        {"t": "reconfigure", "gen": 1, "rank": "0", "world_size": 1},
        {"t": "reconfigure", "gen": 1, "rank": 0, "world_size": 1, "env": [1]},
        {"t": "reconfigure", "gen": 1, "rank": 0, "world_size": 1, "lost": ["a"]},
        {"t": "reconfigure", "gen": 1, "rank": 0, "world_size": 1, "reshard": {"world": 2}},
        {"t": "rebuild"},
        {"t": "leave", "gen": None},
        {"t": "pause", "at": "x"},
        {"t": "cadence", "every": 2},
        {"t": "event", "event": "line"},
    ],
)
def test_a_malformed_order_raises_the_wire_error(bad: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        worker.decode_order(bad)


# -- worker -> coordinator ----------------------------------------------------------------------
LAYOUT = TensorLayout(global_shape=(8, 4), placements=("Shard(dim=0)",), mesh_dims=("shard",))
REPORTS: list[tuple[Any, dict[str, Any]]] = [
    (  # heartbeat.py
        worker.HeartbeatMsg(coll=False, step=7, idle_s=0.25, moving=True, at="train/x.py:3 f"),
        {"t": "hb", "coll": False, "step": 7, "idle": 0.25, "moving": True, "at": "train/x.py:3 f"},
    ),
    (worker.HeartbeatMsg(coll=True, step=0, idle_s=0.0), {"t": "hb", "coll": True, "step": 0, "idle": 0.0}),
    (
        worker.HeartbeatMsg(coll=False, step=2, idle_s=1.0, moving=False),
        {"t": "hb", "coll": False, "step": 2, "idle": 1.0, "moving": False},
    ),
    (  # injection.py
        worker.InjectedMsg(index=1, kind="kill", rank=0, step=15, ts=1700000000.5),
        {"t": "injected", "index": 1, "kind": "kill", "rank": 0, "step": 15, "ts": 1700000000.5},
    ),
    (  # rejoin.py
        worker.RestoredMsg(gen=2, step=40, restore_s=0.125),
        {"t": "restored", "gen": 2, "step": 40, "restore_s": 0.125},
    ),
    (worker.ReadyMsg(gen=2, rebuild_s=0.5), {"t": "ready", "gen": 2, "rebuild_s": 0.5}),
    (
        worker.ReadyMsg(gen=2, rebuild_s=0.5, groups=(3, 1, 0.25), layouts=(LAYOUT,)),
        {
            "t": "ready", "gen": 2, "rebuild_s": 0.5, "groups": [3, 1, 0.25],
            "layouts": [[[8, 4], ["Shard(dim=0)"], ["shard"]]],
        },
    ),
    (  # reports.py
        worker.StepMsg(gen=1, step=9, step_s=0.5, wait_s=0.125, snap_s=0.0625, of=60, nbytes=1024, loss=2.5),
        {
            "t": "step", "gen": 1, "step": 9, "step_s": 0.5, "wait_s": 0.125, "snap_s": 0.0625, "of": 60,
            "bytes": 1024, "loss": 2.5,
        },
    ),
    (
        worker.StepMsg(gen=1, step=9, step_s=0.5, wait_s=0.0, snap_s=0.0, of=None, nbytes=0, loss=None,
                       snapped=False, rest="abc"),
        {
            "t": "step", "gen": 1, "step": 9, "step_s": 0.5, "wait_s": 0.0, "snap_s": 0.0, "of": None,
            "bytes": 0, "loss": None, "snapped": False, "rest": "abc",
        },
    ),
    (  # rejoin.py: a late boundary's snapshot of a step reported before
        worker.StepMsg(gen=1, step=9, step_s=0.0, again=True),
        {"t": "step", "gen": 1, "step": 9, "step_s": 0.0, "again": True},
    ),
    (worker.DoneMsg(gen=3, step=60), {"t": "done", "gen": 3, "step": 60}),
    (worker.PausedMsg(gen=3, step=30), {"t": "paused", "gen": 3, "step": 30}),
    (  # rejoin.py: a fault without rescues, with a failed one, with one
        worker.FaultMsg(gen=1, step=5, error="RuntimeError: x"),
        {"t": "fault", "gen": 1, "step": 5, "error": "RuntimeError: x"},
    ),
    (
        worker.FaultMsg(gen=1, step=5, error="RuntimeError: x", rescue=(None, None)),
        {"t": "fault", "gen": 1, "step": 5, "error": "RuntimeError: x", "rescued": None},
    ),
    (
        worker.FaultMsg(gen=1, step=5, error="RuntimeError: x", rescue=(5, "d1g")),
        {"t": "fault", "gen": 1, "step": 5, "error": "RuntimeError: x", "rescued": 5, "rest": "d1g"},
    ),
    (  # session.py: the script's mistake
        worker.FaultMsg(gen=0, step=0, error="bad", usage=True),
        {"t": "fault", "gen": 0, "step": 0, "error": "bad", "usage": True},
    ),
    (worker.SubscribeMsg(kinds=("failure",)), {"t": "subscribe", "kinds": ["failure"]}),
    (worker.SubscribeMsg(kinds=None), {"t": "subscribe", "kinds": None}),
    (  # injection.py
        HealthMsg(verdict="degraded", probe="fault", detail="degrade at step 3"),
        {"t": "health", "verdict": "degraded", "probe": "fault", "detail": "degrade at step 3"},
    ),
    (MigrateMsg(gen=2, rank=1, to=None), {"t": "migrate", "gen": 2, "rank": 1, "to": None}),
]  # fmt: skip


@pytest.mark.parametrize(("msg", "literal"), REPORTS, ids=lambda x: getattr(x, "T", ""))
def test_a_report_keeps_its_bytes_and_round_trips(msg: Any, literal: dict[str, Any]) -> None:
    same(msg.encode(), literal)
    assert worker.decode_worker(json.loads(wire(literal))) == msg


def test_the_hello_and_the_resume_point_keep_their_bytes_and_round_trip() -> None:
    hello = worker.WorkerHelloMsg(role="spare", spawn_id=4, pid=99)
    same(hello.encode(), {"role": "spare", "spawn_id": 4, "pid": 99})
    assert worker.WorkerHelloMsg.decode(hello.encode()) == hello
    resume = worker.ResumeMsg(gen=2, step=31, done=False, cadence=worker.CadenceMsg(every=2, since=10))
    again = worker.WorkerHelloMsg(role="worker", spawn_id=4, pid=99, resume=resume)
    same(
        again.encode(),
        {
            "role": "worker",
            "spawn_id": 4,
            "pid": 99,
            "resume": {"gen": 2, "step": 31, "done": False, "cadence": {"every": 2, "since": 10}},
        },
    )
    assert worker.WorkerHelloMsg.decode(json.loads(wire(again.encode()))) == again


def test_a_resume_point_reads_as_the_coordinator_always_read_one() -> None:
    """Absent fields: generation -1 (none), step 0; an interval that is none is ignored."""
    assert worker.ResumeMsg.decode({}) == worker.ResumeMsg(gen=-1, step=0, done=False, cadence=None)
    for said in ({"every": 0, "since": 1}, {"every": 2}, [2, 1], {"every": True, "since": 0}):
        assert worker.ResumeMsg.decode({"cadence": said}).cadence is None
    assert worker.WorkerHelloMsg.decode({"role": "worker"}).spawn_id == -1


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "worker", "spawn_id": "x"},
        {"role": "worker", "spawn_id": 1, "resume": [1]},
        {"role": "worker", "spawn_id": 1, "resume": {"gen": "2"}},
    ],
)
def test_a_malformed_hello_raises_the_wire_error(bad: dict[str, Any]) -> None:
    with pytest.raises(WireError):
        worker.WorkerHelloMsg.decode(bad)


def test_fields_the_coordinator_only_records_never_fail_a_report() -> None:
    hb = worker.decode_worker({"t": "hb", "coll": False, "step": "x", "idle": 0.5})
    assert isinstance(hb, worker.HeartbeatMsg) and hb.step is None and hb.moving is None
    step = worker.decode_worker({"t": "step", "gen": 1, "step": 2, "step_s": 0.1, "loss": "nan?"})
    assert isinstance(step, worker.StepMsg) and step.loss is None
