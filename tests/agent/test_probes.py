"""Health probes (agent/probes.py): the verdict logic, --health-cmd failing and passing, and
NVML only where pynvml exists."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nonstop.agent.probes import (
    CommandProbe,
    ProbeResult,
    _Clock,
    host_probe,
    memory_verdict,
    nvml_probe,
    parse_command_output,
    read_meminfo,
    run_probes,
    worst,
)


def test_memory_pressure_grades() -> None:
    assert memory_verdict({"MemTotal": 100, "MemAvailable": 50}).verdict == "healthy"
    assert memory_verdict({"MemTotal": 100, "MemAvailable": 5}).verdict == "degraded"
    assert memory_verdict({"MemTotal": 100, "MemAvailable": 1}).verdict == "failing"
    assert memory_verdict({}).verdict == "healthy"  # not readable: skipped


def test_read_meminfo_and_the_host_probe(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemAvailable:     20 kB\nHugePages_Total: 0\n")
    assert read_meminfo(f) == {"MemTotal": 1000, "MemAvailable": 20, "HugePages_Total": 0}
    assert host_probe(meminfo_path=f, clock=_Clock()).verdict == "failing"
    assert read_meminfo(tmp_path / "absent") == {}
    assert host_probe(meminfo_path=Path("/proc/meminfo"), clock=_Clock()).verdict in ("healthy", "degraded")


def test_a_clock_step_is_degraded() -> None:
    c = _Clock()
    assert c.check(1000.0, 10.0, 5.0).verdict == "healthy"
    assert c.check(1001.0, 11.0, 5.0).verdict == "healthy"
    assert c.check(1100.0, 12.0, 5.0).verdict == "degraded"


def test_command_output() -> None:
    assert parse_command_output(0, "").verdict == "healthy"
    assert parse_command_output(1, "").verdict == "failing"
    assert parse_command_output(None, "").verdict == "failing"
    got = parse_command_output(0, 'noise\n{"verdict": "degraded", "detail": "fan"}\n')
    assert got.verdict == "degraded" and "fan" in got.detail
    assert parse_command_output(3, '{"verdict": "healthy"}').verdict == "failing"  # the exit code wins


def test_health_cmd_failing_and_passing() -> None:
    assert CommandProbe("true")().verdict == "healthy"
    assert CommandProbe("exit 7")().verdict == "failing"
    assert CommandProbe("""echo '{"verdict": "degraded", "detail": "ecc"}'""")().verdict == "degraded"
    assert CommandProbe("sleep 5", timeout_s=0.2)().detail == "timed out"


def test_worst_and_a_broken_probe() -> None:
    def broken() -> ProbeResult:
        raise RuntimeError("no sensor")

    assert worst([]).verdict == "healthy"
    got = run_probes([lambda: ProbeResult(probe="a", verdict="healthy"), broken])
    assert got.verdict == "degraded" and "no sensor" in got.detail


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="pynvml (nvidia-ml-py) not installed")
def test_nvml_probe_where_present() -> None:
    probe = nvml_probe()
    if probe is not None:
        assert probe().verdict in ("healthy", "degraded", "failing")


def test_nvml_probe_absent_is_none() -> None:
    if importlib.util.find_spec("pynvml") is None:
        assert nvml_probe() is None
