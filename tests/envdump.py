"""A real 2-node local job (2 ranks and a hot spare per node, gloo, rank 1 SIGKILLed at step 4)
whose every process writes what it finds in ``os.environ`` to a JSON file: at the script's first
line (``start``), after ``nonstop.init()`` (``init``) and at the end (``done``). Shared by the
tests of torchrun's environment and of device placement."""

from __future__ import annotations

import json
from pathlib import Path

from nonstop.config import DetectionConfig, JobConfig
from nonstop.coordinator.loop import JobState
from nonstop.launch.local_nodes import run_local_nodes
from tests.conftest import LEASE_TTL_S

Dumps = dict[int, dict[str, str]]  # spawn id -> variable -> value (plus node, role and extras)

SCRIPT = """
import json, os, sys
out = sys.argv[1]

def dump(tag, **extra):
    d = {{k: os.environ.get(k) for k in {keys!r}}}
    d.update(node=os.environ["NONSTOP_NODE"], role=os.environ["NONSTOP_ROLE"], **extra)
    with open(os.path.join(out, tag + "-" + os.environ["NONSTOP_SPAWN_ID"] + ".json"), "w") as f:
        json.dump(d, f)

dump("start")  # the script's first line: nothing of nonstop has run yet
import time, torch, nonstop
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = nonstop.init()
dump("init")
model.to(session.device)  # the documented pattern

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


def _read(out: Path, tag: str) -> Dumps:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob(f"{tag}-*.json")}


def run_env_dump_job(tmp_path: Path, keys: tuple[str, ...]) -> tuple[Dumps, Dumps, Dumps]:
    """Run the job to its end; the ``start``, ``init`` and ``done`` dumps of ``keys``."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(keys=keys))
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
        detection=DetectionConfig(lease_ttl_s=LEASE_TTL_S),
    )
    result = run_local_nodes(config, redirect_output=True)
    assert result.state is JobState.DONE, result.error
    return _read(out, "start"), _read(out, "init"), _read(out, "done")
