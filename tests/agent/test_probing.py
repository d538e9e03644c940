"""A node agent's probe thread (agent/probes.py): verdict changes sent once, a hanging health
command timed out as failing, the flags validated at start, and the agent's health message
decoded and acted on by the coordinator's side (wire.py, healthops.py)."""

from __future__ import annotations

import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.agent.probe_thread import MAX_DETAIL, ProbeThread, health_message, node_probes
from nonstop.agent.probes import OUTPUT_TAIL, CommandProbe, ProbeResult
from nonstop.config import DetectionConfig, ProbeConfig
from nonstop.errors import UsageError
from nonstop.protocol import wire


class FakeClock:
    """``wait`` for a ProbeThread: records each sleep, stops after ``rounds`` rounds."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.slept: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.slept.append(seconds)
        return len(self.slept) >= self.rounds


def scripted(*verdicts: str) -> Any:
    """A probe saying ``verdicts`` in turn (then the last one for ever)."""
    said = list(verdicts)

    def probe() -> ProbeResult:
        v = said.pop(0) if len(said) > 1 else said[0]
        return ProbeResult(probe="fake", verdict=v, detail=f"said {v}")

    return probe


def test_the_first_verdict_and_each_change_are_sent_once() -> None:
    sent: list[dict[str, Any]] = []
    clock = FakeClock(rounds=7)
    made: list[int] = []

    def make() -> list[Any]:
        made.append(1)
        return [scripted("healthy", "healthy", "degraded", "degraded", "failing", "healthy", "healthy")]

    t = ProbeThread(make, period_s=2.5, send=sent.append, wait=clock)
    t.run()
    assert t.rounds == 7 and clock.slept == [2.5] * 7 and made == [1]  # probes made once
    assert [m["verdict"] for m in sent] == ["healthy", "degraded", "failing", "healthy"]
    assert all(m["t"] == "health" for m in sent)
    assert sent[1] == {"t": "health", "verdict": "degraded", "probe": "fake", "detail": "said degraded"}


def test_the_worst_probe_wins_and_forget_resends() -> None:
    sent: list[dict[str, Any]] = []
    t = ProbeThread(
        lambda: [scripted("healthy"), scripted("degraded")], period_s=1.0, send=sent.append, wait=FakeClock(1)
    )
    assert t.check().verdict == "degraded"
    t.check()
    assert len(sent) == 1
    t.forget()  # a restarted coordinator knows no verdict
    t.check()
    assert [m["verdict"] for m in sent] == ["degraded", "degraded"]


def test_a_broken_probe_or_send_does_not_stop_the_thread() -> None:
    def broken() -> ProbeResult:
        raise RuntimeError("no sensor")

    calls: list[dict[str, Any]] = []

    def send(m: dict[str, Any]) -> None:
        calls.append(m)
        if len(calls) == 1:
            raise OSError("channel closed")

    t = ProbeThread(lambda: [broken], period_s=1.0, send=send, wait=FakeClock(3))
    t.run()
    assert t.rounds == 3 and calls[0]["verdict"] == "degraded" and "no sensor" in calls[0]["detail"]


def test_the_thread_stops_on_stop() -> None:
    sent: list[dict[str, Any]] = []
    t = ProbeThread(lambda: [scripted("healthy")], period_s=30.0, send=sent.append)
    t.start()
    deadline = time.monotonic() + 30
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    t.stop()
    assert t._thread is not None
    t._thread.join(timeout=30)
    assert not t._thread.is_alive() and sent[0]["verdict"] == "healthy"


def test_a_hanging_health_command_times_out_as_failing(tmp_path: Path) -> None:
    # the shell's child (sleep) is in the command's process group: it is killed whole
    probe = CommandProbe("sh -c 'sleep 60; true'", timeout_s=0.3)
    t0 = time.monotonic()
    got = probe()
    assert got.verdict == "failing" and got.detail == "timed out"
    assert time.monotonic() - t0 < 30  # not the command's 60 s
    sent: list[dict[str, Any]] = []
    ProbeThread(lambda: [probe], period_s=1.0, send=sent.append, wait=FakeClock(1)).run()
    assert sent == [{"t": "health", "verdict": "failing", "probe": "command", "detail": "timed out"}]


def test_the_health_command_runs_without_a_shell_with_its_env(tmp_path: Path) -> None:
    marker = tmp_path / "x; touch pwned"
    # no shell: ';' is an argument, not a second command
    assert CommandProbe(f"ls '{marker}'")().verdict == "failing"
    assert not (tmp_path / "pwned").exists()
    script = tmp_path / "check.sh"
    script.write_text(
        '[ "$NONSTOP_NODE" = 1 ] && { echo noise; '
        """echo '{"verdict": "failing", "detail": "ecc"}'; exit 1; }\n"""
        "exit 0\n"
    )
    assert CommandProbe(f"sh {script}", env={"NONSTOP_NODE": "0"})().verdict == "healthy"
    got = CommandProbe(f"sh {script}", env={"NONSTOP_NODE": "1"})()
    assert got.verdict == "failing" and got.detail == "exit 1: ecc"
    assert CommandProbe("/no/such/check")().verdict == "failing"


def test_only_the_tail_of_a_chatty_command_is_read() -> None:
    code = 'print(\'x\' * 100000); print(\'{"verdict": "degraded", "detail": "fan"}\')'
    got = CommandProbe(f"{sys.executable} -c {shlex.quote(code)}")()
    assert got.verdict == "degraded" and got.detail == "exit 0: fan"
    msg = health_message(ProbeResult(probe="p", verdict="degraded", detail="y" * OUTPUT_TAIL))
    assert len(msg["detail"]) == MAX_DETAIL


def test_node_probes() -> None:
    assert len(node_probes(ProbeConfig())) >= 1  # the host probe (and NVML where present)
    with_cmd = node_probes(ProbeConfig(command="true", timeout_s=3.0), env={"A": "1"})
    cmd = with_cmd[-1]
    assert isinstance(cmd, CommandProbe) and cmd.timeout_s == 3.0 and cmd.env == {"A": "1"}
    assert all(p().verdict in ("healthy", "degraded", "failing") for p in with_cmd)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"period_s": -1.0}, "--probe-period"),
        ({"period_s": float("nan")}, "--probe-period"),
        ({"timeout_s": 0.0}, "--health-timeout"),
        ({"command": "   "}, "--health-cmd is empty"),
        ({"command": "check 'unclosed"}, "--health-cmd"),
        ({"command": "true", "period_s": 0.0}, "--probe-period > 0"),
    ],
)
def test_bad_flags_fail_at_start(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(UsageError, match=says):
        ProbeConfig(**kw)
    assert not ProbeConfig(period_s=0).enabled and ProbeConfig().enabled


def test_the_agents_health_message_is_decoded() -> None:
    m = wire.decode_agent({"t": "health", "verdict": "failing", "probe": "command", "detail": "exit 1"})
    assert m == wire.HealthReport(verdict="failing", probe="command", detail="exit 1")
    with pytest.raises(wire.WireError):
        wire.decode_agent({"t": "health", "verdict": "sick"})
    # the worker's (the degrade fault's) still is
    assert isinstance(wire.decode_worker({"t": "health", "verdict": "healthy"}), wire.HealthReport)


def test_probe_thread_is_not_the_callers() -> None:
    names: list[str] = []

    def probe() -> ProbeResult:
        names.append(threading.current_thread().name)
        return ProbeResult(probe="p", verdict="healthy")

    got = threading.Event()
    t = ProbeThread(lambda: [probe], period_s=30.0, send=lambda m: got.set())
    t.start()
    assert got.wait(30)
    t.stop()
    assert names == ["nonstop-probes"]


def test_job_config_cli_and_node_command_carry_the_probes(tmp_path: Path) -> None:
    import argparse

    from nonstop.cli.flags.detection import probe_args, probes
    from nonstop.config import JobConfig, job_config_from_json, job_config_to_json
    from nonstop.launch.local_nodes import node_command

    ap = argparse.ArgumentParser()
    probe_args(ap)
    assert probes(ap.parse_args([])) == ProbeConfig()
    got = probes(ap.parse_args(["--probe-period", "2", "--health-cmd", "-x check", "--health-timeout", "3"]))
    assert got == ProbeConfig(period_s=2.0, command="-x check", timeout_s=3.0)
    cfg = JobConfig(
        script="x.py",
        nnodes=2,
        coordinator="127.0.0.1:1",
        job_dir=tmp_path,
        detection=DetectionConfig(probes=got),
    )
    assert job_config_from_json(job_config_to_json(cfg)).detection.probes == got
    cmd = node_command(cfg, 1, "127.0.0.1:1")
    assert "--health-cmd=-x check" in cmd and "--probe-period=2.0" in cmd and "--health-timeout=3.0" in cmd
    # what a node's own `nonstop run` makes of them
    from nonstop.cli import build_parser

    parser, _ = build_parser()
    ns = parser.parse_args(cmd[cmd.index("run") :])
    assert probes(ns) == got
