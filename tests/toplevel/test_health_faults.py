"""The issue-21 faults (``slowdown``, ``degrade``) parse and print back; the slowdown stretches
a step by (factor - 1) x the process's own last compute, never compounding; a worker's health
message decodes; the health flags become a StragglerConfig; the job config round-trips it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.config import DetectionConfig, JobConfig, job_config_from_json, job_config_to_json
from nonstop.errors import UsageError
from nonstop.faults import FaultInjector, parse_fault
from nonstop.policy.straggler import StragglerConfig
from nonstop.protocol import wire
from nonstop.train.injection import WorkerFaults


def test_slowdown_and_degrade_parse_and_print_back() -> None:
    s = parse_fault("slowdown:rank=1,step=10,factor=3")
    assert (s.kind, s.rank, s.step, s.factor) == ("slowdown", 1, 10, 3.0)
    assert parse_fault(s.to_text()) == s
    d = parse_fault("degrade:node=2,step=5")
    assert (d.kind, d.node, d.step) == ("degrade", 2, 5)
    assert parse_fault(d.to_text()) == d


@pytest.mark.parametrize(
    "text",
    [
        "slowdown:rank=1,step=10",
        "slowdown:rank=1,step=1,factor=0.5",
        "degrade:rank=1,step=5",
        "slow:rank=1,step=1,factor=2",
    ],
)
def test_bad_specs_are_refused(text: str) -> None:
    with pytest.raises(UsageError):
        parse_fault(text)


def test_degrade_fires_on_its_node_only(tmp_path: Path) -> None:
    inj = FaultInjector([parse_fault("degrade:node=1,step=5")], tmp_path)
    assert inj.due(rank=0, step=5, phase="step", node=2) is None
    due = inj.due(rank=0, step=5, phase="step", node=1)
    assert due is not None and due[1].kind == "degrade"


class _Link:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)


def _faults(tmp_path: Path, spec: str) -> tuple[WorkerFaults, _Link]:
    wf = WorkerFaults.__new__(WorkerFaults)  # no WorkerEnv outside a job: the state only
    link = _Link()
    wf.link = link  # type: ignore[assignment]
    wf.injector = FaultInjector([parse_fault(spec)], tmp_path)
    wf.slowdown, wf._compute_s, wf._stretched_s = None, None, 0.0
    return wf, link


def test_the_slowdown_stretches_by_the_own_compute_and_does_not_compound(tmp_path: Path) -> None:
    wf, _ = _faults(tmp_path, "slowdown:rank=0,step=0,factor=3")
    wf.slowdown = 3.0
    wf.observe(0.02)  # a step computed 20 ms
    for _ in range(3):
        t0 = time.monotonic()
        wf.stretch()
        slept = time.monotonic() - t0
        assert slept >= 0.039  # (3 - 1) x 20 ms
        wf.observe(0.02 + slept)  # the step: its compute plus the stretch
        assert wf._compute_s == pytest.approx(0.02, abs=0.005)  # the base, not the stretched step


def test_no_slowdown_no_stretch(tmp_path: Path) -> None:
    wf, _ = _faults(tmp_path, "slowdown:rank=0,step=0,factor=3")
    wf.observe(1.0)
    t0 = time.monotonic()
    wf.stretch()
    assert time.monotonic() - t0 < 0.05


def test_health_message_decodes_and_a_bad_verdict_is_refused() -> None:
    m = wire.decode_worker({"t": "health", "verdict": "degraded", "probe": "fault", "detail": "x"})
    assert m == wire.HealthReport(verdict="degraded", probe="fault", detail="x")
    with pytest.raises(wire.WireError):
        wire.decode_worker({"t": "health", "verdict": "fine"})


def test_step_report_carries_wait_and_length() -> None:
    m = wire.decode_worker({"t": "step", "gen": 1, "step": 3, "step_s": 0.5, "wait_s": 0.2, "of": 60})
    assert isinstance(m, wire.Step) and m.wait_s == 0.2 and m.of == 60
    old = wire.decode_worker({"t": "step", "gen": 1, "step": 3, "step_s": 0.5})
    assert isinstance(old, wire.Step) and old.wait_s == 0.0 and old.of is None


def test_job_config_round_trips_the_straggler_config() -> None:
    cfg = JobConfig(
        script="x.py",
        detection=DetectionConfig(straggler=StragglerConfig(mode="migrate", factor=2.0, on_degraded="drain")),
    )
    assert job_config_from_json(job_config_to_json(cfg)).detection.straggler == cfg.detection.straggler


def test_cli_health_flags() -> None:
    import argparse

    from nonstop.cli.flags.detection import health, health_args

    ap = argparse.ArgumentParser()
    health_args(ap)
    assert health(ap.parse_args([])) == StragglerConfig()
    got = health(
        ap.parse_args(["--straggler", "migrate", "--straggler-factor", "2", "--on-degraded", "drain"])
    )
    assert got.mode == "migrate" and got.factor == 2.0 and got.on_degraded == "drain"


def test_demo_report_lists_migrations() -> None:
    from nonstop.demo.runner import migrations

    events: list[dict[str, Any]] = [
        {"event": "migration_start", "rank": 1},
        {
            "event": "migration_done",
            "rank": 1,
            "source": "1",
            "target": "2",
            "boundary": 23,
            "reason": "straggler",
            "pause_ratio": 1.5,
        },
        {
            "event": "migration_done",
            "rank": 0,
            "source": "0",
            "target": "1",
            "boundary": 9,
            "reason": "drain",
        },
    ]
    assert migrations(events) == [
        {"rank": 1, "from": "1", "to": "2", "step": 23, "reason": "straggler", "pause_steps": 0.5},
        {"rank": 0, "from": "0", "to": "1", "step": 9, "reason": "drain", "pause_steps": None},
    ]
