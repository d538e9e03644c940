"""The ``nonstop`` command's layout (nonstop/cli/): every subcommand added by its module's
``add_parser`` and run by its ``run``, and the help the parser gives."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from nonstop import cli
from nonstop.cli import build_parser, commands

EXPECTED = (
    "simulate", "advise", "chaos", "run", "demo", "persist", "status", "migrate", "drain", "inspect",
    "timeline", "export", "gc",
)  # fmt: skip
# the smallest valid command line of each subcommand (its required arguments)
MINIMAL = {"migrate": ["--rank", "0"], "drain": ["1"], "inspect": ["u"], "chaos": ["--faults", "1"]}
MINIMAL |= {"export": ["u", "--format", "dcp", "--out", "o"], "run": ["train.py"]}


def test_every_subcommand_is_listed_once_in_the_help_order() -> None:
    names = [n for c in commands() for n in c.names]
    assert tuple(names) == EXPECTED
    _, parsers = build_parser()
    assert tuple(parsers) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_each_subcommand_parses_its_smallest_command_line(name: str) -> None:
    ap, parsers = build_parser()
    ns = ap.parse_args([name, *MINIMAL.get(name, [])])
    assert ns.cmd == name
    assert isinstance(parsers[name], argparse.ArgumentParser)
    assert parsers[name].prog == f"nonstop {name}"


def test_the_subcommand_modules_here_each_have_their_add_parser_and_run() -> None:
    here = Path(cli.__file__).parent
    modules = sorted(p.stem for p in here.glob("*.py") if p.stem not in ("__init__", "__main__"))
    subcommands = [m for m in modules if m not in ("configfile", "env")]
    assert subcommands == ["demo", "gc", "inspect", "migrate", "persist", "run", "status", "timeline"]
    runs = {c.run for c in commands()}
    for name in subcommands:
        module = importlib.import_module(f"nonstop.cli.{name}")
        assert callable(module.add_parser) and module.run in runs, name


def test_main_runs_the_chosen_subcommand(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["timeline", str(tmp_path / "none"), "--text-only"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nonstop: error: ") and len(err.strip().splitlines()) == 1


def test_an_unknown_subcommand_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["nosuch"])
    assert e.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err
