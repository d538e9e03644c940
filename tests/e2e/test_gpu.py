"""GPU-only tests of issue 20 (skipped without CUDA devices; run on a lent GPU machine with
``pytest -m gpu tests/e2e/test_gpu.py``):

* one GPU: a one-rank demo job on ``cuda:0`` (group ``cpu:gloo,cuda:nccl``, snapshots copied
  from the device into page-locked slots) survives a SIGKILL and a hang -- a cold process takes
  the freed GPU and restores the committed step from memory onto it -- and ends with the weights
  of the same run without faults, bitwise;

* collective-aware liveness on real CUDA and NCCL: the canonical sync's allreduce returns at
  enqueue (its host stamp is gone at once), yet while the peer is stuck in its own code the
  waiting rank's device events say "in a collective", polled from another thread as the heartbeat
  does; the stuck rank's do not; polling never creates a context on a device not the rank's own;
* SIGKILL of a rank of the demo under NCCL (``cpu:gloo,cuda:nccl``): the survivor recovers in
  place (its process never exits), the killed rank's replacement takes a free GPU, no step lost;
* four GPUs: an HSDP 2 x 2 mesh's groups split from the world (``train/devicegroups.py``) kept
  through a failure of rank 3 -- the untouched ones kept, the lost rank's aborted, one with an
  unmatched collective in flight built again -- and every group's all-reduce right afterwards.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
four_gpus = pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA devices")
one_gpu = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")

LIVENESS = """
import datetime, json, os, sys, threading, time
import torch
import torch.distributed as dist
from nonstop.train.ddp import CanonicalGradSync, wrap_ddp

rank, rdzv = int(sys.argv[1]), sys.argv[2]
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
dist.init_process_group("nccl", init_method="file://" + rdzv, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120), device_id=dev)
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024).to(dev)
sync = CanonicalGradSync(model)
ddp = wrap_ddp(model, sync, dist.group.WORLD)
x = torch.randn(256, 1024, device=dev)

def step():
    ddp(x).sum().backward()

def poll(seconds):  # the heartbeat thread's view
    seen, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(sync.in_collective())
        time.sleep(0.05)
    return seen

def polled(seconds):
    out = []
    t = threading.Thread(target=lambda: out.extend(poll(seconds)))
    t.start(); t.join()
    return out

step(); torch.cuda.synchronize()
seen = {"settled": sync.in_collective()}
dist.barrier()
if rank == 1:
    seen["stuck"] = polled(6.0)  # stuck in its own code: rank 0's allreduce waits on it
    step(); torch.cuda.synchronize()
    seen["other_context"] = bool(torch._C._cuda_hasPrimaryContext(0))
else:
    time.sleep(0.5)
    step()  # returns at enqueue: NCCL's future is already complete
    seen["host_stamp"] = sync.pending_since is not None
    seen["waiting"] = polled(3.0)
    torch.cuda.synchronize()  # rank 1 wakes and joins the allreduce
    seen["after"] = sync.in_collective()
print(json.dumps(seen), flush=True)
dist.destroy_process_group()
"""


@two_gpus
def test_a_rank_waiting_on_a_stuck_peer_under_nccl_is_in_a_collective(tmp_path: Path) -> None:
    rdzv = str(tmp_path / "rdzv")
    procs = [
        subprocess.Popen([sys.executable, "-c", LIVENESS, str(r), rdzv], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    r0, r1 = outs
    assert r0["settled"] is False and r1["settled"] is False
    assert r0["host_stamp"] is False  # the reason for device events: NCCL returns at enqueue
    assert r0["waiting"] and sum(r0["waiting"]) >= 0.9 * len(r0["waiting"]), r0["waiting"]
    assert r0["after"] is False
    assert not any(r1["stuck"])  # the stuck rank is not in a collective: the rule may blame it
    assert r1["other_context"] is False  # polling made no context on GPU 0 (rank 1's is GPU 1)


@two_gpus
def test_a_rank_killed_under_nccl_recovers_with_the_survivor_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nonstop.coordinator.loop import JobState
    from tests.conftest import run_demo_job

    monkeypatch.delenv("NONSTOP_FAKE_DEVICES", raising=False)  # the node's real GPUs
    spares = 1 if torch.cuda.device_count() >= 3 else 0  # a cold process takes the freed GPU
    run = run_demo_job(tmp_path, nproc=2, spares=spares, steps=12, faults=("kill:rank=1,step=5",))
    assert run.result.state is JobState.DONE, run.result.error
    (failure,) = run.result.failures
    assert (failure["kind"], failure["rank"], failure["lost_steps"]) == ("kill", 1, 0), failure
    assert run.out is not None and run.out["step"] == 12 and math.isfinite(run.out["final_loss"])
    first: dict[int, int] = {}  # rank -> the process the job started it in
    for e in run.events:
        if e["event"] == "spawn" and e.get("rank") is not None:
            first.setdefault(e["rank"], e["spawn_id"])
    failed_exits = [e for e in run.events if e["event"] == "exit" and e.get("returncode") not in (0, None)]
    assert [e["spawn_id"] for e in failed_exits] == [first[1]], failed_exits  # rank 0 kept its process
    assert all(e["spawn_id"] != first[0] or e["returncode"] == 0 for e in run.events if e["event"] == "exit")


@one_gpu
def test_a_one_gpu_job_survives_a_kill_and_a_hang_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nonstop.coordinator.loop import JobState
    from tests.conftest import run_demo_job

    monkeypatch.delenv("NONSTOP_FAKE_DEVICES", raising=False)  # the node's real GPU
    kw = {"nproc": 1, "spares": 0, "steps": 16, "model": "small"}
    ref = run_demo_job(tmp_path / "ref", **kw)
    run = run_demo_job(tmp_path / "run", faults=("kill:rank=0,step=4", "hang:rank=0,step=9"), **kw)
    for r in (ref, run):
        assert r.result.state is JobState.DONE, r.result.error
        assert r.out is not None and r.out["step"] == 16
        assert (r.out["device"], r.out["backend"]) == ("cuda:0", "cpu:gloo,cuda:nccl"), r.out
    kinds = [(f["kind"], f["lost_steps"]) for f in run.result.failures]
    assert kinds == [("kill", 0), ("hang", 0)], run.result.failures
    assert all(f["restore_step"] is not None and f["restore_step"] > 0 for f in run.result.failures)
    assert run.out["final_hash"] == ref.out["final_hash"]  # type: ignore[index]


@one_gpu
def test_a_one_gpu_fsdp2_job_survives_a_kill_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sharded demo on a one-rank mesh (FSDP2: DTensor parameters on ``cuda:0``, snapshots of
    the local shards) through a SIGKILL: its shards equal those of the run without the fault."""
    from nonstop.coordinator.loop import JobState
    from tests.conftest import run_demo_job

    monkeypatch.delenv("NONSTOP_FAKE_DEVICES", raising=False)
    kw = {"nproc": 1, "spares": 0, "steps": 12, "model": "small", "mesh": "shard=1"}
    ref = run_demo_job(tmp_path / "ref", **kw)
    run = run_demo_job(tmp_path / "run", faults=("kill:rank=0,step=5",), **kw)
    outs = []
    for r in (ref, run):
        assert r.result.state is JobState.DONE, r.result.error
        out = json.loads((r.job_dir / "result.rank0.json").read_text())
        assert (out["device"], out["backend"], out["step"]) == ("cuda:0", "cpu:gloo,cuda:nccl", 12), out
        outs.append(out)
    assert [(f["kind"], f["lost_steps"]) for f in run.result.failures] == [("kill", 0)]
    assert outs[0]["local_hash"] == outs[1]["local_hash"]


MESH_GROUPS = """
import contextlib, datetime, json, os, sys
import torch
import torch.distributed as dist
from nonstop.mesh import MeshSpec
from nonstop.train import devicegroups
from nonstop.train.meshgroups import MeshGroups

rank, port, gens = int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")]
split = sys.argv[4] == "split"  # the world bound and split; else unbound, each group its own
dev = torch.device("cuda", rank)
torch.cuda.set_device(dev)
spec = MeshSpec.parse("replicate=2,shard=2")
tcp = dist.TCPStore("127.0.0.1", port, 4, rank == 0 and 1 in gens, timeout=datetime.timedelta(seconds=120))
mg, out = MeshGroups(), {}
for g in gens:
    store = dist.PrefixStore(f"gen{g}/", tcp)
    with devicegroups.lazy_world() if not split else contextlib.nullcontext():
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=4,
                                timeout=datetime.timedelta(seconds=120), device_id=dev if split else None)
    assert devicegroups.splits("cuda") == split
    groups = mg.build(spec, rank=rank, generation=g, store=store, device_type="cuda").get_all_groups()
    sums = []
    for pg in groups:
        t = torch.ones(1024, device=dev)
        dist.all_reduce(t, group=pg)
        sums.append(float(t[0]))
    torch.cuda.synchronize()
    out[g] = {"kept": mg.kept, "built": mg.built, "sums": sums}
    if g == 1:
        if rank == 3:  # the failed rank: gone without a word
            print(json.dumps(out), flush=True)
            os._exit(0)
        if rank == 0:  # a collective on {0, 1} that rank 1 never issues: that group is built again
            dist.all_reduce(torch.ones(1024, device=dev), group=groups[1])
        dist.group.WORLD._get_backend(dev).abort()  # what GenerationGroup.sever does first
        mg.sever(lost=[3])
        mg.leave()
        dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


@four_gpus
@pytest.mark.parametrize("mode", ["independent", "split"])
def test_hsdp_groups_are_kept_through_a_failure_under_nccl(tmp_path: Path, mode: str) -> None:
    """Generation 1 builds every group (independent: each its members' own communicator, on an
    unbound world; split: by a split of the bound world); rank 3 fails; in generation 2 rank 0
    keeps {0, 2} (replicate) and builds {0, 1} again (its collective there was never matched),
    rank 2 keeps {0, 2}, ranks 1 and 3 build theirs -- and every all-reduce sums."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = [
        subprocess.Popen(
            [sys.executable, "-c", MESH_GROUPS, str(r), str(port), "1,2" if r < 3 else "1", mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    out3, _ = first[3].communicate(timeout=180)
    spare = subprocess.Popen(
        [sys.executable, "-c", MESH_GROUPS, "3", str(port), "2", mode], stdout=subprocess.PIPE, text=True
    )
    outs = {}
    for r, p in enumerate([*first[:3], spare]):
        text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, r
        outs[r] = json.loads(text.strip().splitlines()[-1])
    assert json.loads(out3.strip().splitlines()[-1])["1"]["sums"] == [2.0, 2.0]
    assert all(outs[r]["1"] == {"kept": 0, "built": 2, "sums": [2.0, 2.0]} for r in range(3))
    kept = {r: (outs[r]["2"]["kept"], outs[r]["2"]["built"]) for r in range(4)}
    assert kept == {0: (1, 1), 1: (0, 2), 2: (1, 1), 3: (0, 2)}, kept
    assert all(outs[r]["2"]["sums"] == [2.0, 2.0] for r in range(4))
