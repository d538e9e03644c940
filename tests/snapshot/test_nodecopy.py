"""One copy per node of the state a node's ranks hold alike: unit tests on real shared-memory files.

Two rank stores of one node (in one process, or a writer in a child process that dies) write
split snapshots through the node's shared slots; every read must equal what the rank wrote, a
copied-out snapshot must be byte for byte what a whole write gives, and a step is complete only
when both halves are.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from nonstop.errors import SnapshotCorruptError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.api import SlotState
from nonstop.snapshot.nodecopy import NodeCopy, SharedRef, node_slots, shared_slot_path
from nonstop.snapshot.slot import KEEP_PIN, slot_path
from nonstop.snapshot.split import encode_meta, ref_of

JOB = "j.0"


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g).half()}


def _state(rank: int, model: dict[str, torch.Tensor], step: int = 1) -> dict[str, object]:
    """A rank's state: the model (alike on every rank) and its own RNG, buffer and extras."""
    return {
        "step": step,
        "model": model,
        "buf": torch.full((5,), float(rank)),
        "rng": torch.arange(7, dtype=torch.uint8) + rank,
        "extras": {"rank": rank, "samples": 100 * rank + step},
    }


def _share(model: dict[str, torch.Tensor]):
    ptrs = {t.data_ptr() for t in model.values()}
    return lambda t: t.data_ptr() in ptrs


def _store(tmp: Path, rank: int, gen: int = 1, *, slots: int = 2, job: str = JOB) -> RankSnapshotStore:
    s = RankSnapshotStore(shm_dir=tmp, job_id=job, rank=rank, num_slots=slots)
    s.share_with(NodeCopy(shm_dir=tmp, job_id=job, num_slots=node_slots(slots)), gen)
    return s


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_two_ranks_keep_one_copy_and_each_reads_back_its_own_state(tmp_path: Path) -> None:
    model = _model(0)
    a, b = _store(tmp_path, 0), _store(tmp_path, 1)
    twin = {k: v.clone() for k, v in model.items()}  # rank 1's own tensors, equal to rank 0's
    a.write(1, _state(0, model), share=_share(model))
    b.write(1, _state(1, twin), share=_share(twin))
    assert _same(a.read(1), _state(0, model)) and _same(b.read(1), _state(1, model))
    assert a.complete_steps() == [1] and b.complete_steps() == [1]
    model_bytes = sum(t.numel() * t.element_size() for t in model.values())
    for s in (a, b):  # each rank slot holds only its own part
        inf = next(i for i in (s.info(0), s.info(1)) if i is not None and i.state is SlotState.COMPLETE)
        assert inf.data_len < model_bytes / 10
    shared = [p for p in tmp_path.iterdir() if "-n0-s" in p.name]
    assert len(shared) == 1  # rank 1 found rank 0's claim and copied nothing
    a.close(), b.close()


def test_a_split_snapshot_copied_out_is_byte_for_byte_a_whole_one(tmp_path: Path) -> None:
    model = _model(1)
    split, whole = _store(tmp_path, 2), RankSnapshotStore(shm_dir=tmp_path, job_id="whole", rank=2)
    split.write(4, _state(2, model, 4), share=_share(model))
    whole.write(4, _state(2, model, 4))
    got, want = split.copy_out(4), whole.copy_out(4)
    assert got.meta == want.meta
    assert np.array_equal(got.data, want.data)
    out = np.full(len(want.data) + 100, 0xAB, dtype=np.uint8)  # a reused buffer: padding zeroed
    again = split.copy_out(4, out=out)
    assert np.array_equal(again.data, want.data)
    split.close(), whole.close()


def test_a_reader_without_a_node_copy_finds_the_shared_half(tmp_path: Path) -> None:
    model = _model(2)
    w = _store(tmp_path, 0)
    w.write(3, _state(0, model, 3), share=_share(model))
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id=JOB, rank=0)  # the agent's view
    assert reader.complete_steps() == [3]
    assert _same(reader.read(3), _state(0, model, 3))
    reader.keep_only([3])
    shared = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3)
    pins = [shared.info(i).pinned for i in range(3) if shared.info(i) is not None]
    assert pins == [True]
    reader.keep_only([])
    assert not any(shared.info(i).pinned for i in range(3) if shared.info(i) is not None)
    reader.close(), w.close(), shared.close()


def test_a_step_is_incomplete_on_every_rank_until_the_shared_copy_lands(tmp_path: Path) -> None:
    model = _model(3)
    a, b = _store(tmp_path, 0), _store(tmp_path, 1)
    pending = a.begin(5, _state(0, model, 5), deferred=_share(model), share=_share(model))
    # rank 0's background copy may still run: hold it by waiting only after rank 1's write
    b.write(5, _state(1, model, 5), share=_share(model))
    pending.wait()
    assert b.complete_steps() == [5] and a.complete_steps() == [5]
    # now tear the shared write by hand: both ranks lose step 5
    node = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3)
    idx = next(i for i in range(3) if node.info(i) is not None and node.info(i).state is SlotState.COMPLETE)
    inf = node.info(idx)
    node.slot(idx).write_header(SlotState.WRITING, 5, 0, inf.meta_len, 0.0)
    assert a.complete_steps() == [] and b.complete_steps() == []
    with pytest.raises(SnapshotMissingError):
        b.read(5)
    with pytest.raises(SnapshotMissingError):
        b.copy_out(5)
    assert b.writing_step({os.getpid()}) == 5  # a live process holds the shared write
    assert b.writing_step(set()) is None
    a.close(), b.close(), node.close()


def _claim_and_die(tmp: str) -> None:
    model = _model(4)
    s = _store(Path(tmp), 0)
    s.begin(6, _state(0, model, 6), deferred=lambda t: True, share=_share(model))
    os._exit(0)  # killed before its copy completes (the copier thread never runs again)


def test_a_claim_whose_writer_died_is_taken_over(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_claim_and_die, args=(str(tmp_path),))
    p.start()
    p.join(30)
    model = _model(4)
    b = _store(tmp_path, 1)
    b.write(6, _state(1, model, 6), share=_share(model))
    assert b.complete_steps() == [6]
    assert _same(b.read(6), _state(1, model, 6))
    b.close()


def test_a_step_redone_in_a_new_generation_is_a_new_write(tmp_path: Path) -> None:
    old, new = _model(5), _model(6)
    a = _store(tmp_path, 0, gen=1)
    a.write(7, _state(0, old, 7), share=_share(old))
    b = _store(tmp_path, 1, gen=2)  # after a rollback, step 7 again with other values
    b.write(7, _state(1, new, 7), share=_share(new))
    assert _same(b.read(7), _state(1, new, 7))
    assert _same(a.read(7), _state(0, old, 7))  # the old timeline's write is left as it was
    a.close(), b.close()


def test_another_layout_or_no_free_slot_falls_back_to_a_whole_write(tmp_path: Path) -> None:
    model = _model(7)
    a, b = _store(tmp_path, 0), _store(tmp_path, 1)
    a.write(1, _state(0, model), share=_share(model))
    other = {"w": torch.zeros(3, 3)}
    b.write(1, _state(1, other), share=_share(other))  # another layout: refused
    assert _same(b.read(1), _state(1, other))
    assert ref_of(bytes(_rank_meta(tmp_path, 1))) is None
    # every shared slot held by readers: no claim, a whole write
    node = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3)
    for s in range(2, 5):
        a.write(s, _state(0, model, s), share=_share(model))
    assert [node.info(i) is not None for i in range(3)] == [True, True, False]  # the spare one unused
    node.slot(2).ensure_capacity(1, 1)
    for i in range(3):
        assert node.info(i) is not None  # (maps the slot)
        node.slot(i).set_pinned(True, KEEP_PIN)
    a.write(9, _state(0, model, 9), share=_share(model))
    assert _same(a.read(9), _state(0, model, 9))
    assert ref_of(bytes(_rank_meta(tmp_path, 0))) is None  # written whole
    a.close(), b.close(), node.close()


def _rank_meta(tmp: Path, rank: int) -> bytes:
    s = RankSnapshotStore(shm_dir=tmp, job_id=JOB, rank=rank)
    try:
        inf = max((i for i in (s.info(0), s.info(1)) if i is not None), key=lambda i: i.written_at)
        return bytes(s._slots[inf.slot].meta_view()[: inf.meta_len])
    finally:
        s.close()


def test_a_split_meta_that_lies_is_corrupt_not_a_crash(tmp_path: Path) -> None:
    model = _model(8)
    a = _store(tmp_path, 0)
    a.write(1, _state(0, model), share=_share(model))
    meta = _rank_meta(tmp_path, 0)
    ref = ref_of(meta)
    assert ref == SharedRef(1, 1, ref.base)
    # a base inside the rank's own data, and one far past the shared data
    for base in (0, 1 << 40):
        bad = encode_meta(SharedRef(1, 1, base), '{"x":1}', "[]")
        path = slot_path(tmp_path, JOB, 0, 0)
        assert path.exists()
        store = RankSnapshotStore(shm_dir=tmp_path, job_id=JOB, rank=0)
        inf = next(i for i in (store.info(0), store.info(1)) if i is not None and i.step == 1)
        slot = store._slots[inf.slot]
        slot.meta_view()[: len(bad)] = bad
        slot.write_header(SlotState.COMPLETE, 1, inf.data_len, len(bad), inf.written_at + 1)
        if base == 0 and inf.data_len > 0:
            with pytest.raises(SnapshotCorruptError):
                store.read(1)
        store.close()
    assert ref_of(b"garbage") is None and ref_of(b'{"shared":[1,2],"tree":') is None
    a.close()


def test_shared_slots_are_named_apart_from_rank_slots(tmp_path: Path) -> None:
    from nonstop.agent.processes import ranks_with_segments

    model = _model(9)
    a = _store(tmp_path, 3)
    a.write(1, _state(3, model), share=_share(model))
    assert shared_slot_path(tmp_path, JOB, 0).exists()
    assert ranks_with_segments(tmp_path, JOB) == [3]
    a.close()


def test_a_slot_that_held_a_whole_snapshot_gives_its_pages_back_and_takes_them_again(tmp_path: Path) -> None:
    """An install (a fetched or durable snapshot, whole) leaves a slot as large as the whole state;
    the next split write there gives back the pages past its own part, and a later whole write
    allocates them again before copying (never a SIGBUS on a full memory filesystem)."""
    big = {"w": torch.randn(1024, 1024)}  # 4 MiB
    whole = RankSnapshotStore(shm_dir=tmp_path, job_id="whole", rank=0)
    whole.write(1, _state(0, big, 1))
    raw = whole.copy_out(1)
    a = _store(tmp_path, 0)
    for s in (1, 2):  # both slots take the whole snapshot (as installs would)
        a.write_raw(s, raw.meta, raw.data)

    def held() -> int:
        return sum(os.stat(p).st_blocks * 512 for p in tmp_path.glob(f"nonstop-{JOB}-r0-s*"))

    before = held()
    assert before > 8 << 20
    a.write(3, _state(0, big, 3), share=_share(big))
    a.write(4, _state(0, big, 4), share=_share(big))
    assert held() < 1 << 20  # both rank slots now hold only their own part
    assert _same(a.read(4), _state(0, big, 4))
    a.write_raw(5, raw.meta, raw.data)  # whole again: its pages allocated again first
    assert _same(a.read(5), _state(0, big, 1)) and held() > 4 << 20
    a.close(), whole.close()


def _claim_only_and_die(tmp: str) -> None:
    node = NodeCopy(shm_dir=Path(tmp), job_id=JOB, num_slots=3)
    assert node.claim(gen=1, step=5, key="k", data_len=64, pin=False) is not None
    os._exit(0)


def test_a_reader_never_takes_a_torn_claim_for_the_new_one_in_its_slot(tmp_path: Path) -> None:
    """Gen 1's claimer of step 5 dies mid-copy; gen 2's claimer of step 5 takes its slot (same step,
    same record length, both WRITING). A node copy that saw the first claim must see the second:
    a third rank joins it instead of claiming step 5 a second time elsewhere."""
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_claim_only_and_die, args=(str(tmp_path),))
    p.start()
    p.join(30)
    seen, first = (
        NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3),
        NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3),
    )
    assert seen.find(SharedRef(2, 5, 0)) is None  # (it has read gen 1's torn claim)
    taken = first.claim(gen=2, step=5, key="k", data_len=64, pin=False)
    assert taken is not None and taken.writer
    joined = seen.claim(gen=2, step=5, key="k", data_len=64, pin=False)
    assert joined is not None and not joined.writer and joined.index == taken.index
    seen.close(), first.close()


def test_threads_reading_through_one_store_survive_its_slots_being_remapped(tmp_path: Path) -> None:
    """The node agent's threads (persister, replicator, data plane) read through one store per
    rank; a slot whose file grew or was replaced is mapped afresh by whichever thread sees it
    first. The others go on through the old mapping (never closed under them): no thread ever
    meets a closed mapping, only, at worst, a write that raced it (SnapshotMissingError)."""
    import threading

    w = _store(tmp_path, 0)
    reader = RankSnapshotStore(shm_dir=tmp_path, job_id=JOB, rank=0)
    errors: list[BaseException] = []
    done = threading.Event()
    copied = [0]

    def read() -> None:
        while not done.is_set():
            try:
                steps = reader.complete_steps()
                if steps:
                    reader.copy_out(steps[-1])
                    reader.copy_out(steps[-1], split=True)
                    copied[0] += 1
            except SnapshotMissingError:
                pass  # overwritten while copied: a reader retries with a newer step
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for step in range(1, 120):
            model = {"w": torch.full((64 * step,), float(step))}  # grows: each slot is remapped
            w.write(step, _state(0, model, step), share=_share(model))
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
    assert not errors, repr(errors[:3])
    assert copied[0] > 0
    w.close()
    reader.close()


def test_with_one_shared_slot_a_rank_a_step_behind_holds_nothing_whole_until_its_part_lands(
    tmp_path: Path,
) -> None:
    """A degraded node (one shared slot): rank 0's snapshot of step 2 overwrites the shared write
    rank 1's part of step 1 names, so rank 1 holds no whole step until it writes its part of step
    2. An inventory taken then found no step for every rank and failed the job (a re-plan under a
    CPU load); ``behind_shared`` tells it to wait for that part, as for a writer."""

    def store(rank: int) -> RankSnapshotStore:
        s = RankSnapshotStore(shm_dir=tmp_path, job_id=JOB, rank=rank, num_slots=2)
        s.share_with(NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=1), 1)
        return s

    a, b = store(0), store(1)
    model = _model(4)
    twin = {k: v.clone() for k, v in model.items()}
    a.write(1, _state(0, model, 1), share=_share(model))
    b.write(1, _state(1, twin, 1), share=_share(twin))
    assert not b.behind_shared({os.getpid()})  # whole: nothing to wait for
    a.write(2, _state(0, model, 2), share=_share(model))
    assert a.complete_steps() == [2] and b.complete_steps() == []
    assert b.behind_shared({os.getpid()}) and not a.behind_shared({os.getpid()})
    assert not b.behind_shared(set())  # its writer is gone: it will never write step 2
    b.write(2, _state(1, twin, 2), share=_share(twin))
    assert b.complete_steps() == [2] and not b.behind_shared({os.getpid()})
    a.close(), b.close()
