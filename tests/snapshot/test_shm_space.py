"""The memory tier on a small memory filesystem (snapshot/space.py, agent/memory.py).

Each test mounts its own small tmpfs (root only; skipped otherwise), as a container's 64 MiB
``/dev/shm`` would be: a job whose slots cannot fit fails at start with one line and exit code 2;
slot pages are reserved when a slot is sized (ENOSPC then, never SIGBUS later); a store whose
slot cannot grow goes on with fewer slots and says so in the job's event log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nonstop.events.log import read_events
from nonstop.snapshot.nodecopy import shared_slot_path
from nonstop.snapshot.slot import ShmFullError, Slot
from nonstop.snapshot.space import (
    NodePlan,
    ShmSpaceError,
    StoreRoom,
    plan_path,
    shortfall,
    slot_bytes,
    write_plan,
)
from nonstop.snapshot.store import RankSnapshotStore
from tests.tmpfs import fill_tmpfs, mount_tmpfs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def shm4(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs("4m")


@pytest.fixture
def shm16(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs("16m")


def test_a_full_tmpfs_fails_at_allocation_not_with_sigbus(shm4: Path) -> None:
    """Sizing a slot reserves its pages: with no room it raises ShmFullError (a slot of the
    wanted size would otherwise be a sparse file whose first write past the room is a SIGBUS)."""
    store = RankSnapshotStore(shm_dir=shm4, job_id="t1", rank=0, num_slots=2)
    try:
        with pytest.raises(ShmFullError):
            store.write(1, {"w": torch.ones(8 << 20, dtype=torch.uint8)})  # 8 MiB > 4 MiB
        assert store.usable_slots == 0
        assert sum(os.stat(p).st_blocks for p in shm4.iterdir()) == 0  # nothing stays allocated
    finally:
        store.close()


def test_a_slot_is_extended_only_once_its_pages_are_allocated(
    shm4: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process maps a slot at the file's size: were the file extended before its pages
    are allocated, that reader's first look at a new slot's header on a full tmpfs would be a
    SIGBUS (seen: a node agent's persister reading a shared slot a rank was sizing). So the size
    is the allocation's (``posix_fallocate``), and a failed one leaves the file as it was."""
    seen: list[int] = []
    allocate = os.posix_fallocate

    def watched(fd: int, offset: int, length: int) -> None:
        seen.append(os.fstat(fd).st_size)
        allocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", watched)
    slot = Slot(shm4 / "nonstop-t7-r0-s0")
    try:
        slot.ensure_capacity(1 << 20, 100)
        assert seen == [0] and os.stat(slot.path).st_size > 1 << 20
        size = os.stat(slot.path).st_size
        with pytest.raises(ShmFullError):
            slot.ensure_capacity(8 << 20, 100)
        assert seen[1] == size and os.stat(slot.path).st_size == size
    finally:
        slot.close()


def test_a_store_that_cannot_grow_goes_on_with_fewer_slots(shm16: Path, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    plan = NodePlan(
        node="0", job_dir=str(job_dir), shm_dir=str(shm16), num_slots=3, local_ranks=1, store_ids=("t2",)
    )
    write_plan(plan, "t2")
    store = RankSnapshotStore(shm_dir=shm16, job_id="t2", rank=0, num_slots=3)
    try:
        small = {"w": torch.full((1 << 20,), 1, dtype=torch.uint8)}
        for step in (1, 2, 3):
            store.write(step, small)
        assert store.usable_slots == 3
        fill_tmpfs(shm16, leave=int(2.5 * (1 << 20)))  # room for one slot's growth of 2 MiB, not two
        for step in (4, 5, 6, 7):  # the state grew: 3 MiB a slot
            store.write(step, {"w": torch.full((3 << 20,), step, dtype=torch.uint8)})
            assert int(store.read(step)["w"][0]) == step  # every write still lands
        assert store.usable_slots == 1
        assert store.complete_steps()[-1] == 7
        degraded = [e for e in read_events(job_dir / "events.jsonl") if e["event"] == "memory_degraded"]
        assert [e["slots_left"] for e in degraded] == [2, 1]
        assert degraded[0]["store"] == "local" and degraded[0]["rank"] == 0
    finally:
        store.close()
        plan_path(shm16, "t2").unlink()


def test_the_start_check_counts_every_slot_of_the_node(shm4: Path, tmp_path: Path) -> None:
    plan = NodePlan(
        node="1", job_dir=str(tmp_path), shm_dir=str(shm4), num_slots=2, local_ranks=2,
        replica_ranks=2, replica_slots=3, store_ids=("t3",),
    )  # fmt: skip
    assert shortfall(plan, 256 << 10) is None  # 10 slots of 256 KiB fit in 4 MiB
    line = shortfall(plan, 1 << 20)
    assert line is not None and "\n" not in line
    assert "needs 10.0 MiB" in line and "2 rank(s) x 2 slots + 2 replica(s) x 3 slots" in line
    assert "--shm-dir DIR" in line and "--shm-size=1g" in line and "medium: Memory" in line


def test_with_a_node_copy_the_check_counts_the_shared_slots_once_per_node(shm4: Path, tmp_path: Path) -> None:
    plan = NodePlan(
        node="1", job_dir=str(tmp_path), shm_dir=str(shm4), num_slots=2, local_ranks=8,
        replica_ranks=8, replica_slots=3, store_ids=("t4",),
    )  # fmt: skip
    assert shortfall(plan, 400 << 10, node_slots=3) is None  # 3 + 4 slots: 2.8 MiB, not 16 x 400 KiB
    assert shortfall(plan, 400 << 10) is not None  # one copy per rank: 40 slots
    line = shortfall(plan, 1 << 20, node_slots=3)
    assert line is not None and "needs 7.0 MiB" in line and "3 shared slots + 4 for replicas" in line


def test_the_shared_start_check_is_the_nodes_whichever_rank_claims(shm16: Path, tmp_path: Path) -> None:
    """The node's ranks take turns claiming its shared writes: the start check follows the
    node's shared slots, not each rank's own count of claims. Rank 1 claims step 0 (small, before
    any optimizer step), rank 0 step 1 (the full size: checked though rank 0's first claim finds a
    slot sized), the memory tier then fills, and rank 1's claim of step 2 at that size is not
    checked again (its slot's growth degrades instead of failing the running job)."""
    plan = NodePlan(
        node="0", job_dir=str(tmp_path), shm_dir=str(shm16), num_slots=2, local_ranks=2, store_ids=("t6",)
    )
    write_plan(plan, "t6")
    rooms = [StoreRoom(shm_dir=shm16, store_id="t6", rank=r, num_slots=3, shared=True) for r in (0, 1)]

    def sized(slot: int, data_len: int) -> None:
        os.truncate(shared_slot_path(shm16, "t6", slot), slot_bytes(data_len, 100))

    try:
        for slot in range(3):
            shared_slot_path(shm16, "t6", slot).touch()
        rooms[1].check_shared(1 << 20, 100, 3)
        sized(0, 1 << 20)
        with pytest.raises(ShmSpaceError, match="3 shared slots"):
            rooms[0].check_shared(8 << 20, 100, 3)  # 3 x 8 MiB > 16 MiB: checked at rank 0's first claim
        rooms[0].check_shared(3 << 20, 100, 3)
        sized(1, 3 << 20)
        fill_tmpfs(shm16, leave=1 << 20)
        rooms[1].check_shared(3 << 20, 100, 3)  # a size slot 1 has: not checked again
        sized(2, 3 << 20)
        rooms[0].check_shared(12 << 20, 100, 3)  # every shared slot sized: the start is over
    finally:
        plan_path(shm16, "t6").unlink()


@pytest.mark.slow
def test_a_job_whose_slots_do_not_fit_fails_at_start_with_exit_2(shm4: Path, tmp_path: Path) -> None:
    """2 ranks of the tiny demo (1.4 MiB a snapshot) need 4 slots: more than a 4 MiB /dev/shm."""
    job_dir = tmp_path / "job"
    cmd = [
        str(Path(sys.executable).with_name("nonstop")), "run", "--nproc-per-node", "2",
        "--job-dir", str(job_dir),
        "--shm-dir", str(shm4), "-m", "nonstop.demo.train", "--steps", "6", "--model", "tiny",
        "--batch", "4", "--result", str(tmp_path / "result.json"),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("nonstop: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "snapshot memory: node 0 needs" in errors[0] and "--shm-dir DIR" in errors[0]
    # once: not also by each rank, nor as the node agent's log line
    assert (done.stdout + done.stderr).count("snapshot memory: node 0 needs") == 1, done.stdout + done.stderr
    assert not (tmp_path / "result.json").exists()
    assert not [p for p in shm4.iterdir() if p.name.startswith("nonstop-")]  # nothing left behind
    failed = [e for e in read_events(job_dir / "events.jsonl") if e["event"] == "job_failed"]
    assert failed and "snapshot memory" in json.dumps(failed[0])
