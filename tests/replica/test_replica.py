"""Peer data plane and rendezvous table: real sockets, real shared memory, no workers."""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nonstop.control.channel import BLOB, connect, new_secret
from nonstop.control.rdzv import KeyValueTable
from nonstop.errors import AuthError, ControlError
from nonstop.replica.dataplane import DataPlane, shm_stores
from nonstop.replica.peer import FetchError, Replicator, fetch, fetch_snapshot
from nonstop.snapshot import RankSnapshotStore

Msg = dict[str, object]


def _state(seed: int, drift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(256, 64, generator=g)
    return {
        "w": w + drift,
        "b": torch.arange(100, dtype=torch.int64),
        "h": torch.randn(1000, generator=g).bfloat16(),
    }


@pytest.fixture
def planes(tmp_path: Path) -> Iterator[tuple[DataPlane, Replicator, bytes, Path, str]]:
    """Two nodes on one machine: node a (the sender) and node b (the holder)."""
    secret = new_secret()
    job = uuid.uuid4().hex[:8]
    shm = tmp_path / "shm"
    shm.mkdir()
    local_a = shm_stores(shm, f"{job}.a", 2)
    holder = DataPlane(
        host="127.0.0.1",
        port=0,
        secret=secret,
        local=shm_stores(shm, f"{job}.b", 2),
        replica=shm_stores(shm, f"{job}.b.rep", 2),
    )
    rep = Replicator(node="a", secret=secret, local=local_a)
    try:
        yield holder, rep, secret, shm, job
    finally:
        rep.close()
        holder.close()


def _write(shm: Path, store_id: str, rank: int, step: int, state: dict[str, torch.Tensor]) -> None:
    s = RankSnapshotStore(shm_dir=shm, job_id=store_id, rank=rank)
    s.write(step, state)
    s.close()


def test_replicate_full_then_delta_and_fetch_back(
    planes: tuple[DataPlane, Replicator, bytes, Path, str],
) -> None:
    holder, rep, secret, shm, job = planes
    _write(shm, f"{job}.a", 3, 10, _state(1))
    first = rep.replicate(3, 10, [holder.addr])
    assert first.full and first.wire_bytes > 0
    _write(shm, f"{job}.a", 3, 11, _state(1, drift=1e-3))
    second = rep.replicate(3, 11, [holder.addr])
    assert not second.full  # a delta against step 10, which the holder acknowledged
    held = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=3)
    assert held.complete_steps() == [10, 11]
    got = held.read(11)
    assert torch.equal(got["w"], _state(1, drift=1e-3)["w"]) and torch.equal(got["h"], _state(1)["h"])
    _meta, data = fetch_snapshot(holder.addr, secret, node="c", rank=3, step=11, kind="replica")
    assert bytes(data) == bytes(held.copy_out(11).data)
    with pytest.raises(FetchError, match="step 99"):
        fetch_snapshot(holder.addr, secret, node="c", rank=3, step=99, kind="replica")
    held.close()


def test_holder_without_the_base_gets_a_full_copy(
    planes: tuple[DataPlane, Replicator, bytes, Path, str],
) -> None:
    holder, rep, _secret, shm, job = planes
    _write(shm, f"{job}.a", 0, 1, _state(2))
    rep.replicate(0, 1, [holder.addr])
    for p in shm.glob(f"nonstop-{job}.b.rep-r0-*"):  # the holder lost its memory (restarted)
        p.unlink()
    _write(shm, f"{job}.a", 0, 2, _state(2, drift=0.5))
    stats = rep.replicate(0, 2, [holder.addr])
    assert stats.full  # the delta was refused (need_full) and a full copy sent instead
    held = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=0)
    assert held.complete_steps() == [2]
    held.close()


def test_tracked_fetch_then_delta_catch_up(planes: tuple[DataPlane, Replicator, bytes, Path, str]) -> None:
    """A migration's catch-up: the first tracked fetch comes whole, the next as a delta against
    it (fewer bytes on the wire, the same data); an untracked fetch ends the tracking."""
    holder, _rep, secret, shm, job = planes
    local_b = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b", rank=2)
    states = {s: _state(4, drift=s * 1e-4) for s in (10, 11, 12, 13)}
    for s in (10, 11):
        local_b.write(s, states[s])
    first = fetch(holder.addr, secret, node="t", rank=2, step=10, kind="local", track=True)
    assert first.base is None and bytes(first.data) == bytes(local_b.copy_out(10).data)
    second = fetch(
        holder.addr, secret, node="t", rank=2, step=11, kind="local", base=(10, first.data), track=True
    )
    assert second.base == 10
    assert bytes(second.data) == bytes(local_b.copy_out(11).data)
    assert second.wire_bytes < first.wire_bytes  # compressed delta vs raw
    # another requester has no tracked base here: it is sent the whole step
    other = fetch(holder.addr, secret, node="u", rank=2, step=11, kind="local", base=(10, first.data))
    assert other.base is None and bytes(other.data) == bytes(second.data)
    local_b.write(12, states[12])
    third = fetch(holder.addr, secret, node="t", rank=2, step=12, kind="local", base=(11, second.data))
    assert third.base == 11 and bytes(third.data) == bytes(local_b.copy_out(12).data)
    local_b.write(13, states[13])  # the third fetch was untracked: it ended the tracking
    fourth = fetch(holder.addr, secret, node="t", rank=2, step=13, kind="local", base=(12, third.data))
    assert fourth.base is None and bytes(fourth.data) == bytes(local_b.copy_out(13).data)
    local_b.close()


def test_a_tracked_base_nobody_uses_expires(
    planes: tuple[DataPlane, Replicator, bytes, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migration aborted before its swap leaves no base held: it expires without another fetch."""
    import nonstop.replica.peer as peer

    holder, _rep, secret, shm, job = planes
    local_b = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b", rank=0)
    local_b.write(1, _state(7))
    first = fetch(holder.addr, secret, node="t", rank=0, step=1, kind="local", track=True)
    assert holder._sent  # the base of the next delta is held
    monkeypatch.setattr(peer, "TRACK_TTL_S", 0.0)
    deadline = time.monotonic() + 5
    while holder._sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not holder._sent  # dropped by the data plane's idle tick
    local_b.write(2, _state(7, drift=1e-3))
    again = fetch(holder.addr, secret, node="t", rank=0, step=2, kind="local", base=(1, first.data))
    assert again.base is None  # so the step came whole
    local_b.close()


def test_delta_against_a_base_that_differs_fails_its_checksums(
    planes: tuple[DataPlane, Replicator, bytes, Path, str],
) -> None:
    """A requester whose base is not what the holder sent (memory lost or overwritten) gets a
    FetchError, never wrong data."""
    holder, _rep, secret, shm, job = planes
    local_b = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b", rank=1)
    local_b.write(5, _state(6))
    first = fetch(holder.addr, secret, node="t", rank=1, step=5, kind="local", track=True)
    local_b.write(6, _state(6, drift=1e-3))
    wrong = bytearray(first.data)
    wrong[100] ^= 0xFF
    with pytest.raises(FetchError, match="crc32c"):
        fetch(holder.addr, secret, node="t", rank=1, step=6, kind="local", base=(5, wrong), track=True)
    local_b.close()


def test_corrupt_chunk_is_rejected_and_nothing_installed(
    planes: tuple[DataPlane, Replicator, bytes, Path, str],
) -> None:
    holder, _rep, secret, shm, job = planes
    ch = connect(holder.address, secret, {"role": "peer", "node": "evil"}, purpose="data")
    ch.send(
        {"t": "rep", "rank": 5, "step": 7, "base": None, "data_len": 8, "nchunks": 1},
        b'{"tree": 0, "tensors": []}',
    )
    info = {
        "offset": 0,
        "length": 8,
        "typesize": 1,
        "codec": "raw",
        "delta": False,
        "enc_len": 8,
        "crc_enc": 1,
        "crc_raw": 1,
    }
    ch.send({"t": "chunk", "info": info}, b"12345678")
    ack = ch.recv()
    assert ack["ok"] is False and "crc32c" in str(ack["error"])
    assert RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=5).complete_steps() == []
    ch.close()


def test_data_plane_refuses_a_wrong_secret(planes: tuple[DataPlane, Replicator, bytes, Path, str]) -> None:
    holder, _rep, _secret, _shm, _job = planes
    with pytest.raises((AuthError, ControlError)):
        connect(holder.address, new_secret(), {"role": "peer", "node": "intruder"}, purpose="data")
    with pytest.raises(FetchError):
        fetch_snapshot(holder.addr, new_secret(), node="x", rank=0, step=0, kind="replica")


def test_blob_frames_round_trip_and_are_authenticated(
    planes: tuple[DataPlane, Replicator, bytes, Path, str],
) -> None:
    from nonstop.control.listener import ControlServer

    secret = new_secret()
    srv = ControlServer(host="127.0.0.1", port=0, secret=secret)
    try:
        ch = connect(srv.address, secret, {"role": "t"})
        payload = bytes(range(256)) * 1000
        ch.send({"t": "x", "n": 1}, payload)
        ch.send({"t": "y"})
        got = []
        while len(got) < 2:
            kind, _c, msg = srv.events.get(timeout=5)
            if kind == "msg" and msg is not None:
                got.append(msg)
        assert bytes(got[0][BLOB]) == payload and got[0]["n"] == 1
        assert BLOB not in got[1]
        ch.close()
    finally:
        srv.close()


def _table_call(t: KeyValueTable, out: list[Msg], **msg: object) -> list[Msg]:
    replies: list[Msg] = []
    for reply, m in t.handle({"t": "kv", "gen": t.generation, **msg}, out.append):
        reply(m)
        replies.append(m)
    return replies


def test_kv_get_blocks_until_set_and_generations_fence() -> None:
    t = KeyValueTable()
    t.new_generation(3)
    box: list[Msg] = []
    assert _table_call(t, box, id=1, op="get", key="a", keys=["a"]) == []  # parked
    _table_call(t, box, id=2, op="set", key="a", value=base64.b64encode(b"addr").decode())
    assert {"t": "kv", "id": 1, "value": base64.b64encode(b"addr").decode()} in box
    assert _table_call(t, box, id=3, op="add", key="n", amount=2)[0]["value"] == 2
    assert _table_call(t, box, id=4, op="check", keys=["a", "n"])[0]["value"] is True
    stale = []
    for reply, m in t.handle({"t": "kv", "gen": 2, "id": 5, "op": "get", "key": "a"}, stale.append):
        reply(m)
    assert "fenced" in str(stale[0]["error"])  # an older generation cannot read the rendezvous
    parked: list[Msg] = []
    _table_call(t, parked, id=6, op="get", key="never", keys=["never"])
    for reply, m in t.new_generation(4):
        reply(m)
    assert parked and parked[0]["error"] == "reconfigured" and t.data == {}


def test_kept_step_survives_later_writes_until_released(tmp_path: Path) -> None:
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="keep", rank=0, num_slots=3)
    store.write(1, _state(1))
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="keep", rank=0, num_slots=3)
    reader.copy_out(1, keep=True)  # the replicator holds step 1 while it is replicated
    for step in range(2, 8):
        store.write(step, _state(step))
        assert 1 in store.complete_steps()  # never overwritten while held
    assert reader.keep_only({6}) == [6]  # a newer round committed: step 1 released, 6 held
    store.write(8, _state(8))
    store.write(9, _state(9))
    assert store.complete_steps() == [6, 8, 9]
    store.close()
    reader.close()


def test_abandon_fails_a_round_waiting_on_a_silent_holder_at_once(tmp_path: Path) -> None:
    """A holder that authenticates, takes the snapshot and then says nothing (a partition cut the
    link after the data left): the round would wait ACK_TIMEOUT_S for its ack; ``abandon`` from
    another thread ends it now."""
    from nonstop.control.listener import ControlServer

    secret = new_secret()
    shm = tmp_path / "shm"
    shm.mkdir()
    silent = ControlServer(host="127.0.0.1", port=0, secret=secret, purpose="data")  # nobody reads its events
    rep = Replicator(node="a", secret=secret, local=shm_stores(shm, "j.a", 2))
    _write(shm, "j.a", 0, 4, _state(2))
    import threading

    threading.Timer(1.0, rep.abandon).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(FetchError, match="replicating rank 0 step 4"):
            rep.replicate(0, 4, [f"{silent.address[0]}:{silent.address[1]}"])
        assert time.monotonic() - t0 < 30  # ACK_TIMEOUT_S is 60
    finally:
        rep.close()
        silent.close()
