"""The chaos driver's room for a fault near a job's end: a planned move (migrate, preempt) needs
seconds of training left, not only steps, and one the job's end overtakes is taken again by the
next job instead of counted as a failure (a soak in CI once failed on exactly that race)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nonstop.chaos.checks import Checks
from nonstop.chaos.inject import Injected
from nonstop.chaos.recover import Overtaken, Recoveries
from nonstop.chaos.report import FaultRecord
from nonstop.chaos.schedule import Planned
from nonstop.chaos.watch import JobEnded, JobWatch


class _Ep:
    def node_running(self, k: int) -> bool:
        return True


def _status(committed: int) -> dict[str, Any]:
    return {"t": "status", "state": "running", "committed_step": committed, "generation": 1,
            "world_size": 1, "ranks": {"0": {"pid": 1, "node": "0"}}, "nodes": {}}  # fmt: skip


def _recoveries(tmp_path: Path, steps: int = 400) -> tuple[Recoveries, JobWatch, Checks]:
    watch = JobWatch(tmp_path)
    checks = Checks()
    opts = SimpleNamespace(steps=steps, timeout_s=5.0, world_size=1, nnodes=1, spares=1)
    return Recoveries(_Ep(), watch, checks, netns=None, opts=opts, say=lambda *a: None), watch, checks  # type: ignore[arg-type]


def _end(tmp_path: Path) -> None:
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write(json.dumps({"event": "job_end", "ts": time.time()}) + "\n")


def _plan(kind: str) -> Planned:
    return Planned(index=0, kind=kind, rank=0, node=1, delay_s=0.0)


def test_the_step_rate_is_measured_over_the_recent_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, watch, _ = _recoveries(tmp_path)
    clock = [100.0]
    rec.clock = lambda: clock[0]
    for c in (10, 20, 30):
        monkeypatch.setattr(watch, "status", lambda c=c: _status(c))
        rec.look()
        assert (rec.step_rate() is None) == (c == 10)  # one look is no rate
        clock[0] += 1.0
    assert rec.step_rate() == pytest.approx(10.0)
    clock[0] += 60.0  # a stall: the looks before the window go but the last one (step 30, t=102)
    monkeypatch.setattr(watch, "status", lambda: _status(31))
    rec.look()
    clock[0] += 2.0
    rec.look()
    assert len(rec._progress) == 3
    assert rec.step_rate() == pytest.approx(1 / 63)  # one step in the 63 s since step 30


def test_a_planned_move_needs_seconds_left_where_a_failure_needs_only_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, watch, _ = _recoveries(tmp_path, steps=400)
    clock = [0.0]
    rec.clock = lambda: clock[0]
    committed = [100]
    monkeypatch.setattr(watch, "status", lambda: _status(committed[0]))
    rec.look()
    clock[0], committed[0] = 2.0, 300  # 100 steps/s: 100 steps left (> the 40-step margin) is 1 s
    assert rec.room_for(_plan("kill"), tmp_path) is not None
    assert rec.room_for(_plan("migrate"), tmp_path) is None
    assert rec.room_for(_plan("preempt"), tmp_path) is None
    rec2, watch2, _ = _recoveries(tmp_path / "slow", steps=400)
    (tmp_path / "slow").mkdir()
    committed2 = [100]
    monkeypatch.setattr(watch2, "status", lambda: _status(committed2[0]))
    clock[0] = 0.0
    rec2.clock = lambda: clock[0]
    rec2.look()
    clock[0], committed2[0] = 10.0, 150  # 5 steps/s: 250 steps left is 50 s, room for a move
    assert rec2.room_for(_plan("migrate"), tmp_path) is not None


def _fail_migrate(output: str) -> Any:
    class _Inj:
        root = Path("/nonexistent")

        def inject(self, p: Planned, status: dict[str, Any], timeout: float) -> Injected:
            return Injected(time.time(), {"returncode": 1, "output": output})

    return _Inj()


def test_a_move_the_jobs_end_overtook_is_no_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec, watch, checks = _recoveries(tmp_path)
    monkeypatch.setattr(watch, "status", lambda: None)
    _end(tmp_path)
    record = FaultRecord(index=0, kind="migrate", episode=1, time=time.time())
    inj = _fail_migrate("nonstop: rank 1 not moved: the job finished first")
    with pytest.raises(Overtaken):
        rec.fault(_plan("migrate"), record, inj, _status(390), tag="t: ")
    assert checks.violations == []


def test_a_move_refused_for_another_reason_is_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec, watch, checks = _recoveries(tmp_path)
    monkeypatch.setattr(watch, "status", lambda: None)
    _end(tmp_path)  # even when the job then ended: the refusal was not the end's doing
    record = FaultRecord(index=0, kind="migrate", episode=1, time=time.time())
    with pytest.raises(JobEnded) as got:
        rec.fault(_plan("migrate"), record, _fail_migrate("nonstop: no such node 7"), _status(10), tag="t: ")
    assert not isinstance(got.value, Overtaken)
    assert any("nonstop migrate failed" in v for v in checks.violations)
