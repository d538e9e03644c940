"""torchrun's flags on ``nonstop run`` and flags from the environment (nonstop/cli/env.py): the
aliases and their mapping, the layers' precedence, bad values in one line naming the variable,
and a script written for torchrun run with torchrun's flags."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.cli import build_parser
from nonstop.cli.run import with_defaults
from nonstop.errors import UsageError

NONSTOP = [sys.executable, "-m", "nonstop.cli"]


def _parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    for k in [k for k in os.environ if k.startswith(("NONSTOP_", "PET_", "SLURM_"))]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ap, parsers = build_parser()
    return with_defaults(ap, parsers["run"], ap.parse_args(["run", *argv]), ["run", *argv])


def test_torchrun_spellings_map_onto_nonstops_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _parse(
        [
            "--nproc_per_node",
            "2",
            "--nnodes",
            "1:3",
            "--node_rank",
            "1",
            "--rdzv_endpoint",
            "head",
            "--rdzv-backend",
            "c10d",
            "--rdzv-id",
            "x",
            "--max_restarts",
            "4",
            "t.py",
            "--lr",
            "1",
        ],
        {},
        monkeypatch,
    )
    assert (ns.nproc_per_node, ns.nnodes, ns.node_rank, ns.max_restarts) == (2, 3, 1, 4)
    assert ns.min_world_size == 2  # MIN nodes' ranks: 1 x 2
    assert ns.coordinator == "head:29400" and ns.script == "t.py" and ns.script_args == ["--lr", "1"]
    ns = _parse(["--nnodes", "2:2", "--nproc-per-node", "3", "--master-addr", "m", "t.py"], {}, monkeypatch)
    assert (ns.nnodes, ns.min_world_size, ns.coordinator) == (2, 0, "m:29500")  # fixed size: no shrink
    ns = _parse(["--standalone", "--nproc-per-node", "auto", "t.py"], {}, monkeypatch)
    assert (ns.nnodes, ns.node_rank, ns.coordinator, ns.host, ns.port) == (1, 0, None, "127.0.0.1", 0)
    assert ns.nproc_per_node >= 1
    with pytest.raises(UsageError, match="--standalone runs one node"):
        _parse(["--standalone", "--nnodes", "2", "t.py"], {}, monkeypatch)
    with pytest.raises(UsageError, match="MIN:MAX"):
        _parse(["--nnodes", "3:2", "t.py"], {}, monkeypatch)


def test_environment_layers_and_their_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "PET_NPROC_PER_NODE": "2",
        "PET_MAX_RESTARTS": "5",
        "NONSTOP_MAX_RESTARTS": "6",
        "NONSTOP_SPARES": "1",
        "NONSTOP_LOSSY": "yes",
        "NONSTOP_FAIL": "'kill:rank=1,step=4' hang:rank=0,step=9",
        "PET_SPARES": "3",
    }  # PET_ only for torchrun's flags: PET_SPARES is no flag
    ns = _parse(["t.py"], env, monkeypatch)
    assert (ns.nproc_per_node, ns.max_restarts, ns.spares, ns.lossy) == (2, 6, 1, True)
    assert ns.fail == ["kill:rank=1,step=4", "hang:rank=0,step=9"]
    config = tmp_path / "job.toml"
    config.write_text("max-restarts = 7\n")
    ns = _parse(["t.py"], {**env, "NONSTOP_CONFIG": str(config)}, monkeypatch)
    assert ns.max_restarts == 7  # the file over the environment
    ns = _parse(["--max-restarts", "8", "--config", str(config), "t.py"], env, monkeypatch)
    assert ns.max_restarts == 8  # the command line over everything
    slurm = {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    ns = _parse(["t.py"], {**slurm, "PET_NODE_RANK": "0", "PET_NNODES": "2"}, monkeypatch)
    assert (ns.node_rank, ns.nnodes, ns.coordinator) == (0, 2, "n1:29400")  # PET_ over Slurm


@pytest.mark.parametrize(
    ("var", "value", "match"),
    [
        ("NONSTOP_NPROC_PER_NODE", "many", "$NONSTOP_NPROC_PER_NODE='many'"),
        ("PET_MAX_RESTARTS", "x", "$PET_MAX_RESTARTS='x': must be an integer"),
        ("NONSTOP_SNAPSHOT", "fast", "$NONSTOP_SNAPSHOT='fast': one of"),
        ("NONSTOP_LOSSY", "maybe", "$NONSTOP_LOSSY='maybe': a switch"),
    ],
)
def test_a_bad_variable_fails_in_one_line_naming_it(var: str, value: str, match: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NONSTOP_", "PET_"))}
    proc = subprocess.run(
        [*NONSTOP, "run", "--job-dir", str(tmp_path), "t.py"],
        capture_output=True,
        text=True,
        env={**env, var: value},
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nonstop: error: ") and match in lines[0], proc.stderr


TORCHRUN_SCRIPT = """
import os, torch, nonstop
local_rank = int(os.environ["LOCAL_RANK"])          # what a torchrun script reads first
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert os.environ["LOCAL_WORLD_SIZE"] == "2" and os.environ["GROUP_RANK"] == "0" and local_rank == rank
assert os.environ["MASTER_ADDR"] == "127.0.0.1" and int(os.environ["MASTER_PORT"]) > 0
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = nonstop.init()
assert (session.rank, session.world_size) == (rank, world)

def train_step(ddp_model, step):
    opt.zero_grad()
    ddp_model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return 0.0

session.run(train_step, model=model, optimizer=opt, num_steps=3)
print(f"torchrun-style rank {rank} of {world} local {local_rank} done", flush=True)
"""


@pytest.mark.slow
def test_a_torchrun_script_runs_with_torchruns_flags(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NONSTOP_", "PET_"))}
    cmd = [
        *NONSTOP,
        "run",
        "--standalone",
        "--nnodes",
        "1",
        "--max_restarts",
        "3",
        "--rdzv-backend",
        "c10d",
        "--job-dir",
        str(tmp_path / "job"),
        str(script),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, env={**env, "PET_NPROC_PER_NODE": "2"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        assert f"torchrun-style rank {r} of 2 local {r} done" in proc.stdout, proc.stdout
