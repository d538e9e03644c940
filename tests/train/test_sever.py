"""Severing a process group's collectives from another thread (train/abort.py, train/group.py).

A peer that is cut off sends neither data nor FIN nor reset; a rank blocked in a collective with
it waits for the group's timeout. ``SocketWatch.shut_reads`` ends that at once -- tested here with
real gloo groups in real processes, the silent peer frozen by SIGSTOP (its kernel keeps the
connections open and acknowledged, exactly what a partition looks like to the survivors).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nonstop.train.group import GenerationGroup

pytestmark = pytest.mark.timeout(180)

WORKER = textwrap.dedent(
    """
    import datetime, json, os, signal, sys, threading, time
    import torch, torch.distributed as dist
    from nonstop.train.abort import SocketWatch

    rank, port, out, sever = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0)
    watch = SocketWatch()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=60))
    watch.stop()
    t = torch.ones(1000)
    dist.all_reduce(t)  # the group works
    store.set(f"ready{rank}", "1")
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # silent from here: no data, no FIN, no reset
    store.wait(["ready0", "ready1", "ready2"])
    time.sleep(1.0)  # rank 2 is frozen by now
    shut = []
    if sever:
        threading.Timer(1.0, lambda: shut.append(watch.shut_reads())).start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
        outcome = "completed"
    except Exception as e:
        outcome = "failed: " + str(e)[:200]
    time.sleep(0.5)  # still alive afterwards: gloo did not terminate the process
    with open(out, "w") as f:
        json.dump({"outcome": outcome, "seconds": time.monotonic() - t0, "shut": shut}, f)
    os._exit(0)
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_three(tmp_path: Path, *, sever: bool, wait_s: float) -> list[dict[str, object]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                str(port),
                str(tmp_path / f"r{r}.json"),
                "1" if sever else "0",
            ]
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs[:2]):
            time.sleep(0.2)
        return [
            json.loads((tmp_path / f"r{r}.json").read_text())
            for r in range(2)
            if (tmp_path / f"r{r}.json").exists()
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def test_shut_reads_fails_a_collective_blocked_on_a_silent_peer_at_once(tmp_path: Path) -> None:
    results = _run_three(tmp_path, sever=True, wait_s=120)
    assert len(results) == 2, "a survivor did not finish (blocked, or killed by gloo)"
    for r in results:
        assert str(r["outcome"]).startswith("failed"), r
        # severed 1 s in; the collective's own timeout is 60 s
        assert float(r["seconds"]) < 30, r  # type: ignore[arg-type]
        assert r["shut"] and r["shut"][0] >= 1, r  # type: ignore[index]


def test_without_shut_reads_the_survivors_stay_blocked(tmp_path: Path) -> None:
    """The control: the same survivors, not severed, are still blocked 8 s later."""
    results = _run_three(tmp_path, sever=False, wait_s=8)
    assert results == []


class _Sockets:
    def __init__(self) -> None:
        self.shut = 0
        self.half_closed = 0

    def shut_reads(self) -> int:
        self.shut += 1
        return 1

    def half_close(self) -> int:
        self.half_closed += 1
        return 1


def test_a_severed_generation_is_never_parked_for_keeping() -> None:
    """Severed at a step's end race (the step finished anyway): the next destroy at a boundary
    must still drop the mesh groups, since their collectives were failed under them."""
    g = GenerationGroup(keep_groups=True)
    socks = _Sockets()
    g._sockets = socks  # type: ignore[assignment]
    parked: list[str] = []
    g.mesh_groups.park = lambda: parked.append("park")  # type: ignore[method-assign]
    g.mesh_groups.drop = lambda: parked.append("drop")  # type: ignore[method-assign]
    g.sever()
    assert socks.shut == 1
    g.destroy(at_boundary=True)
    assert parked == ["drop"] and socks.half_closed == 1
    # a generation that was not severed parks at a boundary
    g._sockets = _Sockets()  # type: ignore[assignment]
    g._severed = False
    g.destroy(at_boundary=True)
    assert parked == ["drop", "park"]
