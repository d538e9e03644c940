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
            for inf in store._holding(7):
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
