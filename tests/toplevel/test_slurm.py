"""Slurm's environment as nonstop run's node flags (nonstop/slurm.py): compressed node lists, the
mapping in an srun step, explicit flags and --config winning over it; and, where a Slurm
controller answers on this machine, a real ``srun nonstop run`` job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.errors import UsageError
from nonstop.slurm import BASE_PORT, expand_nodelist, slurm_defaults

STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "node[01-03,07],gpu5",
    "SLURM_STEP_NODELIST": "node[02-03]",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("x,y[009-010]", ["x", "y009", "y010"]),
    ],
)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["", "node[1-", "node[a-b]", "node[3-1]", "n]"])
def test_a_malformed_nodelist_is_a_usage_error(bad: str) -> None:
    with pytest.raises(UsageError, match="node list"):
        expand_nodelist(bad)


def test_an_srun_step_maps_to_node_flags() -> None:
    got = slurm_defaults(STEP)
    assert got == {"nnodes": 2, "node_rank": 1, "coordinator": f"node02:{BASE_PORT + 242}"}
    got = slurm_defaults({**STEP, "NONSTOP_COORDINATOR_PORT": "29500"})
    assert got["coordinator"] == "node02:29500"
    no_step_list = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP_NODELIST")}
    assert slurm_defaults(no_step_list)["coordinator"] == f"node01:{BASE_PORT + 242}"


def test_outside_a_step_or_slurm_nothing_is_read() -> None:
    assert slurm_defaults({}) == {}
    batch = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert slurm_defaults(batch) == {}  # the batch script itself, on the first node only
    one = {**STEP, "SLURM_STEP_NODELIST": "vm", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0"}
    one["SLURM_STEP_NUM_TASKS"] = "1"
    assert slurm_defaults(one) == {"nnodes": 1, "node_rank": 0}  # loopback, free port


def test_several_tasks_per_node_are_refused() -> None:
    with pytest.raises(UsageError, match="ntasks-per-node=1"):
        slurm_defaults({**STEP, "SLURM_STEP_NUM_TASKS": "8"})


def _parsed(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> object:
    from nonstop.cli import build_parser
    from nonstop.cli.run import with_defaults

    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ap, parsers = build_parser()
    return with_defaults(ap, parsers["run"], ap.parse_args(argv), argv)


def test_flags_and_the_config_file_win_over_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ns = _parsed(["run", "t.py"], STEP, monkeypatch)
    assert (ns.nnodes, ns.node_rank, ns.coordinator) == (2, 1, f"node02:{BASE_PORT + 242}")  # type: ignore[attr-defined]
    ns = _parsed(["run", "--coordinator", "head:1234", "--node-rank", "0", "t.py"], STEP, monkeypatch)
    assert (ns.nnodes, ns.node_rank, ns.coordinator) == (2, 0, "head:1234")  # type: ignore[attr-defined]
    cfg = tmp_path / "job.toml"
    cfg.write_text('coordinator = "fromfile:99"\nnproc-per-node = 3\n')
    ns = _parsed(["run", "--config", str(cfg), "--nproc-per-node", "4", "t.py"], STEP, monkeypatch)
    assert (ns.coordinator, ns.nproc_per_node, ns.nnodes) == ("fromfile:99", 4, 2)  # type: ignore[attr-defined]


# -- a real Slurm --------------------------------------------------------------------------------


def _slurm_up() -> bool:
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mixed", "allocated"))


TRAIN = """
import os, torch, nonstop
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = nonstop.init()
def step(m, s):
    opt.zero_grad(); m(torch.randn(8, 4)).pow(2).mean().backward(); opt.step(); return 0.0
session.run(step, model=model, optimizer=opt, num_steps=4)
print("trained under slurm job", os.environ.get("SLURM_JOB_ID"), flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _slurm_up(), reason="no Slurm controller answers here (sinfo)")
def test_srun_nonstop_run_needs_no_node_flags(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cmd = ["srun", "-N1", "--ntasks-per-node=1", "--time=5", f"--chdir={tmp_path}"]
    cmd += [
        sys.executable,
        "-m",
        "nonstop.cli",
        "run",
        "--nproc-per-node",
        "2",
        "--job-dir",
        "job",
        str(script),
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job done at step 4" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if "trained under slurm job" in ln]
    assert sorted(ln.split()[1] for ln in lines) == ["0]", "1]"]  # "[rank 0] ...", "[rank 1] ..."
    assert all(ln.split()[-1].isdigit() for ln in lines)  # SLURM_JOB_ID reached the workers

    # several tasks on one node: refused in one line, exit 2
    cmd = ["srun", "-N1", "--ntasks=2", "--time=5", f"--chdir={tmp_path}"]
    cmd += [sys.executable, "-m", "nonstop.cli", "run", "--job-dir", "job2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "ntasks-per-node=1" in proc.stderr
