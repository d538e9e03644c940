"""The locked-memory preflight (issue 20; agent/memory.py): on a node whose ranks page-lock
their snapshot slots, slots that do not fit in ``RLIMIT_MEMLOCK`` fail the job with one line and
exit code 2. Unit tests use a fake limit and fake slot files; the process test lowers the real
soft limit of a CPU job and forces the check on (a CPU node pins nothing)."""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.agent.memory import CAP_IPC_LOCK, NodeMemory, has_ipc_lock, memlock_shortfall, pins_slots
from nonstop.devices.inventory import Devices
from nonstop.replica.peer import local_store_id
from nonstop.snapshot.nodecopy import shared_slot_path
from nonstop.snapshot.slot import slot_path

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def test_the_line_says_what_is_needed_and_how_to_raise_the_limit() -> None:
    assert memlock_shortfall(node="n0", num_slots=2, slot_bytes=MiB, limit=None) is None  # unlimited
    assert memlock_shortfall(node="n0", num_slots=2, slot_bytes=MiB, limit=2 * MiB) is None
    line = memlock_shortfall(node="n0", num_slots=2, slot_bytes=MiB, limit=64 * 1024)
    assert line is not None and "\n" not in line
    assert "node n0 page-locks 2.0 MiB" in line and "RLIMIT_MEMLOCK is 64.0 KiB" in line
    assert "ulimit -l unlimited" in line and "--ulimit memlock=-1" in line


def test_only_nodes_that_pin_are_checked() -> None:
    gpu = Devices(type="cuda", count=8)
    assert pins_slots(gpu, {}) is True
    assert pins_slots(Devices(), {}) is False  # a CPU node
    assert pins_slots(Devices(type="cuda", count=4, fake=True), {}) is False  # computes on the CPU
    assert pins_slots(gpu, {"NONSTOP_MEMLOCK_CHECK": "0"}) is False
    assert pins_slots(Devices(), {"NONSTOP_MEMLOCK_CHECK": "1"}) is True


def _memory(tmp_path: Path, *, pinned: bool, limit: int | None) -> tuple[NodeMemory, Path]:
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    mem = NodeMemory.open(
        node="n0",
        job_id="job",
        job_dir=tmp_path,
        shm_dir=shm,
        nproc=2,
        num_slots=2,
        replicas=0,
        pinned=pinned,
        memlock=lambda: limit,
    )
    return mem, shm


def _size_slot(shm: Path, rank: int, slot: int, nbytes: int) -> None:
    with open(slot_path(shm, local_store_id("job", "n0"), rank, slot), "wb") as f:
        f.truncate(nbytes)  # sparse: the size is what counts (what a rank registers)


def test_slots_larger_than_the_limit_fail_the_job_once_they_are_sized(tmp_path: Path) -> None:
    mem, shm = _memory(tmp_path, pinned=True, limit=MiB)
    assert mem.poll(now=1.0) is None  # no slot sized yet: nothing known
    _size_slot(shm, 0, 0, 256 * 1024)
    assert mem.poll(now=2.0) is None  # 2 x 256 KiB fit in 1 MiB
    _size_slot(shm, 1, 0, 768 * 1024)
    line = mem.poll(now=3.0)  # 2 x 768 KiB do not
    assert line is not None and "page-locks 1.5 MiB" in line and mem.error == line
    assert (tmp_path / "shm-short-n0.txt").read_text().strip() == line  # beside the space check's
    assert mem.poll(now=4.0) is None  # reported once


def test_a_node_copys_shared_slots_count_for_every_rank(tmp_path: Path) -> None:
    """With one copy per node a rank's own slots are small, and the node's shared slots -- any rank
    claims them in its turn and page-locks what it claimed -- hold the bulk: 2 x 64 KiB of its own
    and 3 x 512 KiB shared need 1.6 MiB of each rank's locked memory, more than 1 MiB."""
    mem, shm = _memory(tmp_path, pinned=True, limit=MiB)
    _size_slot(shm, 0, 0, 64 * 1024)
    assert mem.poll(now=1.0) is None
    shared = shared_slot_path(shm, local_store_id("job", "n0"), 0)
    with open(shared, "wb") as f:
        f.truncate(512 * 1024)
    line = mem.poll(now=2.0)
    assert line is not None and "page-locks 1.6 MiB" in line and "3 x 512.0 KiB shared" in line


@pytest.mark.parametrize(("pinned", "limit"), [(True, None), (False, MiB)])
def test_unlimited_or_unpinned_is_never_short(tmp_path: Path, pinned: bool, limit: int | None) -> None:
    mem, shm = _memory(tmp_path, pinned=pinned, limit=limit)
    _size_slot(shm, 0, 0, 8 * MiB)
    assert mem.poll(now=1.0) is None and mem.error is None


def _lower_memlock() -> None:
    """In the child before exec: a 64 KiB soft limit, and (as root) no CAP_IPC_LOCK after the exec,
    which would lift the limit (dropped from the bounding set: root's capabilities at exec)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    low = 64 * 1024 if hard == resource.RLIM_INFINITY else min(64 * 1024, hard)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (low, hard))
    if has_ipc_lock():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")


PR_CAPBSET_DROP = 24  # linux/prctl.h


def test_cap_ipc_lock_is_read_from_the_effective_set() -> None:
    status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t{}\n"
    assert has_ipc_lock(status.format("000001ffffffffff")) is True  # root
    assert has_ipc_lock(status.format("0000000000004000")) is True  # CAP_IPC_LOCK alone
    assert has_ipc_lock(status.format("000001ffffffbfff")) is False  # all but CAP_IPC_LOCK
    assert has_ipc_lock(status.format("0000000000000000")) is False  # an ordinary user
    assert has_ipc_lock("Name:\tx\n") is False and has_ipc_lock("CapEff:\tzz\n") is False


def test_a_process_with_cap_ipc_lock_is_not_held_to_the_limit(tmp_path: Path) -> None:
    """The limit as the agent sees it: the soft limit, or None (unlimited) where the kernel does
    not enforce it -- checked in a child that lowered its limit, with and without the capability."""
    code = (
        "import resource; from nonstop.agent.memory import soft_memlock_limit as f; "
        "print(f(), resource.getrlimit(resource.RLIMIT_MEMLOCK)[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, preexec_fn=_lower_memlock
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["65536", "65536"]  # capability dropped (or never held): the limit
    if has_ipc_lock():  # root here: the same child keeping the capability is not limited
        keep = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO,
            preexec_fn=lambda: resource.setrlimit(
                resource.RLIMIT_MEMLOCK, (64 * 1024, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1])
            ),
        )
        assert keep.stdout.split() == ["None", "65536"], keep.stderr


@pytest.mark.slow
def test_a_job_under_a_small_memlock_limit_exits_2_with_one_line(tmp_path: Path) -> None:
    """2 ranks of the tiny demo (~1.4 MiB a slot) under a 64 KiB ``ulimit -l``."""
    cmd = [
        str(Path(sys.executable).with_name("nonstop")), "run", "--nproc-per-node", "2",
        "--job-dir", str(tmp_path / "job"), "--shm-dir", str(tmp_path / "shm"),
        "-m", "nonstop.demo.train", "--steps", "6", "--model", "tiny", "--batch", "4",
        "--result", str(tmp_path / "result.json"),
    ]  # fmt: skip
    (tmp_path / "shm").mkdir()
    env = dict(os.environ, NONSTOP_MEMLOCK_CHECK="1")
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env, preexec_fn=_lower_memlock
    )
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("nonstop: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "locked memory: each rank of node" in errors[0] and "ulimit -l unlimited" in errors[0]
