"""Capture on the tensors' device, checked on CPU against a fake CUDA (tests/fakecuda.py).

What a GPU would do is modelled there: copies out of a device tensor run on the current stream of
that tensor's device, lazily, only when something waits for them. So a snapshot marked COMPLETE
before its copies landed reads as zeros here, and an optimizer step that was not made to wait
for the copies changes the snapshot."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from nonstop.errors import SnapshotError
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.snapshot import device as devmod
from nonstop.snapshot.api import SlotState
from nonstop.snapshot.pending import Copier
from tests.fakecuda import FakeCuda, fake_cuda, on_device, uninstall


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    w = fake_cuda(monkeypatch, count=2)
    yield w
    uninstall()


@pytest.fixture
def store(tmp_path: Path, world: FakeCuda) -> Iterator[RankSnapshotStore]:
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="d", rank=0, num_slots=2)
    yield s
    s.close()


def _all(_: torch.Tensor) -> bool:
    return True


def _hold_host_copies(monkeypatch: pytest.MonkeyPatch, log: list[str]) -> threading.Event:
    """The copier's host (CPU-resident) copies wait until the returned event is set."""
    release = threading.Event()
    original = Copier._copy_pairs

    def held(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        release.wait()
        original(pairs)
        if pairs:
            log.append("host copied")

    monkeypatch.setattr(Copier, "_copy_pairs", staticmethod(held))
    return release


# -- streams and events on the tensors' device ------------------------------------------------------
def test_a_snapshot_is_complete_only_once_its_copies_landed_on_another_device(
    store: RankSnapshotStore, world: FakeCuda
) -> None:
    """The tensors live on cuda:1 while cuda:0 is current: the copy must be ordered on cuda:1's
    stream, and the COMPLETE header written only after it (fails when the side stream and its
    event are made on the current device: the event completes at once, the copy never ran)."""
    w = torch.arange(1000, dtype=torch.float32)
    pending = store.begin(1, {"w": on_device(w, 1)}, deferred=_all)
    pending.wait()
    assert torch.equal(store.read(1)["w"], w)
    assert {s.index for s in world.streams_made} == {1}


def test_complete_waits_for_every_devices_copies(store: RankSnapshotStore, world: FakeCuda) -> None:
    a, b = torch.arange(10.0), torch.arange(20.0) * 2
    world.hold(1)
    pending = store.begin(1, {"a": on_device(a, 0), "b": on_device(b, 1)}, deferred=_all)
    assert world.blocked(1).wait(10), "nothing waits for cuda:1's copies"
    assert not pending.done()
    assert SlotState.WRITING in {i.state for i in (store.info(0), store.info(1)) if i is not None}
    world.release(1)
    pending.wait()
    got = store.read(1)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_the_fence_makes_each_devices_current_stream_wait_for_its_copies(
    store: RankSnapshotStore, world: FakeCuda
) -> None:
    """The optimizer's kernels on cuda:1 run on cuda:1's current stream: that stream, not the
    current device's, must wait for cuda:1's copy before the optimizer changes the tensor."""
    w = torch.arange(64, dtype=torch.float32)
    before = w.clone()
    world.hold(1)  # the copy has not landed when the fence is reached
    pending = store.begin(1, {"w": on_device(w, 1)}, deferred=_all)
    pending.fence()
    waited = {(s.index, ev.where[0].index) for s, ev in world.waits if ev.where is not None}
    assert (1, 1) in waited
    world.release(1)
    world.run_main(1)  # what cuda:1 does before the optimizer's next kernel
    w.add_(1000)  # the optimizer step
    pending.wait()
    assert torch.equal(store.read(1)["w"], before)


def test_side_streams_are_made_once_per_device(store: RankSnapshotStore, world: FakeCuda) -> None:
    for step in range(1, 4):
        store.begin(step, {"a": on_device(torch.ones(4), 0), "b": on_device(torch.ones(4), 1)}, deferred=_all)
    store.drain()
    assert sorted(s.index for s in world.streams_made) == [0, 1]


# -- the fence covers CPU-resident deferred tensors -------------------------------------------------
def test_the_fence_blocks_on_a_held_host_copy(
    store: RankSnapshotStore, world: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write with device copies (their fence is a stream dependency) and a CPU-resident deferred
    tensor whose copy the copier still holds: fence() must not return before that copy."""
    monkeypatch.setattr(devmod, "SMALL_HOST_COPY", 0)  # this CPU tensor goes to the copier
    order: list[str] = []
    release = _hold_host_copies(monkeypatch, order)
    state = {"w": on_device(torch.ones(8), 0), "big": torch.zeros(16)}
    pending = store.begin(1, state, deferred=_all)
    threading.Timer(0.2, release.set).start()
    pending.fence()
    order.append("fenced")
    assert order == ["host copied", "fenced"]
    pending.wait()


def test_adams_cpu_step_changed_after_begin_does_not_tear_the_snapshot(
    store: RankSnapshotStore, world: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adam keeps ``step`` on the CPU even for device parameters (capturable=False) and increments
    it in optimizer.step(): the snapshot taken before that step must hold the old value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    capture = StateCapture(model=model, optimizer=opt)
    state = capture.state(1)
    state["model"] = {k: on_device(v, 0) for k, v in state["model"].items()}
    for entries in state["optimizer"]["state"].values():
        for key, value in list(entries.items()):
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entries[key] = on_device(value, 0)
    expect = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "step": [float(s["step"]) for s in opt.state.values()],
        "exp_avg": [s["exp_avg"].clone() for s in opt.state.values()],
    }
    assert all(not s["step"].is_cuda for s in opt.state.values())
    release = _hold_host_copies(monkeypatch, [])
    pending = store.begin(1, state, deferred=capture.deferrable())
    pending.fence()
    world.run_main(0)
    opt.step()  # changes the parameters, exp_avg (device) and step (CPU) in place
    release.set()
    pending.wait()
    got = store.read(1)
    assert [float(s["step"]) for s in got["optimizer"]["state"].values()] == expect["step"]
    for k, v in expect["model"].items():
        assert torch.equal(got["model"][k], v)
    for g, e in zip(got["optimizer"]["state"].values(), expect["exp_avg"], strict=True):
        assert torch.equal(g["exp_avg"], e)


# -- page-locked slots: registration ahead of use, checked -----------------------------------------
def _register_calls(world: FakeCuda) -> list[tuple[Any, ...]]:
    return [c for c in world.cudart.calls if c[0] == "register"]


def test_registration_is_done_at_prefault_in_chunks_and_undone_at_close(
    tmp_path: Path, world: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devmod, "REGISTER_CHUNK", 1 << 16)
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="r", rank=0, num_slots=2)
    state = {"w": on_device(torch.zeros(100_000), 0)}  # 400 kB: 7 chunks of 64 KiB per slot
    assert s.prefault(state) == 2
    calls = _register_calls(world)
    assert len(calls) == 2 * 7 and all(c[2] <= 1 << 16 for c in calls)
    per_slot = sum(c[2] for c in calls) // 2
    assert per_slot >= 400_000
    s.begin(1, state, deferred=_all).wait()
    s.begin(2, state, deferred=_all).wait()
    assert len(_register_calls(world)) == 2 * 7  # nothing registered inside a write
    s.close()
    assert world.cudart.registered() == []


def test_a_failed_registration_is_logged_once_cleared_and_copies_go_on(
    tmp_path: Path, world: FakeCuda, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devmod, "_warned", set())
    world.cudart.register_rc = 2  # cudaErrorMemoryAllocation
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="f", rank=0, num_slots=2)
    w = torch.arange(50.0)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 4):
            s.begin(step, {"w": on_device(w, 0)}, deferred=_all).wait()
    assert torch.equal(s.read(3)["w"], w)
    assert world.cudart.last_error == 0  # cleared: no later kernel launch check trips on it
    assert ("get_last_error",) in world.cudart.calls
    warnings = [r for r in caplog.records if "cudaHostRegister" in r.getMessage()]
    assert len(warnings) == 1 and "error 2" in warnings[0].getMessage()
    assert world.cudart.registered() == []
    assert len(_register_calls(world)) == 2  # once per slot, not again in every write
    s.close()
    assert not [c for c in world.cudart.calls if c[0] == "unregister"]


def test_no_registration_for_a_state_without_device_tensors(tmp_path: Path, world: FakeCuda) -> None:
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="c", rank=0, num_slots=2)
    s.prefault({"w": torch.zeros(10)})
    s.begin(1, {"w": torch.zeros(10)}, deferred=_all).wait()
    s.close()
    assert world.cudart.calls == []


# -- the device RNG -------------------------------------------------------------------------------
def test_the_rank_devices_rng_round_trips(world: FakeCuda, tmp_path: Path) -> None:
    world.current_device = 1
    capture = StateCapture(model=torch.nn.Linear(2, 2))
    state = capture.state(0)
    saved = world.rng[1].clone()
    world.rng[1] = torch.tensor([99, 99], dtype=torch.uint8)
    world.rng[0] = torch.tensor([5, 5], dtype=torch.uint8)
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="g", rank=0, num_slots=2)
    s.write(0, state)
    capture.restore(s.read(0, copy=False))
    s.close()
    assert torch.equal(world.rng[1], saved)
    assert torch.equal(world.rng[0], torch.tensor([5, 5], dtype=torch.uint8))  # other devices alone


def test_no_device_rng_without_an_initialised_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    state = StateCapture(model=torch.nn.Linear(2, 2)).state(0)
    assert "device" not in state["rng"]
    StateCapture(model=torch.nn.Linear(2, 2)).restore_rest(state)  # and restores without one


# -- restore straight onto the parameters' device ---------------------------------------------------
def test_a_fresh_optimizers_state_is_handed_over_on_its_parameters_device(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="m", rank=0, num_slots=2)
    s.write(1, StateCapture(model=model, optimizer=opt).state(1))

    fresh = torch.nn.Linear(4, 3, device="meta")
    fresh_opt = torch.optim.Adam(fresh.parameters())
    handed: list[dict[str, Any]] = []
    load: Callable[[dict[str, Any]], None] = fresh_opt.load_state_dict
    fresh_opt.load_state_dict = lambda sd: (handed.append(sd), load(sd))[1]  # type: ignore[method-assign]
    state = s.read(1, copy=False)
    StateCapture(model=torch.nn.Linear(4, 3), optimizer=fresh_opt).restore(state)
    s.close()
    (sd,) = handed
    for entries in sd["state"].values():
        assert entries["exp_avg"].device.type == "meta" and entries["exp_avg_sq"].device.type == "meta"
        assert entries["step"].device.type == "cpu"  # torch keeps it there (capturable=False)
    for st in fresh_opt.state.values():
        assert st["exp_avg"].device.type == "meta" and st["step"].device.type == "cpu"


def test_copies_are_cut_at_registered_chunk_edges(
    tmp_path: Path, world: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every device copy lands inside one registered chunk (a copy spanning two registrations
    would not be a page-locked one), and the snapshot is exact."""
    monkeypatch.setattr(devmod, "REGISTER_CHUNK", 1 << 12)
    cut: list[int] = []
    original = devmod.split_at

    def spy(dst: torch.Tensor, src: torch.Tensor, base: int, chunk: int) -> devmod.Pairs:
        out = original(dst, src, base, chunk)
        for d, _ in out:
            first, last = d.data_ptr() - base, d.data_ptr() - base + d.numel() * d.element_size() - 1
            assert first // chunk == last // chunk
        cut.append(len(out))
        return out

    monkeypatch.setattr(devmod, "split_at", spy)
    s = RankSnapshotStore(shm_dir=tmp_path, job_id="x", rank=0, num_slots=2)
    state = {"a": torch.arange(3000.0), "b": torch.arange(5000, dtype=torch.float64), "c": torch.ones(3)}
    s.begin(1, {k: on_device(v, 0) for k, v in state.items()}, deferred=_all).wait()
    got = s.read(1)
    s.close()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert max(cut) > 1


# -- paced device copies ----------------------------------------------------------------------------
def test_cut_splits_large_contiguous_copies_into_whole_element_pieces() -> None:
    src, dst = torch.arange(250, dtype=torch.float32), torch.zeros(250)
    small = (torch.zeros(3), torch.ones(3))
    pieces = devmod.cut([(dst, src), small], 400)  # 100 float32 a piece
    assert [d.numel() for d, _ in pieces] == [100, 100, 50, 3]
    for d, s in pieces:
        d.copy_(s)
    assert torch.equal(dst, src)
    t = torch.zeros(4, 4).t()  # not contiguous: left whole
    assert len(devmod.cut([(t, t)], 8)) == 1


def _paced_store(tmp_path: Path, chunk: int) -> RankSnapshotStore:
    return RankSnapshotStore(shm_dir=tmp_path, job_id="p", rank=0, num_slots=2, device_chunk=chunk)


def test_deferred_device_copies_are_issued_a_few_chunks_at_a_time(tmp_path: Path, world: FakeCuda) -> None:
    """A 4000-byte deferred tensor, 400-byte chunks: begin issues none of it; the copier issues
    batches while at most COPIES_IN_FLIGHT are queued on the device, so with the device held it
    stops after depth + 1 batches (a GPU's copy engine runs copies in queue order: what is not
    queued cannot hold back another stream's copy), and the fence waits until the last is issued."""
    store = _paced_store(tmp_path, 400)
    try:
        w = torch.arange(1000, dtype=torch.float32)
        world.hold(0)
        pending = store.begin(1, {"w": on_device(w, 0)}, deferred=_all)
        assert world.blocked(0).wait(10), "the copier never waited for the oldest batch"
        (side,) = world.streams_made
        assert len(side.ops) == 1 + devmod.COPIES_IN_FLIGHT + 1  # wait for main, then 3 of 10 pieces
        fenced = threading.Event()
        threading.Thread(target=lambda: (pending.fence(), fenced.set()), daemon=True).start()
        assert not fenced.wait(0.3)  # 7 pieces not issued yet: nothing to make the stream wait on
        world.release(0)
        assert fenced.wait(10)
        assert len(side.ops) == 1 + 10
        world.run_main(0)  # the optimizer's stream waited for the last batch
        w.add_(1000)
        pending.wait()
        assert torch.equal(store.read(1)["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        store.close()


def test_a_deeper_queue_issues_more_batches_and_the_write_says_where_its_time_went(
    tmp_path: Path, world: FakeCuda
) -> None:
    """``device_depth=4``: with the device held the copier stops after 4 + 1 batches; once the
    device runs, the write's timeline counts its 10 batches, and the time the copier waited for
    a batch to land (the device held for 0.2 s) is within its issue time."""
    store = RankSnapshotStore(
        shm_dir=tmp_path, job_id="q", rank=0, num_slots=2, device_chunk=400, device_depth=4
    )
    try:
        world.hold(0)
        pending = store.begin(1, {"w": on_device(torch.arange(1000.0), 0)}, deferred=_all)
        assert world.blocked(0).wait(10), "the copier never waited for the oldest batch"
        (side,) = world.streams_made
        assert len(side.ops) == 1 + 4 + 1
        assert pending.timeline() is None  # not issued yet
        threading.Timer(0.2, world.release, args=(0,)).start()
        pending.wait()
        line = pending.timeline()
        assert line is not None and line["batches"] == 10
        assert 0.15 < line["landing_s"] <= line["issue_s"]
        assert 0.0 <= line["picked_up_s"] < line["issue_s"] + 10
        assert torch.equal(store.read(1)["w"], torch.arange(1000.0))
    finally:
        if 0 in world._held:
            world.release(0)
        store.close()


def test_a_store_refuses_a_device_queue_of_no_batch(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="at least one batch"):
        RankSnapshotStore(shm_dir=tmp_path, job_id="z", rank=0, num_slots=2, device_depth=0)


def test_unpaced_begin_issues_every_copy_itself(tmp_path: Path, world: FakeCuda) -> None:
    store = _paced_store(tmp_path, 0)
    try:
        world.hold(0)
        pending = store.begin(1, {"w": on_device(torch.arange(1000.0), 0)}, deferred=_all)
        (side,) = world.streams_made
        assert len(side.ops) == 2  # wait for main, the whole copy: issued by begin
        pending.fence()  # no host wait: the events exist
        world.release(0)
        pending.wait()
        assert torch.equal(store.read(1)["w"], torch.arange(1000.0))
    finally:
        store.close()


def test_paced_copies_of_two_devices_take_turns(tmp_path: Path, world: FakeCuda) -> None:
    store = _paced_store(tmp_path, 400)
    try:
        a, b = torch.arange(500.0), torch.arange(300.0) * 3
        pending = store.begin(1, {"a": on_device(a, 0), "b": on_device(b, 1)}, deferred=_all)
        pending.wait()
        got = store.read(1)
        assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
        assert sorted(len(s.ops) for s in world.streams_made) == [1 + 3, 1 + 5]
    finally:
        store.close()
