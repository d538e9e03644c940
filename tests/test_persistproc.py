"""Persist writes run in a child process at nice 19 (nonstop/snapshot/persistproc.py): a
low-priority *thread* held its process's GIL while the kernel left it unscheduled, and a node
agent's loop stalled long enough to fence itself (no lease renewal acknowledged)."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest

from nonstop.errors import SnapshotMissingError
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.persistproc import PersistProcess, PersistProcessError
from nonstop.snapshot.store import RankSnapshotStore
from tests.persisting import state_of, trained

WORLD = 2


def _slots(tmp: Path) -> tuple[Path, str, list[RankSnapshotStore]]:
    shm = tmp / "shm"
    shm.mkdir()
    job = f"t{secrets.token_hex(4)}"
    return shm, job, [RankSnapshotStore(shm_dir=shm, job_id=job, rank=r) for r in range(WORLD)]


def _commit(root: Path, proc: PersistProcess, step: int, codec: CodecConfig) -> dict:
    durable = DurableStore(root)
    with durable.begin(step, WORLD, codec.describe()) as writer:
        out = proc.write(url=durable.url, step=step, world_size=WORLD, ranks=list(range(WORLD)), codec=codec)
        for doc in out["records"]:
            writer.adopt(doc)
        writer.commit()
    return out


def test_the_child_writes_what_the_slots_hold_at_nice_19_and_a_dead_child_is_replaced(tmp_path: Path) -> None:
    shm, job, stores = _slots(tmp_path)
    codec = CodecConfig()
    states = [state_of(*trained(seed=r), 3, {"r": r}) for r in range(WORLD)]
    for store, st in zip(stores, states, strict=True):
        store.write(3, st)
    proc = PersistProcess(shm_dir=shm, store_id=job, num_slots=stores[0].num_slots)
    try:
        out = _commit(tmp_path / "ckpt", proc, 3, codec)
        assert out["full"] and out["raw"] > 0 and out["stored"] > 0
        assert proc._proc is not None
        child = proc._proc.pid
        assert os.getpriority(os.PRIO_PROCESS, child) == 19  # training first
        loaded = DurableStore(tmp_path / "ckpt").load(3)
        for r, store in enumerate(stores):
            assert bytes(loaded.data(r)) == store.copy_out(3).data.tobytes()

        # a job's SIGTERM (sent to its process group) leaves it be: the final persist needs it
        os.kill(child, signal.SIGTERM)
        time.sleep(0.2)
        assert proc._proc.poll() is None

        # a step the slots do not hold: the caller's error to act on (take a newer step)
        with pytest.raises(SnapshotMissingError):
            proc.write(url=str(tmp_path / "other"), step=99, world_size=WORLD, ranks=[0], codec=codec)

        # the child dies during a write (stopped first, so the write cannot finish before): that
        # write fails with a clear error, and the next one starts a new child
        os.kill(child, signal.SIGSTOP)
        errors: list[BaseException] = []

        def write() -> None:
            try:
                proc.write(url=str(tmp_path / "other"), step=3, world_size=WORLD, ranks=[0], codec=codec)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=write)
        t.start()
        time.sleep(0.3)
        os.kill(child, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], PersistProcessError)
        assert "died" in str(errors[0])
        for store, st in zip(stores, states, strict=True):
            store.write(4, st)
        out = _commit(tmp_path / "ckpt", proc, 4, codec)
        assert proc._proc is not None and proc._proc.pid != child
        assert out["full"]  # a new child has no delta base
    finally:
        proc.close()
        for s in stores:
            s.clear()
            s.close()
    assert proc._proc is None
