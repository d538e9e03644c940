"""Progress on the CLI's long work (nonstop/progress.py): drawn on stderr only for a terminal or when
asked, never into what stdout prints, and the same report with and without it."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from nonstop.progress import inspect_report, wait_with_status, wanted
from nonstop.snapshot.durable import DurableStore
from tests.durable_fakes import make_rank, persist


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_wanted_only_for_a_terminal_or_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")
    assert wanted(None, stream=Tty()) and not wanted(None, stream=io.StringIO())
    assert not wanted(None, json_output=True, stream=Tty())
    assert wanted(True, stream=io.StringIO()) and not wanted(False, stream=Tty())
    monkeypatch.setenv("TERM", "dumb")
    assert not wanted(None, stream=Tty())


def test_inspect_with_a_bar_reports_the_same(tmp_path: Path) -> None:
    store = DurableStore(tmp_path)
    for step in (10, 20, 30):
        persist(store, step, [make_rank(step + r) for r in range(2)])
    plain = inspect_report(str(tmp_path), verify=True, show=False)
    err = Tty()
    shown = inspect_report(str(tmp_path), verify=True, show=True, stream=err)
    assert json.dumps(shown, sort_keys=True) == json.dumps(plain, sort_keys=True)
    assert [c["step"] for c in shown["checkpoints"]] == [10, 20, 30]
    assert "verifying checkpoints" in err.getvalue() and "3/3" in err.getvalue()


def test_wait_with_status_returns_or_raises_what_the_work_did() -> None:
    err = Tty()
    assert wait_with_status(lambda: (time.sleep(0.3), 7)[1], "waiting", show=True, stream=err) == 7
    assert "waiting" in err.getvalue()
    with pytest.raises(ValueError, match="boom"):
        wait_with_status(
            lambda: (_ for _ in ()).throw(ValueError("boom")), "waiting", show=True, stream=Tty()
        )
    assert wait_with_status(lambda: 3, "waiting", show=False) == 3


def test_cli_inspect_json_has_no_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nonstop.cli import main

    persist(DurableStore(tmp_path), 10, [make_rank(1)])
    assert main(["inspect", str(tmp_path), "--json", "--progress"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["checkpoints"][0]["step"] == 10  # stdout: the JSON alone
    assert main(["inspect", str(tmp_path), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_resume_shows_a_spinner_while_it_loads_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--resume`` (launch/jobfiles.py ``load_resume``) loads and verifies the newest checkpoint
    before the job starts: on a terminal a spinner says so; the checkpoint is the same either way."""
    import sys

    from nonstop.config import JobConfig, PersistConfig
    from nonstop.launch.jobfiles import load_resume

    persist(DurableStore(tmp_path / "ck"), 10, [make_rank(1), make_rank(2)])
    config = JobConfig(
        script="train.py", nproc_per_node=2, persist=PersistConfig(resume=str(tmp_path / "ck"))
    )
    plain = load_resume(config)
    err = Tty()
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(sys, "stderr", err)
    shown = load_resume(config)
    assert shown.step == plain.step == 10 and shown.world_size == plain.world_size == 2
    assert "--resume: loading and verifying" in err.getvalue()
