"""A real ``nonstop run`` job (2 ranks and a hot spare on gloo, a rank SIGKILLed) started from a
TOML config file with flags overriding it: worker lines carry torchrun's prefix, the console shows
only the filtered rank, --log-dir holds one file per rank and process (the spare's before and
after it took the rank), the killed worker's last line is in its file, and nonstop's own log lines
are timestamped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import torch, nonstop
print("importing done", flush=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
session = nonstop.init()

def train_step(ddp_model, step):
    print(f"rank {session.rank} step {step}", flush=True)
    opt.zero_grad()
    g = torch.Generator().manual_seed(step * 100 + session.rank)
    ddp_model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
    opt.step()
    return 0.0

session.run(train_step, model=model, optimizer=opt, num_steps=8)
print(f"rank {session.rank} finished", flush=True)
"""


def test_prefixes_files_filter_and_config_file_in_a_job_with_a_kill(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    config = tmp_path / "job.toml"
    config.write_text(
        f"""
nproc-per-node = 2
spares = 1
job-dir = "{tmp_path / "job"}"
log-dir = "{logs}"
log-prefix = "rank"          # overridden on the command line
log-level = "info"
fail = ["kill:rank=1,step=4"]
script = "{script}"
"""
    )
    cmd = [sys.executable, "-m", "nonstop.cli", "run", "--config", str(config)]
    cmd += ["--log-prefix", "torchrun", "--local-ranks-filter", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "job done at step 8" in proc.stdout and "1 failure(s) recovered" in proc.stdout
    worker_lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("nonstop:")]
    assert worker_lines and all(ln.startswith("[default1]:") for ln in worker_lines), worker_lines
    assert "[default1]:rank 1 finished" in worker_lines  # printed by the spare that took rank 1
    # nonstop's own lines (info, from the config file) are timestamped
    own = [ln for ln in proc.stderr.splitlines() if " nonstop: " in ln]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} nonstop: [A-Z]+ ", ln) for ln in own)

    files = sorted(p.name for p in logs.iterdir())
    assert {"rank0-spawn0.log", "rank1-spawn1.log", "rank1-spawn2.log", "spare-spawn2.log"} <= set(files)
    assert (logs / "spare-spawn2.log").read_text() == "importing done\n"
    taken = (logs / "rank1-spawn2.log").read_text().splitlines()
    assert taken[-1] == "rank 1 finished" and "rank 0" not in " ".join(taken)
    rank0 = (logs / "rank0-spawn0.log").read_text().splitlines()
    assert rank0[0] == "importing done" and rank0[-1] == "rank 0 finished"
    killed = (logs / "rank1-spawn1.log").read_text().splitlines()
    assert killed[0] == "importing done" and "rank 1 finished" not in killed
    # the SIGKILLed worker's last line made it: it got as far as the step it was killed in
    last = re.fullmatch(r"rank 1 step (\d+)", killed[-1])
    assert last is not None and int(last.group(1)) >= 3, killed


def test_a_bad_config_key_fails_at_start_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('nproc-per-node = 2\nheartbeat-timout = 5.0\nscript = "train.py"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "nonstop.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"nonstop: error: --config {config}: key 'heartbeat-timout' is not a flag of nonstop run "
        "(keys are the long flag names)"
    ]
    assert not (tmp_path / ".nonstop").exists()  # nothing started
