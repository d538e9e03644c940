"""The scheduler examples stay in step with the CLI: the sbatch script's TOML loads through
--config's checks, and the Kubernetes pod's command parses as nonstop run flags with a
termination grace of at least --preempt-grace."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from nonstop import cli
from nonstop.cliconfig import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_the_sbatch_config_file_is_valid(tmp_path: Path) -> None:
    text = (EXAMPLES / "slurm" / "train.sbatch").read_text()
    toml = re.search(r"<<TOML\n(.*?)\nTOML\n", text, re.S)
    assert toml is not None
    path = tmp_path / "job.toml"
    path.write_text(toml.group(1).replace("$SHARED", "/shared").replace("$JOB_DIR", "/shared/1"))
    _, run = cli._parser()
    got = load_config(path, run)
    assert got["nproc_per_node"] == 4 and got["ranks_filter"] == "0"


def test_the_kubernetes_command_parses_and_its_grace_covers_preempt_grace() -> None:
    text = (EXAMPLES / "kubernetes" / "nonstop-job.yaml").read_text()
    args = re.search(r"- >-\n((?:\s{14}.*\n)+)", text)
    assert args is not None
    words = shlex.split(" ".join(line.strip() for line in args.group(1).splitlines()))
    assert words[:3] == ["exec", "nonstop", "run"]
    ap, _ = cli._parser()
    ns = ap.parse_args(["run", *[w.replace("$JOB_COMPLETION_INDEX", "1") for w in words[3:]]])
    grace = re.search(r"terminationGracePeriodSeconds: (\d+)", text)
    assert grace is not None and int(grace.group(1)) >= ns.preempt_grace
    assert "medium: Memory" in text and "clusterIP: None" in text and "secretKeyRef" in text
