"""The agent's second opinion on a silent worker (agent/silence.py), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nonstop.agent import silence

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux procfs")


@contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _settled(proc: subprocess.Popen[bytes]) -> None:
    """Wait until the child stands still (its interpreter's start-up burns CPU)."""
    for _ in range(100):
        if silence.judge(proc.pid, window_s=0.1).kind == "still":
            return
    pytest.fail("the sleeping child never stood still")


def test_a_process_asleep_is_still_and_hung() -> None:
    with _child("import time; time.sleep(60)") as proc:
        _settled(proc)
        verdict = silence.judge(proc.pid)
        assert verdict.kind == "still" and verdict.hung, verdict
        assert "state S" in verdict.detail


def test_a_stopped_process_is_hung_without_watching_it() -> None:
    with _child("import time; time.sleep(60)") as proc:
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):  # (the stop takes effect when the child is next scheduled)
            verdict = silence.judge(proc.pid, window_s=10.0) if _state(proc.pid) in "Tt" else None
            if verdict is not None:
                break
            os.sched_yield()
        assert verdict is not None and verdict.kind == "stopped" and verdict.hung, verdict


def test_a_process_burning_cpu_with_the_gil_held_moves_and_is_spared() -> None:
    """The ``spin`` fault's wedge: no Python thread of it can run, yet the process moves."""
    with _child('import re\nwhile True: re.match(r"(x+x+)+y", "x" * 64)') as proc:
        verdict = silence.judge(proc.pid)
        assert verdict.kind == "moving" and not verdict.hung, verdict
        assert "ms on a CPU" in verdict.detail


def test_a_process_that_is_gone_cannot_be_read_and_counts_as_hung() -> None:
    with _child("pass") as proc:
        proc.wait()
    verdict = silence.judge(proc.pid)
    assert verdict.kind == "unknown" and verdict.hung


def test_the_state_is_read_after_a_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "7" / "task" / "7").mkdir(parents=True)
    (tmp_path / "7" / "stat").write_text("7 (a (b) c) R 1 7 7 0 -1\n")
    (tmp_path / "7" / "task" / "7" / "schedstat").write_text("5000000 7000000 12\n")
    seen = silence.motion(7, proc=str(tmp_path))
    assert seen == silence.Motion(state="R", cpu_ns=5_000_000, wait_ns=7_000_000)


def _state(pid: int) -> str:
    m = silence.motion(pid)
    return m.state if m is not None else "?"


def test_a_process_with_a_runnable_thread_moves_though_its_clocks_barely_did(tmp_path: Path) -> None:
    """A thread in state R wants a CPU: not stuck, whatever its clocks did in the short look
    (found in CI: a healthy rank killed as still with 1.4 ms on a CPU, state R)."""
    task = tmp_path / "7" / "task"
    for tid, state in (("7", "S"), ("8", "R")):
        (task / tid).mkdir(parents=True)
        (task / tid / "stat").write_text(f"{tid} (python) {state} 1 7 7 0 -1\n")
        (task / tid / "schedstat").write_text("5000000 7000000 12\n")
    (tmp_path / "7" / "stat").write_text("7 (python) S 1 7 7 0 -1\n")
    verdict = silence.judge(7, window_s=0.01, proc=str(tmp_path))
    assert verdict.kind == "moving" and not verdict.hung, verdict
    (task / "8" / "stat").write_text("8 (python) S 1 7 7 0 -1\n")
    assert silence.judge(7, window_s=0.01, proc=str(tmp_path)).kind == "still"
