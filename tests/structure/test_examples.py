"""The examples stay in step with the CLI: the sbatch script's TOML loads through --config's
checks, the Kubernetes pod's command parses as nonstop run flags with a termination grace of at
least --preempt-grace, and the README's loop example survives a kill bitwise."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.cli import build_parser
from nonstop.cli.configfile import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_sbatch_config_file_is_valid(tmp_path: Path) -> None:
    text = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    toml = re.search(r"<<TOML\n(.*?)\nTOML\n", text, re.S)
    assert toml is not None
    path = tmp_path / "job.toml"
    path.write_text(toml.group(1).replace("$SHARED", "/shared").replace("$JOB_DIR", "/shared/1"))
    _, parsers = build_parser()
    got = load_config(path, parsers["run"])
    assert got["nproc_per_node"] == 4 and got["ranks_filter"] == "0"


def test_the_kubernetes_command_parses_and_its_grace_covers_preempt_grace() -> None:
    text = (EXAMPLES / "kubernetes" / "nonstop-job.yaml").read_text()
    args = re.search(r"- >-\n((?:\s{14}.*\n)+)", text)
    assert args is not None
    words = shlex.split(" ".join(line.strip() for line in args.group(1).splitlines()))
    assert words[:3] == ["exec", "nonstop", "run"]
    ap, _ = build_parser()
    ns = ap.parse_args(["run", *[w.replace("$JOB_COMPLETION_INDEX", "1") for w in words[3:]]])
    grace = re.search(r"terminationGracePeriodSeconds: (\d+)", text)
    assert grace is not None and int(grace.group(1)) >= ns.preempt_grace
    assert "medium: Memory" in text and "clusterIP: None" in text and "secretKeyRef" in text


@pytest.mark.slow
def test_the_loop_example_survives_a_kill_bitwise(tmp_path: Path) -> None:
    """examples/loop/train.py -- the README's first example -- run as the README says, with a rank
    SIGKILLed and a hot spare, ends with the weights of the same run without the kill."""
    pytest.importorskip("torchdata.stateful_dataloader")
    digests = []
    for name, fail in (("faulty", ["--spares", "1", "--fail", "kill:rank=1,step=8"]), ("ref", [])):
        out = tmp_path / f"{name}.txt"
        cmd = [sys.executable, "-m", "nonstop.cli", "run", "--nproc-per-node", "3", *fail]
        cmd += ["--job-dir", str(tmp_path / name), str(EXAMPLES / "loop" / "train.py"), "--steps", "16"]
        done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"{1 if fail else 0} failure(s) recovered" in done.stdout, done.stdout[-2000:]
        digests.append(out.read_text())
    assert digests[0] == digests[1]
