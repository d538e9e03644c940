"""in_collective: a thread blocked in a real gloo collective is seen as in one; a thread stuck
in its own code is not (the heartbeat's ``coll``, which keeps peers of a stuck rank unblamed).
Both ranks are separate processes, so this test's process never holds a process group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RANK = """
import datetime, json, os, sys, threading, time
import torch.distributed as dist
from nonstop.train.collectives import in_collective
rank, rdzv = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + rdzv, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
if rank == 1:
    time.sleep(60)  # in the group, never enters the barrier: rank 0 waits on it
waiting = threading.Thread(target=dist.barrier, daemon=True)
stuck = threading.Thread(target=time.sleep, args=(60,), daemon=True)
waiting.start(); stuck.start()
deadline = time.monotonic() + 20
while not in_collective(waiting.ident) and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"waiting": in_collective(waiting.ident), "stuck": in_collective(stuck.ident),
                  "main": in_collective(threading.get_ident()), "none": in_collective(None)}), flush=True)
os._exit(0)
"""


def test_a_thread_waiting_in_a_gloo_barrier_is_in_a_collective(tmp_path: Path) -> None:
    rdzv = str(tmp_path / "rdzv")
    peer = subprocess.Popen([sys.executable, "-c", RANK, "1", rdzv])
    try:
        out = subprocess.run(
            [sys.executable, "-c", RANK, "0", rdzv], capture_output=True, text=True, timeout=60, check=True
        )
    finally:
        peer.kill()
        peer.wait()
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"waiting": True, "stuck": False, "main": False, "none": False}


DDP_RANK = """
import datetime, json, os, sys, threading, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from nonstop.train.collectives import in_collective
rank, rdzv = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + rdzv, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
ddp(torch.randn(3, 4)).sum().backward()  # the first iteration: both ranks
if rank == 1:
    time.sleep(60)  # stuck in its own code: rank 0's second forward waits on it
second = threading.Thread(target=lambda: ddp(torch.randn(3, 4)), daemon=True)
second.start()
deadline = time.monotonic() + 20
while not in_collective(second.ident) and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"second_forward": in_collective(second.ident)}), flush=True)
os._exit(0)
"""


def test_a_ddp_forward_waiting_on_the_bucket_rebuild_broadcast_is_in_a_collective(tmp_path: Path) -> None:
    # A fresh DDP wrapper broadcasts its rebuilt bucket order in its second forward, from DDP's own
    # module: a rank waiting there for a stuck peer must not be the one blamed for the stall.
    rdzv = str(tmp_path / "rdzv")
    peer = subprocess.Popen([sys.executable, "-c", DDP_RANK, "1", rdzv])
    try:
        out = subprocess.run(
            [sys.executable, "-c", DDP_RANK, "0", rdzv],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        peer.kill()
        peer.wait()
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"second_forward": True}
