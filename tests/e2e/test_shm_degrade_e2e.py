"""End to end: a real job whose memory tier fills up mid-run degrades instead of dying.

Issue 16, item 7: "a running job whose memory tier cannot grow degrades to fewer slots or the
durable tier instead of dying". A 3-rank tiny demo job (the ``reference_hash`` run's parameters)
keeps its slots in a small tmpfs of its own (``--shm-dir``); once the job is under way the test
fills that tmpfs with another file, as another process filling a container's ``/dev/shm`` would.

Why the moment of filling matters (snapshot/store.py, slot.py, space.py). A single-node job has
2 slots a rank. Slots are sized lazily, when a write first picks them: the first snapshot (step 0,
taken before any optimizer step: parameters only, ~0.45 MiB) sizes slot 0; the second (step 1,
parameters + AdamW's two moments, ~1.4 MiB) sizes slot 1; the third (step 2) picks slot 0 again
(the oldest, not the newest complete one) and must *grow* it by ~0.9 MiB. The node's start check
(:meth:`StoreRoom.check`) runs over a store's first ``num_slots`` writes and re-checks only a larger
size, so it last runs at step 1's write, with room to spare. The test fills the tmpfs (leaving
256 KiB) after every rank's snapshot of step 1 is complete and before any rank writes step 2 (rank
0 is held 3 s at the start of step 1 with a ``slow`` fault, so no rank can finish step 1 -- its
allreduce waits for rank 0 -- and snapshot step 2 inside that window). Every rank's step-2 write
then needs pages the tmpfs no longer has. Before commit e1a490a a slot was a sparse file grown with
``ftruncate`` alone, and the first store into such a page is a SIGBUS that kills the worker (over
and over, in every replacement: the job dies); now the growth reserves its pages
(``posix_fallocate``), gets ENOSPC, and the store drops that slot and goes on with one
(``memory_degraded``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nonstop.config import DetectorConfig
from nonstop.coordinator.loop import JobState
from nonstop.snapshot.api import SlotState
from nonstop.snapshot.slot import Slot
from nonstop.snapshot.space import free_bytes
from tests.conftest import DemoRun, events_named, leftovers, run_demo_job
from tests.tmpfs import fill_tmpfs, mount_tmpfs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NPROC = 3
LEAVE = 256 << 10  # free bytes left in the tmpfs: less than one slot's growth (~0.9 MiB)


@pytest.fixture
def small_shm() -> Iterator[Path]:
    """A 16 MiB tmpfs of the test's own (root only), unmounted afterwards whatever happens."""
    yield from mount_tmpfs("16m", name="degradeshm")


def _slot_steps(shm: Path, rank: int) -> list[tuple[SlotState, int]]:
    """(state, step) of every sized slot of ``rank`` in ``shm`` (any job: the tmpfs is the test's)."""
    out = []
    for path in sorted(shm.glob(f"nonstop-*-r{rank}-s*")):
        if ".rep-" in path.name:
            continue
        slot = Slot(path)
        try:
            info = slot.read_info(rank, 0)
        finally:
            slot.close()
        if info is not None:
            out.append((info.state, info.step))
    return out


def _fill_after_step_1(shm: Path, job: threading.Thread, seen: dict[str, Any]) -> None:
    """Once every rank's snapshot of step 1 is complete, fill ``shm`` up to LEAVE free bytes.
    Records in ``seen`` what the slots held at that moment (the test checks the timing)."""
    deadline = time.monotonic() + 240
    while job.is_alive() and time.monotonic() < deadline:
        slots = {r: _slot_steps(shm, r) for r in range(NPROC)}
        if all((SlotState.COMPLETE, 1) in s for s in slots.values()):
            fill_tmpfs(shm, LEAVE)
            seen["slots"] = {r: _slot_steps(shm, r) for r in range(NPROC)}
            seen["free"] = free_bytes(shm)
            return
        time.sleep(0.01)


def _events(job_dir: Path) -> list[dict[str, Any]]:
    """The job's event log so far (a line being appended is left for the next look)."""
    try:
        lines = (job_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            break
    return out


def _kill_rank_1_at_step_8(shm: Path, job_dir: Path, job: threading.Thread, seen: dict[str, Any]) -> None:
    """SIGKILL rank 1's worker while it is held at the start of step 8 (a ``slow`` fault), once
    every rank's one slot holds step 8 complete: the kill cannot tear the only snapshot the rank
    has (a kill racing its write would leave that rank no complete step in memory at all: with
    one slot, only a replica or the durable tier covers that moment, by design)."""
    deadline = time.monotonic() + 240
    while job.is_alive() and time.monotonic() < deadline:
        events = _events(job_dir)
        held = any(e["event"] == "fault_injected" and e["rank"] == 1 and e["step"] == 8 for e in events)
        if held and all((SlotState.COMPLETE, 8) in _slot_steps(shm, r) for r in range(NPROC)):
            spawn_id = next(
                e["spawn_id"]
                for e in events
                if e["event"] == "spawn" and e["role"] == "worker" and e["rank"] == 1
            )
            pid = next(e["pid"] for e in events if e["event"] == "spawned" and e["spawn_id"] == spawn_id)
            os.kill(pid, signal.SIGKILL)  # a worker of the test's own job
            seen["killed"] = pid
            return
        time.sleep(0.01)


def _run_filling(
    job_dir: Path, shm: Path, *, kill: bool, copies: str = "rank"
) -> tuple[DemoRun, dict[str, Any]]:
    # rank 0 is held 3 s at the start of step 1: the window to fill in (module docstring); with
    # ``kill``, rank 1 is held 3 s at the start of step 8: the window to kill it in
    faults = ("slow:rank=0,step=1,seconds=3",) + (("slow:rank=1,step=8,seconds=3",) if kill else ())
    runs: list[DemoRun] = []
    job = threading.Thread(
        target=lambda: runs.append(
            run_demo_job(
                job_dir,
                nproc=NPROC,
                shm_dir=shm,
                faults=faults,
                detector=DetectorConfig(hang_min_s=10.0),  # a 3 s hold is not a hang
                # the slot sizes above are a whole snapshot's, in each rank's own slots ("rank");
                # with one copy per node ("node") they are the node's shared writes'
                snapshot_copies=copies,
            )
        ),
        daemon=True,
    )
    seen: dict[str, Any] = {}
    job.start()
    _fill_after_step_1(shm, job, seen)
    if kill:
        _kill_rank_1_at_step_8(shm, job_dir, job, seen)
    job.join(timeout=300)
    assert not job.is_alive(), "the job did not finish in 300 s"
    assert runs, "the job raised (see the test's output)"
    return runs[0], seen


def _check_degraded_and_done(run: DemoRun, seen: dict[str, Any], shm: Path, reference_hash: str) -> None:
    # The timing the module docstring relies on: filled after step 1, before any rank wrote step 2.
    assert "slots" in seen, "the job never completed step 1's snapshots"
    for rank, slots in seen["slots"].items():
        assert max(step for _, step in slots) == 1, (rank, slots)
    assert seen["free"] <= LEAVE
    assert run.result.state is JobState.DONE, run.result.error
    assert run.out is not None
    assert run.out["final_hash"] == reference_hash
    degraded = events_named(run.events, "memory_degraded")
    assert degraded, "no memory_degraded event"
    assert {e["store"] for e in degraded} == {"local"}
    assert all(e["slots_left"] == 1 for e in degraded), degraded
    assert {e["rank"] for e in degraded} == set(range(NPROC))  # every rank's step-2 growth failed
    assert leftovers(run.job_id) == ([], [])  # nothing in /dev/shm, no process
    assert sorted(p.name for p in shm.iterdir()) == ["other-process-data"]  # the agent cleaned up


def test_a_job_whose_memory_fills_mid_run_degrades_and_finishes_bitwise(
    tmp_path: Path, small_shm: Path, reference_hash: str
) -> None:
    run, seen = _run_filling(tmp_path / "job", small_shm, kill=False)
    _check_degraded_and_done(run, seen, small_shm, reference_hash)
    assert run.result.failures == []
    assert len(events_named(run.events, "memory_degraded")) == NPROC


def test_a_kill_after_the_memory_degraded_still_recovers_bitwise(
    tmp_path: Path, small_shm: Path, reference_hash: str
) -> None:
    """With one slot a rank, a worker killed after the degradation is replaced by the hot spare,
    which maps the same slots, restores step 8 from the memory tier and goes on with one slot:
    the job still ends bitwise equal.

    The spare's store is new to the rank: before the fix beside this test its first write ran
    the node's start check again, which counted the dropped slots as still to be grown, found
    the (full) tmpfs too small and failed the running job with exit 2."""
    run, seen = _run_filling(tmp_path / "job", small_shm, kill=True)
    assert "killed" in seen, "rank 1 never reached step 8 with every rank's snapshot complete"
    _check_degraded_and_done(run, seen, small_shm, reference_hash)
    (f,) = run.result.failures
    assert (f["kind"], f["rank"], f["replacement"]) == ("kill", 1, "spare")
    assert f["restore_step"] == 8 and f["lost_steps"] == 0
    (gen2,) = [e for e in run.events if e["event"] == "generation" and e["generation"] == 2]
    assert gen2["tier"] == "memory"
    # the spare found slot 0 of rank 1 still too small to grow and dropped it in its turn
    after = run.events[run.events.index(gen2) :]
    assert [e["rank"] for e in events_named(after, "memory_degraded")] == [1]
    assert not (run.job_dir / "shm-short-0.txt").exists()


def test_with_one_copy_per_node_a_full_memory_tier_degrades_the_shared_slots_and_finishes_bitwise(
    tmp_path: Path, small_shm: Path, reference_hash: str
) -> None:
    """The same fill with one copy per node: the ranks' own slots (RNG, buffers, data position)
    never grow, the node's shared writes do. Step 2's claimer cannot grow the oldest shared slot
    nor size the spare one: it drops both (``memory_degraded``, store "shared") and overwrites
    the one left from then on, as a rank store does with one slot; the job finishes bitwise."""
    run, seen = _run_filling(tmp_path / "job", small_shm, kill=False, copies="node")
    assert "slots" in seen, "the job never completed step 1's snapshots"
    assert run.result.state is JobState.DONE, run.result.error
    assert run.out is not None and run.out["final_hash"] == reference_hash
    assert run.result.failures == []
    degraded = events_named(run.events, "memory_degraded")
    assert degraded and {e["store"] for e in degraded} == {"shared"}, degraded
    assert min(e["slots_left"] for e in degraded) == 1
    assert leftovers(run.job_id) == ([], [])
    assert sorted(p.name for p in small_shm.iterdir()) == ["other-process-data"]
