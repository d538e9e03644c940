"""What a resharding rank reads (train/restore.py): every old rank's step from this node's own
and replica slots, as views of the slots -- nothing copied until the new model cuts its slices
out -- with the stores held open until it is done, and closed on every path."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from nonstop.config import WorkerEnv
from nonstop.errors import SnapshotMissingError
from nonstop.replica.peer import REPLICA_SLOTS, replicas_beside
from nonstop.snapshot import RankSnapshotStore
from nonstop.train.restore import InGroup, read_to_reshard

JOB = "rs"


def _env(tmp_path: Path) -> WorkerEnv:
    return cast(WorkerEnv, SimpleNamespace(shm_dir=tmp_path, job_id=JOB, num_slots=2))


def _write(tmp_path: Path, *, replica: bool, rank: int, step: int, state: dict[str, Any]) -> None:
    store = RankSnapshotStore(
        shm_dir=tmp_path,
        job_id=replicas_beside(JOB) if replica else JOB,
        rank=rank,
        num_slots=REPLICA_SLOTS if replica else 2,
    )
    try:
        store.write(step, state)
    finally:
        store.close()


def _two_old_ranks(tmp_path: Path) -> dict[str, Any]:
    """Old rank 0 in this node's own slots, old rank 1 in its replica slots, both at step 7."""
    _write(tmp_path, replica=False, rank=0, step=7, state={"w": torch.arange(6.0), "n": 0})
    _write(tmp_path, replica=True, rank=1, step=7, state={"w": torch.arange(6.0, 12.0), "n": 1})
    return {"step": 7, "world": 2, "memory": {"0": "local", "1": "replica"}}


def test_old_ranks_are_read_as_views_of_the_slots_until_closed(tmp_path: Path) -> None:
    info = _two_old_ranks(tmp_path)
    out = read_to_reshard(info, _env(tmp_path))
    try:
        states = [s for s in out.states if s is not None]
        assert [s["n"] for s in states] == [0, 1]
        assert torch.equal(states[0]["w"], torch.arange(6.0))
        assert torch.equal(states[1]["w"], torch.arange(6.0, 12.0))
        assert len(out.stores) == 2  # held open: the states are views of their slots
        # a view, not a copy: what another writer puts into the slot shows through
        for st, store in zip(states, out.stores, strict=True):
            at = st["w"].data_ptr()
            inside = []
            for inf in store._reads._holding(7):
                data = store._slots[inf.slot].data_view()
                inside.append(data.data_ptr() <= at < data.data_ptr() + data.numel())
            assert any(inside)
    finally:
        out.close()
    assert out.states == [] and out.stores == []
    out.close()  # idempotent


def test_copy_reads_each_old_rank_whole_and_keeps_nothing_open(tmp_path: Path) -> None:
    info = _two_old_ranks(tmp_path)
    out = read_to_reshard(info, _env(tmp_path), copy=True)
    assert out.stores == []
    second = out.states[1]
    assert second is not None and torch.equal(second["w"], torch.arange(6.0, 12.0))
    out.close()


def test_a_missing_old_rank_closes_what_was_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = _two_old_ranks(tmp_path)
    info["step"] = 8  # no slot holds it
    closed: list[int] = []
    real_close = RankSnapshotStore.close

    def close(self: RankSnapshotStore) -> None:
        closed.append(self.rank)
        real_close(self)

    monkeypatch.setattr(RankSnapshotStore, "close", close)
    with pytest.raises(SnapshotMissingError):
        read_to_reshard(info, _env(tmp_path))
    assert closed == [0]


def test_in_group_reads_slots_only_when_it_holds_open_stores(tmp_path: Path) -> None:
    info = _two_old_ranks(tmp_path)
    held = InGroup(held={"step": 7})
    assert not held.reads_slots
    views = InGroup(old_ranks=read_to_reshard(info, _env(tmp_path)))
    assert views.reads_slots
    views.close()
    assert not views.reads_slots and views.old_ranks is None
    copies = InGroup(old_ranks=read_to_reshard(info, _env(tmp_path), copy=True))
    assert not copies.reads_slots
    copies.close()


def test_an_old_rank_the_node_was_not_told_of_reads_as_none(tmp_path: Path) -> None:
    info = _two_old_ranks(tmp_path)
    info["memory"] = {"1": "replica"}  # old rank 0 is not needed here (nonstop/reshardplan.py)
    out = read_to_reshard(info, _env(tmp_path))
    try:
        assert out.states[0] is None and out.states[1] is not None and len(out.stores) == 1
    finally:
        out.close()


def _old_fsdp_raws(tmp_path: Path, world: int, rows: int) -> list[tuple[bytes, bytearray]]:
    """Each old rank's raw snapshot of ``{"model": {"w": DTensor}}``: a (rows, 2) tensor sharded
    on dim 0 over ``shard=world`` (torch's fake process group, one rank at a time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    whole = torch.arange(rows * 2.0).reshape(rows, 2)
    raws = []
    for r in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
            local = whole.chunk(world)[r].clone() if r < len(whole.chunk(world)) else whole[:0].clone()
            w = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride()
            )
            store = RankSnapshotStore(shm_dir=tmp_path, job_id="old", rank=r, num_slots=2)
            try:
                store.write(5, {"model": {"w": w}, "step": 5})
                raw = store.copy_out(5)
            finally:
                store.close()
        finally:
            dist.destroy_process_group()
        raws.append((raw.meta, bytearray(raw.data.tobytes())))
    return raws


class _FakeDurable:
    """A durable tier whose ranks are ``raws``; records which ranks were read."""

    def __init__(self, raws: list[tuple[bytes, bytearray]]) -> None:
        self.raws = raws
        self.read: list[int] = []

    def __call__(self, url: str) -> _FakeDurable:
        return self

    def load_rank(self, step: int, rank: int) -> tuple[bytes, bytearray]:
        self.read.append(rank)
        return self.raws[rank]


def test_a_resume_reads_only_the_old_ranks_its_rank_cuts_from_and_the_rest_on_demand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 rows on 4 old ranks ([0,3) [3,6) [6,9) [9,12)) resumed on 3: new rank 1 holds rows
    [4,8), in old ranks 1 and 2 -- only those are read (old rank 1 first: the rest of the state
    comes from it). ``fill`` reads the others when a model needs them after all."""
    import nonstop.snapshot.durable as durable
    from nonstop.mesh import MeshSpec

    fake = _FakeDurable(_old_fsdp_raws(tmp_path, world=4, rows=12))
    monkeypatch.setattr(durable, "DurableStore", fake)
    mesh = MeshSpec.parse("shard=4").with_world(3)
    out = read_to_reshard({"url": "file:///x", "step": 5, "world": 4}, _env(tmp_path), rank=1, mesh=mesh)
    assert fake.read == [1, 2]
    assert out.states[0] is None and out.states[3] is None
    assert out.fill() and fake.read == [1, 2, 0, 3] and all(st is not None for st in out.states)
    assert not out.fill()  # nothing left out
    # without this rank's mesh: every old rank, as before
    fake.read.clear()
    every = read_to_reshard({"url": "file:///x", "step": 5, "world": 4}, _env(tmp_path))
    assert fake.read == [0, 1, 2, 3] and every.load is None


def test_apply_reads_the_left_out_old_ranks_when_a_slice_is_uncovered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model laid out otherwise than planned: the cut fails, the left-out ranks are read
    (where they can be: the durable tier) and the cut is done again; from memory it fails."""
    import nonstop.train.restore as restore
    from nonstop.errors import SnapshotError
    from nonstop.train.restore import Resharding

    calls: list[list[Any]] = []

    def cut(capture: Any, states: list[Any], rank: int) -> int:
        calls.append(list(states))
        if any(st is None for st in states):
            raise SnapshotError("reshard: the shards leave 4 of 8 elements uncovered")
        return 5

    monkeypatch.setattr(restore, "restore_resharded", cut)
    durable = InGroup(old_ranks=Resharding([{"n": 0}, None], load=lambda r: {"n": r}))
    durable.apply(cast(Any, None), 0)
    assert calls == [[{"n": 0}, None], [{"n": 0}, {"n": 1}]]
    memory = InGroup(old_ranks=Resharding([{"n": 0}, None]))
    with pytest.raises(SnapshotError, match="uncovered"):
        memory.apply(cast(Any, None), 0)
