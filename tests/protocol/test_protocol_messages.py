"""Every message of nonstop/protocol/ round-trips encode -> decode, encodes to the very bytes its
sender put on the wire before the typed protocol (pinned literally: the channel's
``json.dumps(msg, separators=(",", ":"))``), and a malformed one raises the typed
:class:`~nonstop.protocol.base.WireError` its receiver turns into closing that sender only."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from nonstop.control.rdzv import KeyValueTable
from nonstop.protocol import client, dataplane, rendezvous
from nonstop.protocol.base import HealthMsg, MigrateMsg, WireError


def wire(msg: Mapping[str, Any]) -> bytes:
    """What :meth:`nonstop.control.channel.Channel.send` puts in a frame's JSON part."""
    return json.dumps(msg, separators=(",", ":")).encode()


# -- client channel -----------------------------------------------------------------------------
CLIENT_PINNED: list[tuple[Any, bytes]] = [
    (client.StatusRequestMsg(), b'{"t":"status"}'),
    (client.PersistRequestMsg(), b'{"t":"persist"}'),
    (MigrateMsg(gen=-1, rank=2, to=None), b'{"t":"migrate","rank":2,"to":null}'),
    (client.DrainMsg(node="1"), b'{"t":"drain","node":"1"}'),
    (client.AcceptedMsg(ranks=(0, 3)), b'{"t":"accepted","ranks":[0,3]}'),
    (
        client.MigratedMsg(rank=None, ok=False, error="no node 7 in the job"),
        b'{"t":"migrated","ok":false,"error":"no node 7 in the job"}',
    ),
    (
        client.MigratedMsg(rank=1, ok=True, error=None, info={"source": "1", "target": "0", "boundary": 9}),
        b'{"t":"migrated","rank":1,"ok":true,"error":null,"source":"1","target":"0","boundary":9}',
    ),
    (client.PersistedMsg(error="no tier"), b'{"t":"persisted","error":"no tier"}'),
    (
        client.PersistedMsg(error=None, step=4, url="file:///d", stored_bytes=10),
        b'{"t":"persisted","error":null,"step":4,"url":"file:///d","stored_bytes":10}',
    ),
    (client.ErrorMsg(error="unknown request 'x'"), b'{"t":"error","error":"unknown request \'x\'"}'),
    (
        client.StatusMsg(status={"job_id": "j", "generation": 2}),
        b'{"t":"status","job_id":"j","generation":2}',
    ),
]


@pytest.mark.parametrize(("msg", "pinned"), CLIENT_PINNED, ids=lambda x: type(x).__name__)
def test_client_messages_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    decoded = json.loads(pinned)
    if isinstance(msg, client.StatusRequestMsg | client.PersistRequestMsg | client.DrainMsg | MigrateMsg):
        assert client.decode_client(decoded) == msg
    else:
        assert client.decode_client_answer(decoded) == msg


def test_a_status_kind_is_a_request_one_way_and_an_answer_the_other() -> None:
    assert client.decode_client({"t": "status"}) == client.StatusRequestMsg()
    assert client.decode_client_answer({"t": "status", "state": "running"}) == client.StatusMsg(
        status={"state": "running"}
    )
    assert client.decode_client({"t": "from-the-future"}) is None
    assert client.decode_client_answer({"t": "from-the-future"}) is None


MALFORMED: list[tuple[Callable[[Mapping[str, Any]], object], dict[str, Any]]] = [
    (client.decode_client, {"t": "migrate", "to": "1"}),  # a client's migrate names its rank
    (client.decode_client, {"t": "migrate", "rank": "one"}),
    (client.decode_client, {"t": "drain"}),
    (client.decode_client, {"t": "drain", "node": [1]}),
    (client.decode_client_answer, {"t": "accepted"}),
    (client.decode_client_answer, {"t": "accepted", "ranks": ["x"]}),
    (client.decode_client_answer, {"t": "migrated", "rank": "x", "ok": True}),
    (client.decode_client_answer, {"t": "persisted", "step": 1.5}),
    (HealthMsg.decode, {"t": "health", "verdict": "fine"}),
]


@pytest.mark.parametrize(
    ("decode", "raw"), MALFORMED, ids=lambda x: getattr(x, "__qualname__", None) or str(x)[:40]
)
def test_a_malformed_message_is_a_wire_error(
    decode: Callable[[Mapping[str, Any]], object], raw: dict[str, Any]
) -> None:
    with pytest.raises(WireError):
        decode(raw)


# -- rendezvous (kv) ------------------------------------------------------------------------------
KV_PINNED: list[tuple[Any, bytes]] = [
    (
        rendezvous.KvRequestMsg(id=3, gen=1, op="set", key="k", value=b"ab"),
        b'{"t":"kv","id":3,"gen":1,"op":"set","key":"k","value":"YWI="}',
    ),
    (
        rendezvous.KvRequestMsg(id=4, gen=1, op="get", key="k", keys=("k",)),
        b'{"t":"kv","id":4,"gen":1,"op":"get","key":"k","keys":["k"]}',
    ),
    (
        rendezvous.KvRequestMsg(id=5, gen=1, op="add", key="n", amount=2),
        b'{"t":"kv","id":5,"gen":1,"op":"add","key":"n","amount":2}',
    ),
    (
        rendezvous.KvRequestMsg(id=6, gen=1, op="compare_set", key="k", expected=b"", desired=b"x"),
        b'{"t":"kv","id":6,"gen":1,"op":"compare_set","key":"k","expected":"","desired":"eA=="}',
    ),
    (
        rendezvous.KvRequestMsg(id=7, gen=1, op="wait", keys=("a", "b")),
        b'{"t":"kv","id":7,"gen":1,"op":"wait","keys":["a","b"]}',
    ),
    (rendezvous.KvRequestMsg(id=8, gen=1, op="num_keys"), b'{"t":"kv","id":8,"gen":1,"op":"num_keys"}'),
]


@pytest.mark.parametrize(("msg", "pinned"), KV_PINNED, ids=lambda x: getattr(x, "op", "bytes"))
def test_kv_requests_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert rendezvous.KvRequestMsg.decode(json.loads(pinned)) == msg


@pytest.mark.parametrize(
    ("msg", "pinned"),
    [
        (rendezvous.KvReplyMsg(id=3), b'{"t":"kv","id":3}'),
        (rendezvous.KvReplyMsg(id=3, value=False), b'{"t":"kv","id":3,"value":false}'),
        (rendezvous.KvReplyMsg(id=3, value=0), b'{"t":"kv","id":3,"value":0}'),
        (rendezvous.KvReplyMsg(id=3, value="YWI="), b'{"t":"kv","id":3,"value":"YWI="}'),
        (rendezvous.KvReplyMsg(id=-1, error="reconfigured"), b'{"t":"kv","id":-1,"error":"reconfigured"}'),
    ],
)
def test_kv_replies_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert rendezvous.KvReplyMsg.decode(json.loads(pinned)) == msg


def test_the_table_answers_a_malformed_kv_request_as_before() -> None:
    table = KeyValueTable()

    def answer(raw: dict[str, Any]) -> list[dict[str, Any]]:
        return [m for _, m in table.handle(raw, lambda m: None)]

    (bad_id,) = answer({"t": "kv", "id": "x", "gen": 0, "op": "set"})
    assert wire(bad_id) == b'{"t":"kv","id":-1,"error":"malformed request id \'x\'"}'
    (bad_value,) = answer({"t": "kv", "id": 2, "gen": 0, "op": "set", "key": "k", "value": "%%"})
    assert bad_value["id"] == 2 and bad_value["error"].startswith("bad 'set' request: ")
    assert answer({"t": "kv", "id": 3, "gen": 9, "op": "set", "key": "k", "value": ""}) == [
        {"t": "kv", "id": 3, "error": "fenced: generation 9 is not current"}
    ]
    assert answer({"t": "kv", "id": 4, "gen": 0, "op": "num_keys"}) == [{"t": "kv", "id": 4, "value": 0}]
    assert rendezvous.kv_refusal({"id": None}, "fenced") == {"t": "kv", "id": None, "error": "fenced"}


@pytest.mark.parametrize(
    ("decode", "raw"),
    [
        (rendezvous.KvRequestMsg.decode, {"t": "kv", "id": [1]}),
        (rendezvous.KvRequestMsg.decode, {"t": "kv", "id": 1, "op": "add", "amount": "two"}),
        (rendezvous.KvRequestMsg.decode, {"t": "kv", "id": 1, "op": "set", "value": "not base64!"}),
        (rendezvous.KvReplyMsg.decode, {"t": "kv", "id": "x"}),
        (rendezvous.KvReplyMsg.decode, {"t": "kv", "id": 1, "value": [1]}),
    ],
)
def test_a_malformed_kv_message_is_a_wire_error(
    decode: Callable[[Mapping[str, Any]], object], raw: dict[str, Any]
) -> None:
    with pytest.raises(WireError):
        decode(raw)


# -- data plane -----------------------------------------------------------------------------------
DATA_PINNED: list[tuple[Any, bytes]] = [
    (
        dataplane.RepMsg(rank=1, step=4, base=None, data_len=10, nchunks=2),
        b'{"t":"rep","rank":1,"step":4,"base":null,"data_len":10,"nchunks":2}',
    ),
    (
        dataplane.RepMsg(rank=1, step=4, key="L", base=3, data_len=10, nchunks=2),
        b'{"t":"rep","rank":1,"step":4,"key":"L","base":3,"data_len":10,"nchunks":2}',
    ),
    (
        dataplane.RepSharedMsg(gen=2, step=4, key="L", group=0, base=(2, 3), data_len=8, nchunks=1),
        b'{"t":"rep_shared","gen":2,"step":4,"key":"L","group":0,"base":[2,3],"data_len":8,"nchunks":1}',
    ),
    (dataplane.ChunkMsg(info={"n": 1}), b'{"t":"chunk","info":{"n":1}}'),
    (dataplane.RepAckMsg(ok=True, rank=1, step=4), b'{"t":"rep_ack","ok":true,"rank":1,"step":4}'),
    (dataplane.RepAckMsg(ok=True, step=4), b'{"t":"rep_ack","ok":true,"step":4}'),
    (
        dataplane.RepAckMsg(ok=False, need_full=True, error="base not held"),
        b'{"t":"rep_ack","ok":false,"need_full":true,"error":"base not held"}',
    ),
    (
        dataplane.RepAckMsg(ok=False, need_shared=True, error="shared write not held"),
        b'{"t":"rep_ack","ok":false,"need_shared":true,"error":"shared write not held"}',
    ),
    (
        dataplane.FetchMsg(rank=0, step=5, kind="replica", node="1"),
        b'{"t":"fetch","rank":0,"step":5,"kind":"replica","node":"1"}',
    ),
    (
        dataplane.FetchMsg(rank=0, step=5, kind="local", node="1", base=4, track=True),
        b'{"t":"fetch","rank":0,"step":5,"kind":"local","node":"1","base":4,"track":true}',
    ),
    (
        dataplane.FetchBeginMsg(data_len=10, nchunks=2, base=None, capped=False),
        b'{"t":"fetch_begin","data_len":10,"nchunks":2,"base":null,"capped":false}',
    ),
    (dataplane.FetchBeginMsg.failed("gone"), b'{"t":"fetch_begin","error":"gone"}'),
]


@pytest.mark.parametrize(("msg", "pinned"), DATA_PINNED, ids=lambda x: type(x).__name__)
def test_data_plane_messages_keep_their_bytes_and_round_trip(msg: Any, pinned: bytes) -> None:
    assert wire(msg.encode()) == pinned
    assert type(msg).decode(json.loads(pinned)) == msg


@pytest.mark.parametrize(
    ("decode", "raw"),
    [
        (dataplane.RepMsg.decode, {"t": "rep", "rank": 1, "step": 4, "data_len": 1}),
        (dataplane.RepMsg.decode, {"t": "rep", "rank": "one", "step": 4, "data_len": 1, "nchunks": 1}),
        (dataplane.RepSharedMsg.decode, {"t": "rep_shared", "gen": 1, "step": 2, "key": "k", "base": [1]}),
        (dataplane.ChunkMsg.decode, {"t": "rep", "info": {}}),
        (dataplane.ChunkMsg.decode, {"t": "chunk", "info": 3}),
        (dataplane.FetchMsg.decode, {"t": "fetch", "rank": 0}),
        (dataplane.FetchBeginMsg.decode, {"t": "fetch_begin", "data_len": 1, "nchunks": "x"}),
    ],
)
def test_a_malformed_data_plane_message_is_a_wire_error(
    decode: Callable[[Mapping[str, Any]], object], raw: dict[str, Any]
) -> None:
    with pytest.raises(WireError):
        decode(raw)
