"""matplotlib is the optional ``plots`` extra: nothing imports it until a picture is drawn, and
without it every command still works -- a picture asked for fails in one line naming the extra
(exit 2), and ``nonstop timeline``'s default picture, a side product of its summary, is skipped in
one line. The commands run in a subprocess where matplotlib cannot be imported, as after a plain
``pip install nonstop``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nonstop.plotting import INSTALL_PLOTS, PlotsUnavailable, plots_missing, require_plots
from tests.timeline_fakes import Log

# Run as `python -c BLOCKED ARGS...`: matplotlib (and any submodule) raises ModuleNotFoundError, as
# when it is not installed; then the CLI runs with ARGS.
BLOCKED = textwrap.dedent(
    """
    import sys

    class NoMatplotlib:
        def find_spec(self, name, path=None, target=None):
            if name == "matplotlib" or name.startswith("matplotlib."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoMatplotlib())
    from nonstop.cli import main

    code = main(sys.argv[1:])
    assert not any(m.split(".")[0] == "matplotlib" for m in sys.modules), "matplotlib was imported"
    sys.exit(code)
    """
)


def nonstop_without_matplotlib(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_importing_nonstop_and_its_commands_imports_no_matplotlib() -> None:
    code = (
        "import sys, nonstop, nonstop.cli, nonstop.timeline, nonstop.timeline.output, nonstop.sim, "
        "nonstop.sim.cli, nonstop.plotting\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_simulate_and_advise_without_matplotlib(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    small = ["--gpus", "256", "--days", "1", "--seeds", "1"]
    # asked for a picture: one line before any simulating, exit 2, nothing written
    r = nonstop_without_matplotlib("simulate", *small, "--json", "sim.json", "--plot", str(png), cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    line = one_line(r.stderr)
    assert line == f"nonstop: error: --plot needs matplotlib, which is not installed: {INSTALL_PLOTS}"
    assert not png.exists() and not (tmp_path / "sim.json").exists()
    r = nonstop_without_matplotlib("advise", *small, "--plot", str(png), cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "nonstop[plots]" in one_line(r.stderr)
    # no picture asked for: the command works as before
    args = ("--strategy", "nonstop", "--no-progress", "--json", "sim.json")
    r = nonstop_without_matplotlib("simulate", *small, *args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "| nonstop |" in r.stdout
    assert json.loads((tmp_path / "sim.json").read_text())["median_runs"][0]["strategy"] == "nonstop"


def test_timeline_without_matplotlib(tmp_path: Path) -> None:
    log = Log(nodes=2, per_node=1)
    log.fail(10.0, [1])
    job = tmp_path / "job"
    job.mkdir()
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log.end(20.0).events))

    # the default picture is a side product of the summary: the summary is printed, the picture skipped
    r = nonstop_without_matplotlib("timeline", str(job), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "recovery" in r.stdout
    line = one_line(r.stderr)
    assert line.startswith(
        "nonstop: timeline picture skipped: drawing needs matplotlib, which is not installed ("
    )
    assert INSTALL_PLOTS in line and "--format trace" in line
    assert not (job / "timeline.png").exists()

    # a picture asked for by name: one line, exit 2, before anything is printed
    for args in (["--out", str(tmp_path / "t.svg")], ["--format", "pdf"]):
        r = nonstop_without_matplotlib("timeline", str(job), *args, cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "", r.stdout
        assert one_line(r.stderr).startswith("nonstop: error: a ")
        assert f"timeline needs matplotlib, which is not installed: {INSTALL_PLOTS}" in r.stderr
    assert not (tmp_path / "t.svg").exists() and not (job / "timeline.pdf").exists()

    # what needs no picture: the summary alone, and the Perfetto trace
    r = nonstop_without_matplotlib("timeline", str(job), "--text-only", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "" and "recovery" in r.stdout
    r = nonstop_without_matplotlib("timeline", str(job), "--format", "trace", cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads((job / "timeline.trace.json").read_text())["traceEvents"]
    # a bad request is still refused for what it is, not for the missing matplotlib
    r = nonstop_without_matplotlib("timeline", str(job), "--out", str(tmp_path / "t.jpg"), cwd=tmp_path)
    assert r.returncode == 2 and "matplotlib" not in r.stderr


def test_plots_missing_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plots_missing() is None  # the dev extra brings the plots extra
    require_plots("x")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    assert plots_missing() == "is not installed"
    with pytest.raises(PlotsUnavailable, match=r"^--plot needs matplotlib, which is not installed: pip"):
        require_plots("--plot")
