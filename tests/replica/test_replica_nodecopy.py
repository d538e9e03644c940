"""Replicating a node whose ranks keep one copy of their alike state: the shared write travels
once per holder and step, each rank's own part alone; what the holder gives back is each rank's
whole snapshot, byte for byte. Real sockets, real shared memory, no workers."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from nonstop.control.channel import new_secret
from nonstop.replica.dataplane import DataPlane, shm_stores
from nonstop.replica.peer import Replicator, fetch_snapshot
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.nodecopy import NodeCopy, node_slots

RANKS = 4


def _model(drift: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 256, generator=g) + drift, "b": torch.randn(256, generator=g) + drift}


def _state(rank: int, model: dict[str, torch.Tensor], step: int) -> dict[str, object]:
    return {"model": model, "rng": torch.arange(16, dtype=torch.uint8) + rank, "extras": {"step": step}}


@contextlib.contextmanager
def _node(
    tmp_path: Path, stores: int = 2, group_of: Callable[[int], int] = lambda r: 0
) -> Iterator[tuple[Path, str, bytes, DataPlane, Replicator, list[RankSnapshotStore]]]:
    """Node a's ``RANKS`` rank stores (rank r in copy group ``group_of(r)``), its replicator,
    and node b's data plane, which holds a's replicas."""
    secret = new_secret()
    job = uuid.uuid4().hex[:8]
    shm = tmp_path / "shm"
    shm.mkdir()
    holder = DataPlane(
        host="127.0.0.1",
        port=0,
        secret=secret,
        local=shm_stores(shm, f"{job}.b", 2),
        replica=shm_stores(shm, f"{job}.b.rep", stores),
    )
    rep = Replicator(node="a", secret=secret, local=shm_stores(shm, f"{job}.a", stores))
    writers = []
    for r in range(RANKS):  # node a's ranks, as their workers write them
        s = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=r)
        copy = NodeCopy(shm_dir=shm, job_id=f"{job}.a", num_slots=node_slots(2), group=group_of(r))
        s.share_with(copy, 1)
        writers.append(s)
    try:
        yield shm, job, secret, holder, rep, writers
    finally:
        for s in writers:
            s.close()
        rep.close()
        holder.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, str, bytes, DataPlane, Replicator, list[RankSnapshotStore]]]:
    with _node(tmp_path) as made:
        yield made


def _snapshot(writers: list[RankSnapshotStore], step: int, drift: float) -> None:
    for r, s in enumerate(writers):
        model = _model(drift)  # alike on every rank, each its own tensors
        ptrs = {t.data_ptr() for t in model.values()}
        s.write(step, _state(r, model, step), share=lambda t, p=ptrs: t.data_ptr() in p)


def test_a_node_sends_its_alike_state_once_and_the_holder_gives_back_whole_snapshots(node) -> None:
    shm, job, secret, holder, rep, writers = node
    model_bytes = 256 * 257 * 4
    _snapshot(writers, 10, 0.0)
    first = [rep.replicate(r, 10, [holder.addr]) for r in range(RANKS)]
    raw = sum(st.raw_bytes for st in first)
    assert model_bytes <= raw < 1.2 * model_bytes  # the shared write once, own parts tiny
    _snapshot(writers, 11, 1e-3)
    second = [rep.replicate(r, 11, [holder.addr]) for r in range(RANKS)]
    assert sum(st.raw_bytes for st in second) < 1.2 * model_bytes
    assert not any(st.full for st in second)  # own parts as deltas
    local = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=0)
    for r in range(RANKS):
        held = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=r)
        assert held.complete_steps() == [10, 11]
        want = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=r).copy_out(11)
        meta, data = fetch_snapshot(holder.addr, secret, node="c", rank=r, step=11, kind="replica")
        assert meta == want.meta and np.array_equal(np.frombuffer(data, dtype=np.uint8), want.data)
        got = held.read(11)
        assert torch.equal(got["rng"], torch.arange(16, dtype=torch.uint8) + r)
        assert torch.equal(got["model"]["w"], _model(1e-3)["w"])
        held.close()
    # the holder keeps one shared write per step, not one per rank
    assert len(list(shm.glob(f"nonstop-{job}.b.rep-n0-s*"))) == 2
    # and a holder that lost it is sent it again (need_shared), whole
    for p in shm.glob(f"nonstop-{job}.b.rep-n0-s*"):
        p.unlink()
    _snapshot(writers, 12, 2e-3)
    again = rep.replicate(0, 12, [holder.addr])
    assert again.raw_bytes >= model_bytes
    assert RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=0).complete_steps() == [12]
    local.close()


def test_each_copy_group_travels_once_and_comes_back_as_its_ranks_whole_snapshots(tmp_path: Path) -> None:
    """HSDP 2x2 on one node: two copy groups (shards 0 and 1), each sent once per step to the
    holder (its own delta base per group), and each rank's snapshot fetched back byte for byte."""
    with _node(tmp_path, 4, lambda r: r % 2) as (shm, job, secret, holder, rep, writers):
        shard_bytes = 256 * 257 * 4
        for step, drift in ((10, 0.0), (11, 1e-3)):
            for r, s in enumerate(writers):
                model = _model(drift + r % 2)  # each shard its own values, alike on its twins
                ptrs = {t.data_ptr() for t in model.values()}
                s.write(step, _state(r, model, step), share=lambda t, p=ptrs: t.data_ptr() in p)
            stats = [rep.replicate(r, step, [holder.addr]) for r in range(4)]
            assert 2 * shard_bytes <= sum(st.raw_bytes for st in stats) < 2.4 * shard_bytes  # each group once
        assert not any(st.full for st in stats)  # step 11: the own parts went as deltas
        for g in (0, 1):
            assert len(list(shm.glob(f"nonstop-{job}.b.rep-n{g}-s*"))) == 2
        for r in range(4):
            want = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=r).copy_out(11)
            meta, data = fetch_snapshot(holder.addr, secret, node="c", rank=r, step=11, kind="replica")
            assert meta == want.meta and np.array_equal(np.frombuffer(data, dtype=np.uint8), want.data)
            held = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b.rep", rank=r)
            assert torch.equal(held.read(11)["model"]["w"], _model(1e-3 + r % 2)["w"])
            held.close()


def test_a_holder_whose_ranks_are_the_twins_takes_the_shards_from_its_own_memory(tmp_path: Path) -> None:
    """HSDP 2x2 over 2 nodes (a replica group each): node b's ranks 2 and 3 hold the shards node
    a's ranks 0 and 1 hold, bitwise. a's replicas to b carry their own parts only; b takes the
    shared writes from its own ranks' and gives back a's whole snapshots byte for byte. A layout
    b's ranks do not share travels as before."""
    with _node(tmp_path, 4, lambda r: r % 2) as (shm, job, secret, holder, rep, writers):
        b_ranks = []
        for r in (2, 3):  # node b's own ranks, as their workers write them
            s = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.b", rank=r)
            s.share_with(NodeCopy(shm_dir=shm, job_id=f"{job}.b", num_slots=node_slots(2), group=r % 2), 1)
            b_ranks.append(s)
        try:
            shard_bytes = 256 * 257 * 4
            for r, s in [(0, writers[0]), (1, writers[1]), (2, b_ranks[0]), (3, b_ranks[1])]:
                model = _model(r % 2)  # shard r % 2, alike on both nodes
                ptrs = {t.data_ptr() for t in model.values()}
                s.write(10, _state(r, model, 10), share=lambda t, p=ptrs: t.data_ptr() in p)
            stats = [rep.replicate(r, 10, [holder.addr]) for r in (0, 1)]
            assert sum(st.raw_bytes for st in stats) < 0.1 * shard_bytes  # own parts alone travelled
            assert holder.twin_bytes >= 2 * shard_bytes
            for r in (0, 1):
                want = RankSnapshotStore(shm_dir=shm, job_id=f"{job}.a", rank=r).copy_out(10)
                meta, data = fetch_snapshot(holder.addr, secret, node="c", rank=r, step=10, kind="replica")
                assert meta == want.meta and np.array_equal(np.frombuffer(data, dtype=np.uint8), want.data)
            # another layout (node a's shards grew): b's write of the step is not it, so a's goes
            # over the wire
            for r, s in [(0, writers[0]), (1, writers[1]), (2, b_ranks[0]), (3, b_ranks[1])]:
                model = _model(r % 2)
                if r < 2:
                    model = {k: torch.cat([v, v]) for k, v in model.items()}
                ptrs = {t.data_ptr() for t in model.values()}
                s.write(11, _state(r, model, 11), share=lambda t, p=ptrs: t.data_ptr() in p)
            before = holder.twin_bytes
            assert sum(rep.replicate(r, 11, [holder.addr]).raw_bytes for r in (0, 1)) > 4 * shard_bytes
            assert holder.twin_bytes == before
        finally:
            for s in b_ranks:
                s.close()
