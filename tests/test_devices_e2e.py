"""Every process on a device of its own, on a real 2-node local job with fake devices
(``NONSTOP_FAKE_DEVICES=3`` per node: 2 ranks + 1 hot spare fill each node; gloo, rank 1
SIGKILLed): before the script's first line every process -- the spares too -- finds
``LOCAL_RANK`` = ``NONSTOP_DEVICE``, an index in range and distinct on its node, and nonstop's
NCCL settings; the spare that takes rank 1 keeps ITS OWN device; survivors keep theirs; the
spare started after the kill gets the device the killed rank freed. (Refusing a process on a
full node: tests/test_devices.py, the agent's side and ``nonstop run``'s exit 2.)"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from nonstop.config import JobConfig
from nonstop.runtime.coordinator import JobState
from nonstop.runtime.localnodes import run_local_nodes

pytestmark = pytest.mark.slow

KEYS = ("RANK", "LOCAL_RANK", "NONSTOP_DEVICE", "NONSTOP_DEVICE_TYPE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")

SCRIPT = f"""
import json, os, sys
out = sys.argv[1]

def dump(tag, **extra):
    d = {{k: os.environ.get(k) for k in {KEYS!r}}}
    d.update(node=os.environ["NONSTOP_NODE"], role=os.environ["NONSTOP_ROLE"], **extra)
    with open(os.path.join(out, tag + "-" + os.environ["NONSTOP_SPAWN_ID"] + ".json"), "w") as f:
        json.dump(d, f)

dump("start")  # the script's first line: nothing of nonstop has run yet
import time, torch, nonstop
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = nonstop.init()
model.to(session.device)  # the documented pattern (fake devices: the CPU)

def train_step(ddp_model, step):
    time.sleep(0.1)
    opt.zero_grad()
    g = torch.Generator().manual_seed(step * 100 + session.rank)
    ddp_model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
    opt.step()
    return 0.0

session.run(train_step, model=model, optimizer=opt, num_steps=10)
dump("done", device=str(session.device))
"""


def _read(out: Path, tag: str) -> dict[int, dict[str, str]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob(f"{tag}-*.json")}


def test_every_process_keeps_its_own_device_through_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NONSTOP_FAKE_DEVICES", "3")  # every node of the job (they inherit it)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "env"
    out.mkdir()
    config = JobConfig(
        script=str(script),
        script_args=(str(out),),
        nproc_per_node=2,
        spares=1,
        nnodes=2,
        job_dir=tmp_path / "job",
        faults=("kill:rank=1,step=4",),
        coordinator="127.0.0.1:0",
        lease_ttl_s=3.0,
    )
    result = run_local_nodes(config, redirect_output=True)
    assert result.state is JobState.DONE, result.error

    start, done = _read(out, "start"), _read(out, "done")
    for sid, e in start.items():  # set by the agent before the script's first line, spares too
        assert e["LOCAL_RANK"] == e["NONSTOP_DEVICE"] and e["LOCAL_RANK"] in ("0", "1", "2"), (sid, e)
        assert e["NONSTOP_DEVICE_TYPE"] == "cuda" and e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", e
    by_node: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
    for sid, e in sorted(start.items()):
        by_node[e["node"]].append((sid, e))
    first = {node: es[:3] for node, es in by_node.items()}  # the processes the job started with
    for node, es in first.items():  # 2 ranks and a spare: the node's 3 devices, one each
        assert sorted(e["LOCAL_RANK"] for _, e in es) == ["0", "1", "2"], (node, es)
        assert sorted(e["role"] for _, e in es) == ["spare", "worker", "worker"], (node, es)

    # at the end: every rank's process kept the device it was spawned with
    assert sorted(int(e["RANK"]) for e in done.values()) == [0, 1, 2, 3]
    for sid, e in done.items():
        assert e["LOCAL_RANK"] == e["NONSTOP_DEVICE"] == start[sid]["LOCAL_RANK"], (sid, e, start[sid])
        assert e["device"] == "cpu"  # fake devices: the index is LOCAL_RANK's, the compute the CPU's
    (taker_sid,) = [sid for sid, e in done.items() if e["role"] == "spare"]
    taker = done[taker_sid]
    assert taker["RANK"] == "1"
    # the process launched as rank 1 (spares started later may carry RANK=1 and end as spares when
    # the job finishes, without a "done" record: not killed)
    launched = [sid for sid, e in start.items() if e["role"] == "worker" and e["RANK"] == "1"]
    killed = [sid for sid in launched if sid not in done]
    assert len(killed) == 1
    if start[killed[0]]["node"] == taker["node"]:  # the spare kept its device, not the killed rank's
        assert taker["LOCAL_RANK"] != start[killed[0]]["LOCAL_RANK"]
    # processes started after the kill (a new spare) took a free device of their node
    assert sum(len(es) for es in by_node.values()) > 6, by_node  # one was (the spares kept at 1)
    for es in by_node.values():
        for sid, e in es[3:]:
            assert e["role"] == "spare" and e["LOCAL_RANK"] in ("0", "1", "2"), (sid, e)
            alive = {done[s]["LOCAL_RANK"] for s, x in es[:3] if s in done}
            assert e["LOCAL_RANK"] not in alive, (sid, e, alive)
