"""Snapshot slots, flattening and capture: unit tests on real shared-memory files."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nonstop.errors import SnapshotError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore, StateCapture, flatten_state, unflatten_state
from nonstop.snapshot.api import HEADER_FMT, SlotState
from nonstop.snapshot.store import slot_path

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool, torch.float64]


@pytest.fixture
def store(tmp_path: Path) -> RankSnapshotStore:
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3, num_slots=2)
    yield s
    s.close()


def _tensor(draw_shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(draw_shape, generator=g) * 100
    return t.to(dtype) if dtype is not torch.bool else t > 0


leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.text(max_size=8)
)
tensors = st.builds(
    _tensor, st.lists(st.integers(0, 5), max_size=3), st.sampled_from(DTYPES), st.integers(0, 1000)
)
trees = st.recursive(
    st.one_of(leaf, tensors),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(
            st.text(min_size=1, max_size=6).filter(lambda k: not k.startswith("__")), children, max_size=4
        ),
        st.dictionaries(st.integers(0, 50), children, max_size=4),
    ),
    max_leaves=12,
)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


@settings(max_examples=60, deadline=None)
@given(trees)
def test_flatten_round_trip(tree: object) -> None:
    flat, ts = flatten_state(tree)
    assert _equal(unflatten_state(flat, ts), tree)


@settings(max_examples=30, deadline=None)
@given(trees)
def test_store_round_trip_is_exact(tmp_path_factory: pytest.TempPathFactory, tree: object) -> None:
    s = RankSnapshotStore(shm_dir=tmp_path_factory.mktemp("shm"), job_id="p", rank=0)
    try:
        s.write(5, {"x": tree})
        assert _equal(s.read(5)["x"], tree)
    finally:
        s.close()


def test_flatten_rejects_unsupported_values() -> None:
    with pytest.raises(SnapshotError, match="cannot snapshot a value of type object"):
        flatten_state({"a": [object()]})


def test_slots_alternate_and_keep_previous_step(store: RankSnapshotStore) -> None:
    for step in range(5):
        store.write(step, {"w": torch.full((4,), float(step))})
    assert store.complete_steps() == [3, 4]
    assert torch.equal(store.read(3)["w"], torch.full((4,), 3.0))
    with pytest.raises(SnapshotMissingError, match=r"step 2 \(have steps \[3, 4\]\)"):
        store.read(2)


def test_buffers_are_reused_not_reallocated(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(0, {"w": torch.zeros(1000)})
    store.write(1, {"w": torch.zeros(1000)})
    inodes = [slot_path(tmp_path, "t", 3, i).stat().st_ino for i in range(2)]
    for step in range(2, 6):
        store.write(step, {"w": torch.ones(1000) * step})
    assert [slot_path(tmp_path, "t", 3, i).stat().st_ino for i in range(2)] == inodes


def test_slot_grows_when_state_grows(store: RankSnapshotStore) -> None:
    store.write(0, {"w": torch.zeros(10)})
    store.write(2, {"w": torch.arange(100_000, dtype=torch.float32)})  # same slot, much larger
    assert torch.equal(store.read(2)["w"], torch.arange(100_000, dtype=torch.float32))


def test_torn_write_is_never_read(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(0, {"w": torch.zeros(3)})
    store.write(1, {"w": torch.ones(3)})
    # Simulate a writer killed mid-write of step 3 into slot 1: the header says WRITING.
    path = slot_path(tmp_path, "t", 3, 1)
    with path.open("r+b") as f:
        raw = list(struct.unpack(HEADER_FMT, f.read(struct.calcsize(HEADER_FMT))))
        raw[2], raw[3] = int(SlotState.WRITING), -1
        f.seek(0)
        f.write(struct.pack(HEADER_FMT, *raw))
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    assert reader.complete_steps() == [0]
    with pytest.raises(SnapshotMissingError):
        reader.read(1)
    reader.close()


def test_another_process_view_sees_complete_snapshot(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(7, {"w": torch.arange(6.0)})
    other = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    assert torch.equal(other.read(7)["w"], torch.arange(6.0))
    other.close()


def _train_one_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_capture_restores_model_optimizer_rng_and_extras(store: RankSnapshotStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    data = {"pos": 0}
    cap = StateCapture(
        model=model, optimizer=opt, extras=lambda: dict(data), load_extras=lambda d: data.update(d)
    )
    _train_one_step(model, opt)
    data["pos"] = 42
    store.write(1, cap.state(1))
    expect_params = [p.detach().clone() for p in model.parameters()]
    expect_draws = (torch.rand(3), random.random(), np.random.rand())
    # Diverge: more training, RNG use, data position moves.
    random.random()
    for _ in range(3):
        _train_one_step(model, opt)
    data["pos"] = 99
    assert cap.restore(store.read(1, copy=False)) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expect_params, strict=True))
    assert data["pos"] == 42
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expect_draws[0]) and got[1:] == expect_draws[1:]


def _snapshotted_linear(
    store: RankSnapshotStore,
) -> tuple[torch.nn.Linear, torch.optim.Optimizer, StateCapture]:
    """A Linear + AdamW after one step, snapshotted as step 1."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    cap = StateCapture(model=model, optimizer=opt)
    _train_one_step_linear(model, opt)
    store.write(1, cap.state(1))
    return model, opt, cap


def test_restored_optimizer_does_not_alias_snapshot_memory(store: RankSnapshotStore) -> None:
    model, opt, cap = _snapshotted_linear(store)
    cap.restore(store.read(1, copy=False))
    moment = opt.state[model.weight]["exp_avg"].clone()
    store.write(3, {"junk": torch.zeros(10_000)})  # overwrite the same slot with other bytes
    assert torch.equal(opt.state[model.weight]["exp_avg"], moment)


def _train_one_step_linear(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()


def test_capture_requires_extras_pair() -> None:
    with pytest.raises(ValueError, match="both extras= and load_extras="):
        StateCapture(model=torch.nn.Linear(1, 1), extras=dict)


def test_fresh_optimizer_is_restored_with_owned_tensors(store: RankSnapshotStore) -> None:
    """A replacement's optimizer has no state yet: it gets clones, equal and not aliased."""
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train_one_step_linear(model, opt)
    store.write(1, StateCapture(model=model, optimizer=opt).state(1))
    fresh_model = torch.nn.Linear(4, 4)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    StateCapture(model=fresh_model, optimizer=fresh_opt).restore(store.read(1, copy=False))
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    want = opt.state[model.weight]["exp_avg"]
    got = fresh_opt.state[fresh_model.weight]["exp_avg"]
    assert torch.equal(got, want)
    store.write(3, {"junk": torch.zeros(10_000)})
    assert torch.equal(fresh_opt.state[fresh_model.weight]["exp_avg"], want)


def test_survivor_optimizer_is_restored_in_place(store: RankSnapshotStore) -> None:
    model, opt, cap = _snapshotted_linear(store)
    saved = opt.state[model.weight]["exp_avg"].clone()
    tensor_before = opt.state[model.weight]["exp_avg"]
    _train_one_step_linear(model, opt)
    cap.restore(store.read(1, copy=False))
    assert opt.state[model.weight]["exp_avg"] is tensor_before  # same tensor, no new allocation
    assert torch.equal(tensor_before, saved)
