"""Snapshot slots, flattening and capture: unit tests on real shared-memory files."""

from __future__ import annotations

import os
import random
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nonstop.errors import SnapshotError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore, StateCapture, flatten_state, unflatten_state
from nonstop.snapshot.api import HEADER_FMT, SlotState
from nonstop.snapshot.pending import Copier
from nonstop.snapshot.reads import SlotReads
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
    with pytest.raises(SnapshotError, match=r"cannot snapshot a value of type object at \.a\[1\]"):
        flatten_state({"a": [1, object()]})
    with pytest.raises(SnapshotError, match=r"type set at \.b\[0\]"):
        flatten_state({"b": ({1}, 2)})
    with pytest.raises(SnapshotError, match=r"unsupported dict key type frozenset at \.c"):
        flatten_state({"c": {frozenset(): 1}})
    with pytest.raises(SnapshotError, match="at <root>"):
        flatten_state(object())


def test_slots_alternate_and_keep_previous_step(store: RankSnapshotStore) -> None:
    for step in range(5):
        store.write(step, {"w": torch.full((4,), float(step))})
    assert store.complete_steps() == [3, 4]
    assert torch.equal(store.read(3)["w"], torch.full((4,), 3.0))
    with pytest.raises(SnapshotMissingError, match=r"step 2 \(have steps \[3, 4\]\)"):
        store.read(2)


def test_a_copy_that_may_settle_waits_for_a_step_being_written_again(
    store: RankSnapshotStore, tmp_path: Path
) -> None:
    """A fetch's source may be starting its slots over (cleared, the restored step written again):
    with ``settle_s`` the reader finds the step once the write lands; without, it fails at once."""
    store.write(4, {"w": torch.full((4,), 4.0)})
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    store.clear()
    with pytest.raises(SnapshotMissingError):
        reader.copy_out(4)
    t = threading.Timer(0.3, lambda: store.write(4, {"w": torch.full((4,), 4.0)}))
    t.start()
    t0 = time.monotonic()
    snap = reader.copy_out(4, settle_s=10.0)
    assert 0.2 < time.monotonic() - t0 < 10.0 and snap.step == 4
    t0 = time.monotonic()
    with pytest.raises(SnapshotMissingError):
        reader.copy_out(5, settle_s=0.2)  # never written: fails once settle_s is spent
    assert time.monotonic() - t0 >= 0.2
    t.join()
    reader.close()


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


def test_python_rng_state_is_an_array_and_a_list_from_older_snapshots_still_loads(
    store: RankSnapshotStore,
) -> None:
    cap = StateCapture(model=torch.nn.Linear(2, 2))
    random.seed(3)
    state = cap.state(1)
    assert isinstance(state["rng"]["python"][1], np.ndarray)  # a tensor in the slot, not 7 KB of JSON
    store.write(1, state)
    older = cap.state(2)
    older["rng"]["python"][1] = [int(x) for x in older["rng"]["python"][1]]  # as written before
    store.write(2, older)
    want = [random.random() for _ in range(3)]
    for step in (1, 2):
        random.seed(99)
        cap.restore(store.read(step, copy=False))
        assert [random.random() for _ in range(3)] == want


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
    _overwrite_all_slots(store)
    assert torch.equal(opt.state[model.weight]["exp_avg"], moment)


def _overwrite_all_slots(store: RankSnapshotStore) -> None:
    for step in (3, 4):
        store.write(step, {"junk": torch.zeros(10_000)})
    assert store.complete_steps() == [3, 4]


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
    _overwrite_all_slots(store)
    assert torch.equal(fresh_opt.state[fresh_model.weight]["exp_avg"], want)


def test_survivor_optimizer_is_restored_in_place(store: RankSnapshotStore) -> None:
    model, opt, cap = _snapshotted_linear(store)
    saved = opt.state[model.weight]["exp_avg"].clone()
    tensor_before = opt.state[model.weight]["exp_avg"]
    _train_one_step_linear(model, opt)
    cap.restore(store.read(1, copy=False))
    assert opt.state[model.weight]["exp_avg"] is tensor_before  # same tensor, no new allocation
    assert torch.equal(tensor_before, saved)


def test_restore_drops_the_abandoned_steps_gradients(store: RankSnapshotStore) -> None:
    """A script that zeroes gradients after optimizer.step() (Accelerate's pattern) must not add
    the gradients of the step a failure interrupted to the redone step's."""
    model, _, cap = _snapshotted_linear(store)
    model(torch.randn(2, 4)).sum().backward()  # the interrupted step got as far as its backward
    cap.restore(store.read(1, copy=False))
    assert all(p.grad is None for p in model.parameters())


def _flat_clone(state: object) -> list[torch.Tensor]:
    return [t.clone() for t in flatten_state(state)[1]]


def test_overlapped_snapshot_is_step_k_while_step_k_plus_1_runs(
    store: RankSnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background copy of step k races step k+1's forward, backward and optimizer step:
    the optimizer step is fenced until the copy is done, so the slot holds exactly step k."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cap = StateCapture(model=model, optimizer=opt)
    x = torch.randn(16, 64)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    want = _flat_clone(cap.state(1))
    gate = threading.Event()
    real_copy = Copier._copy_pairs

    def held_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        assert gate.wait(10)
        real_copy(pairs)

    monkeypatch.setattr(Copier, "_copy_pairs", staticmethod(held_copy))
    pending = store.begin(1, cap.state(1), deferred=cap.deferrable())
    assert not pending.done() and store.complete_steps() == []  # bulk copy still held
    opt.register_step_pre_hook(lambda *_: pending.fence())
    model(x).pow(2).mean().backward()  # step k+1 runs: BatchNorm's running stats change now
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    opt.step()  # must wait for the copy before changing parameters and moments
    assert time.monotonic() - t0 >= 0.15
    got = flatten_state(store.read(1))[1]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    now = flatten_state(cap.state(2))[1]
    assert not all(torch.equal(a, b) for a, b in zip(now, want, strict=True))  # step k+1 did change state


def test_copy_failure_surfaces_on_wait(store: RankSnapshotStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(pairs: object) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(Copier, "_copy_pairs", staticmethod(broken))
    w = torch.zeros(8)
    pending = store.begin(1, {"w": w}, deferred=lambda t: True)
    with pytest.raises(SnapshotError, match="snapshot of step 1 failed: device lost"):
        pending.wait()
    assert store.complete_steps() == []  # never marked complete


def test_pinned_slot_is_not_overwritten(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(1, {"w": torch.full((4,), 1.0)})
    store.write(2, {"w": torch.full((4,), 2.0)})
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    slot = next(i for i in range(2) if reader.info(i).step == 1)  # type: ignore[union-attr]
    reader._slots[slot].set_pinned(True)
    for step in (3, 4, 5):
        store.write(step, {"w": torch.full((4,), float(step))})
    assert 1 in store.complete_steps() and torch.equal(reader.read(1)["w"], torch.full((4,), 1.0))
    assert store.complete_steps() == [1, 5]
    reader._slots[slot].set_pinned(False)
    store.write(6, {"w": torch.zeros(4)})
    assert store.complete_steps() == [5, 6]
    reader.close()


def test_copy_out_detects_a_racing_write(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(1, {"w": torch.arange(1000.0)})
    store.write(2, {"w": torch.arange(1000.0) + 1})
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    raw = reader.copy_out(2)
    assert raw.step == 2 and bytes(raw.data) == (torch.arange(1000.0) + 1).numpy().tobytes()
    assert not any(reader.info(i).pinned for i in range(2))  # type: ignore[union-attr]
    real_info = SlotReads.info

    def info_racing_a_writer(self: SlotReads, i: int) -> object:
        inf = real_info(self, i)
        if inf is not None and inf.pinned:
            # A writer that chose this slot just before the pin became visible starts now.
            store._slots[i].write_header(SlotState.WRITING, 3, 0, 0, 0.0)
            return real_info(self, i)
        return inf

    reads = reader._reads  # the store's reader (snapshot/reads.py)
    reads.info = info_racing_a_writer.__get__(reads)  # type: ignore[method-assign]
    with pytest.raises(SnapshotMissingError, match="no complete snapshot of step 2"):
        reader.copy_out(2)
    reader.close()


def test_write_raw_installs_a_serialized_snapshot(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(7, {"w": torch.arange(10.0), "n": 3})
    raw = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3).copy_out(7)
    other = RankSnapshotStore(shm_dir=tmp_path, job_id="u", rank=0)
    other.write_raw(7, raw.meta, raw.data)
    got = other.read(7)
    assert got["n"] == 3 and torch.equal(got["w"], torch.arange(10.0))
    other.close()


def test_growth_is_in_place_and_seen_by_other_mappers(store: RankSnapshotStore, tmp_path: Path) -> None:
    store.write(0, {"w": torch.zeros(4)})
    store.write(1, {"w": torch.zeros(4)})
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    assert reader.complete_steps() == [0, 1]  # the reader has both slots mapped now
    inodes = [slot_path(tmp_path, "t", 3, i).stat().st_ino for i in range(2)]
    big = torch.arange(200_000, dtype=torch.float32)
    store.write(2, {"w": big})
    store.write(3, {"w": big + 1})
    assert [slot_path(tmp_path, "t", 3, i).stat().st_ino for i in range(2)] == inodes
    assert reader.complete_steps() == [2, 3]
    assert torch.equal(reader.read(3)["w"], big + 1)
    reader.close()


def test_a_dead_writers_torn_slot_is_not_a_write_in_progress(
    store: RankSnapshotStore, tmp_path: Path
) -> None:
    """The planner waits for writes in progress; a slot left WRITING by a dead process is not one."""
    store.write(1, {"w": torch.zeros(4)})
    slot = next(s for s in store._slots if s.header() is None or s.header()[3] != 1)  # type: ignore[index]
    slot.ensure_capacity(64, 64)
    slot.write_header(SlotState.WRITING, 2, 0, 0, 0.0)  # as this process would mid-write
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=3)
    (inf,) = [reader.info(i) for i in range(2) if reader.info(i).state is SlotState.WRITING]  # type: ignore[union-attr]
    assert inf is not None and inf.writer_pid == os.getpid()
    assert reader.writing_step({os.getpid()}) == 2
    assert reader.writing_step({os.getpid() + 1}) is None  # the writer is gone: torn leftovers
    reader.close()


def test_a_slot_file_not_sized_yet_reads_as_empty(tmp_path: Path) -> None:
    """A writer creates a slot file and sizes it a moment later; a reader in between (the
    persister, an inventory) sees no snapshot there instead of failing (mmap refuses empty files)."""
    slot_path(tmp_path, "e", 0, 0).touch()
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id="e", rank=0, num_slots=2)
    assert reader.complete_steps() == []
    writer = RankSnapshotStore(shm_dir=tmp_path, job_id="e", rank=0, num_slots=2)
    writer.write(4, {"w": torch.ones(3)})
    assert reader.complete_steps() == [4]


def test_clear_and_prefault(tmp_path: Path) -> None:
    """``clear`` forgets every snapshot of the rank; ``prefault`` sizes the free slots and leaves
    complete snapshots alone."""
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="c", rank=1, num_slots=3)
    s.write(7, {"w": torch.arange(5.0)})
    assert s.prefault({"w": torch.zeros(5)}) == 2
    assert s.complete_steps() == [7]
    assert torch.equal(s.read(7)["w"], torch.arange(5.0))
    s.write(8, {"w": torch.ones(5)})
    s.clear()
    assert s.complete_steps() == []
    with pytest.raises(SnapshotMissingError):
        s.read(8)


def test_equal_states_give_equal_bytes_whatever_a_slot_held_before(tmp_path: Path) -> None:
    """The alignment padding between tensors is zeroed when a slot takes a new layout: rank 0's
    slots first held another layout (a step before the optimizer had state), rank 1's did not;
    the same state then gives the same bytes on both (the durable tier shares equal chunks)."""
    first = {"w": torch.full((3,), 7.0), "b": torch.full((37,), 9.0)}  # 12 B then padding
    state = {"w": torch.arange(5.0), "m": torch.ones(3), "v": torch.zeros(2)}
    rank0 = RankSnapshotStore(shm_dir=tmp_path, job_id="pad", rank=0, num_slots=2)
    rank1 = RankSnapshotStore(shm_dir=tmp_path, job_id="pad", rank=1, num_slots=2)
    try:
        for step in (0, 1):  # fill both of rank 0's slots with the other layout
            rank0.write(step, first)
        old = rank0.copy_out(1)
        for step in (2, 3):
            rank0.write(step, state)
            rank1.write(step, state)
        for step in (2, 3):
            a, b = rank0.copy_out(step), rank1.copy_out(step)
            assert a.meta == b.meta
            assert bytes(a.data) == bytes(b.data)
            assert not bytes(a.data[20:64]).strip(b"\0")  # w's padding: zeros, not b's old 9.0s
        # Bytes written whole (a restore) into a slot whose views are this layout's, then
        # the layout again in that slot (step 6 goes where step 4 went):
        rank0.write_raw(4, old.meta, old.data)
        rank0.write(5, state)
        rank0.write(6, state)
        assert bytes(rank0.copy_out(6).data) == bytes(rank1.copy_out(3).data)
    finally:
        rank0.close()
        rank1.close()


def test_the_stores_reader_is_an_object_of_its_own(store: RankSnapshotStore, tmp_path: Path) -> None:
    """A SlotReads alone (no writer) reads what a store wrote; forgetting the rank's snapshots
    is the writer's (``clear``), and the reader sees it."""
    store.write(4, {"w": torch.arange(3.0)})
    reads = SlotReads(shm_dir=tmp_path, job_id="t", rank=3, num_slots=2)
    assert reads.complete_steps() == [4] and torch.equal(reads.read(4)["w"], torch.arange(3.0))
    assert reads.copy_out(4).step == 4 and not hasattr(reads, "clear")
    store.clear()
    assert reads.complete_steps() == [] and store.complete_steps() == []
    reads.close()
