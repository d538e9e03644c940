"""The agent with real child processes and real signals."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from nonstop.agent.gc import collect_garbage
from nonstop.agent.processes import Agent
from nonstop.snapshot import RankSnapshotStore


def _agent(tmp_path: Path, code: str) -> Agent:
    return Agent(
        job_id="a1b2c3",
        job_dir=tmp_path,
        shm_dir=tmp_path,
        command=[sys.executable, "-c", code],
        env=dict(os.environ),
        redirect_output=True,
    )


def _poll_until(agent: Agent, n: int, timeout: float = 10.0) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += agent.poll()
        time.sleep(0.01)
    return out


def test_exit_is_reported_once_with_its_code(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "import sys; sys.exit(7)")
    sid = agent.spawn("worker")
    assert _poll_until(agent, 1) == [(sid, 7)]
    assert agent.poll() == []


def test_kill_is_reported_as_the_signal(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "import time; time.sleep(60)")
    sid = agent.spawn("worker")
    agent.kill(sid, signal.SIGKILL)
    assert _poll_until(agent, 1) == [(sid, -signal.SIGKILL)]


def test_shutdown_stops_even_stopped_children_and_removes_shared_memory(tmp_path: Path) -> None:
    agent = _agent(
        tmp_path, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    )
    sids = [agent.spawn("worker") for _ in range(2)] + [agent.spawn("spare")]
    pids = [agent.pid(s) for s in sids]
    agent.kill(sids[0], signal.SIGSTOP)
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="a1b2c3", rank=0)
    store.write(1, {"x": [1, 2]})
    store.close()
    assert list(tmp_path.glob("nonstop-a1b2c3-*"))
    t0 = time.monotonic()
    agent.shutdown(grace_s=0.5)
    assert time.monotonic() - t0 < 5
    assert agent.procs == {}
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not list(tmp_path.glob("nonstop-a1b2c3-*"))


def test_children_run_in_their_own_session(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "import time; time.sleep(60)")
    sid = agent.spawn("worker")
    pid = agent.pid(sid)
    assert pid is not None and os.getsid(pid) == pid  # Ctrl-C in the terminal does not reach it
    agent.shutdown(grace_s=0.5)


def test_gc_removes_orphans_but_not_live_jobs(tmp_path: Path) -> None:
    import fcntl

    for job in ("deadbeef0001", "deadbeef0002"):
        s = RankSnapshotStore(shm_dir=tmp_path, job_id=job, rank=0)
        s.write(0, {"w": [1]})
        s.close()
    live = tmp_path / "nonstop-deadbeef0002.lock"
    fd = os.open(live, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    (tmp_path / "nonstop-deadbeef0001.lock").write_text("{}")  # its launcher is gone: lock is free
    try:
        dry = collect_garbage(tmp_path, dry_run=True)
        assert dry.jobs == ["deadbeef0001"] and list(tmp_path.glob("nonstop-deadbeef0001-*"))
        rep = collect_garbage(tmp_path)
        assert rep.jobs == ["deadbeef0001"] and rep.live_jobs == ["deadbeef0002"]
        assert len(rep.segments) == 1
        assert not list(tmp_path.glob("nonstop-deadbeef0001*"))
        assert list(tmp_path.glob("nonstop-deadbeef0002-*"))
    finally:
        os.close(fd)
