"""A thread moved if it ran or waited for a CPU: the heartbeat's ``moving`` (train/threadprogress.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from nonstop.train.threadprogress import MOVING_WAIT_S, ThreadProgress, run_queue_s

needs_schedstat = pytest.mark.skipif(
    run_queue_s(threading.get_native_id()) is None, reason="this kernel keeps no schedstat"
)


class Scripted(ThreadProgress):
    """Clock readings given in order: (CPU seconds, run-queue seconds)."""

    def __init__(self, *readings: tuple[float | None, float | None]) -> None:
        super().__init__()
        self.readings = iter(readings)

    def _read(self) -> tuple[float | None, float | None]:
        return next(self.readings)


def test_a_thread_that_only_waited_for_a_cpu_moved() -> None:
    p = Scripted((1.0, 2.0), (1.0, 2.5), (1.0, 2.5), (1.5, 2.5), (1.5, 2.5 + MOVING_WAIT_S / 2))
    assert p.moved() is False  # the first look: nothing to compare with
    assert p.moved() is True  # no CPU, half a second on the run queue: starved, not stuck
    assert p.moved() is False  # neither: asleep or blocked
    assert p.moved() is True  # ran
    assert p.moved() is False  # a wake-up's few microseconds of waiting are not moving


def test_one_clock_is_enough_and_none_is_unknown() -> None:
    assert Scripted((None, None)).moved() is None
    cpu_only = Scripted((1.0, None), (2.0, None), (2.0, None))
    assert [cpu_only.moved() for _ in range(3)] == [False, True, False]
    wait_only = Scripted((None, 1.0), (None, 2.0))
    assert [wait_only.moved() for _ in range(2)] == [False, True]


def test_no_schedstat_for_no_thread_or_one_not_of_this_process() -> None:
    assert run_queue_s(None) is None
    assert run_queue_s(2**22 + 1) is None  # above the kernel's largest pid_max: no such task anywhere
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert run_queue_s(child.pid) is None  # another process's thread is not one of ours
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def one_core() -> Iterator[int]:
    """A core with a CPU hog process pinned to it, for a test's thread to share."""
    core = min(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    hog = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield core
    finally:
        hog.kill()
        hog.wait()


def blocked_reading(tid: int, fd: int) -> bool | None:
    """Whether thread ``tid`` of this process sits in a system call whose first argument is
    ``fd`` (a read of it); None where the kernel does not say (no ``/proc/<pid>/task/<tid>/syscall``)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    return len(fields) > 1 and fields[0] != "running" and int(fields[1], 16) == fd


@needs_schedstat
def test_a_thread_asleep_does_not_move_and_one_sharing_a_busy_core_waits(one_core: int) -> None:
    stop = threading.Event()
    asleep = ThreadProgress()
    busy = ThreadProgress()
    ready = threading.Barrier(3)
    wake_r, wake_w = os.pipe()

    def sleeper() -> None:
        nonlocal asleep
        asleep = ThreadProgress.of_this_thread()
        ready.wait()
        os.read(wake_r, 1)  # blocked in the kernel, without the GIL, until the test ends

    def spinner() -> None:
        nonlocal busy
        os.sched_setaffinity(0, {one_core})  # this thread only: it shares the hog's core
        busy = ThreadProgress.of_this_thread()
        ready.wait()
        while not stop.is_set():
            sum(range(10_000))

    threads = [threading.Thread(target=sleeper), threading.Thread(target=spinner)]
    for t in threads:
        t.start()
    ready.wait()
    try:
        # past the barrier the sleeper still has to reach its read, which on a loaded machine (the
        # GIL shared with the spinner, the cores with the hog) takes CPU and run-queue time: wait
        # until the kernel says it is blocked there, then watch it for a second
        assert asleep._tid is not None
        deadline = time.monotonic() + 60.0
        while not (there := blocked_reading(asleep._tid, wake_r)) and time.monotonic() < deadline:
            if there is None:
                pytest.skip("this kernel does not show a thread's system call")
            time.sleep(0.05)
        assert there, "the sleeper never reached its read"
        assert busy.moved() is False  # the first looks: nothing to compare with
        assert asleep.moved() is False
        waited = run_queue_s(busy._tid)
        time.sleep(1.0)
        assert asleep.moved() is False
        assert busy.moved() is True
        later = run_queue_s(busy._tid)
        assert (
            waited is not None and later is not None and later - waited > 0.05
        )  # half its core's time, less
    finally:
        stop.set()
        os.write(wake_w, b"x")
        for t in threads:
            t.join()
        os.close(wake_r)
        os.close(wake_w)
