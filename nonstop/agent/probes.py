"""Health probes (issue 21): what a node agent can check of its host, as a graded verdict.

A probe is a callable returning a :class:`ProbeResult` -- ``healthy``, ``degraded`` or
``failing`` with a one-line detail. :func:`run_probes` runs several and keeps the worst verdict.
Built in:

* :func:`host_probe` -- memory pressure from ``/proc/meminfo`` (``MemAvailable`` below 10% of
  ``MemTotal``: degraded, below 3%: failing) and the wall clock against the monotonic clock
  (a step of more than ``clock_jump_s`` between two calls: degraded). Disk error counters are
  not read here (not readable without privileges on most hosts): skipped;
* :class:`CommandProbe` -- ``--health-cmd CMD``, like a container liveness probe: exit 0 is
  healthy, any other exit (or a timeout, or a command that cannot start) failing; an optional
  last stdout line ``{"verdict": "degraded", "detail": "..."}`` refines it. The command is the
  operator's own: split like a shell would (:func:`shlex.split`) but run without one (pass
  ``sh -c '...'`` for shell syntax), killed with its process group at the timeout, and only the
  last :data:`OUTPUT_TAIL` bytes of its stdout are read;
* :func:`nvml_probe` -- only where the ``pynvml`` module (``nvidia-ml-py``) imports: ECC
  uncorrectable errors (failing) and thermal or power throttling (degraded). None elsewhere.

The verdict logic (:func:`memory_verdict`, :func:`parse_command_output`, :func:`worst`) is pure;
the readers take their input through arguments so tests need no special host.

Each node agent runs these on a period, on a thread of its own
(:mod:`~nonstop.agent.probes`), and sends each verdict change as a ``HealthMsg``
(the worker's ``degrade`` fault sends the same message); the coordinator's
:class:`~nonstop.coordinator.health.Health` grades and drains on it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "OUTPUT_TAIL",
    "VERDICTS",
    "CommandProbe",
    "ProbeResult",
    "host_probe",
    "memory_verdict",
    "nvml_probe",
    "parse_command_output",
    "read_meminfo",
    "run_probes",
    "worst",
]

VERDICTS = ("healthy", "degraded", "failing")  # in order of severity
OUTPUT_TAIL = 4096  # bytes of a health command's stdout read (its end: the JSON line is last)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    probe: str
    verdict: str
    detail: str = ""


def worst(results: Iterable[ProbeResult]) -> ProbeResult:
    """The most severe result (the first of equals); healthy when there is none."""
    out = ProbeResult(probe="none", verdict="healthy")
    for r in results:
        if VERDICTS.index(r.verdict) > VERDICTS.index(out.verdict):
            out = r
    return out


def read_meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """``/proc/meminfo`` as name -> kB (empty when not readable)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0])
    return out


def memory_verdict(
    meminfo: Mapping[str, int], *, degraded: float = 0.10, failing: float = 0.03
) -> ProbeResult:
    total, avail = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
    if not total or avail is None:
        return ProbeResult(probe="memory", verdict="healthy", detail="meminfo not readable: skipped")
    frac = avail / total
    verdict = "failing" if frac < failing else "degraded" if frac < degraded else "healthy"
    return ProbeResult(probe="memory", verdict=verdict, detail=f"{frac:.1%} of memory available")


class _Clock:
    """Wall clock minus monotonic clock between two calls: a jump means the clock was stepped."""

    def __init__(self) -> None:
        self.offset: float | None = None

    def check(self, wall: float, mono: float, jump_s: float) -> ProbeResult:
        offset = wall - mono
        prev, self.offset = self.offset, offset
        if prev is not None and abs(offset - prev) > jump_s:
            return ProbeResult(
                probe="clock", verdict="degraded", detail=f"wall clock jumped {offset - prev:+.2f}s"
            )
        return ProbeResult(probe="clock", verdict="healthy")


_clock = _Clock()


def host_probe(
    *, meminfo_path: Path = Path("/proc/meminfo"), clock_jump_s: float = 5.0, clock: _Clock = _clock
) -> ProbeResult:
    """Memory pressure and clock steps of this host (see the module docstring)."""
    return worst(
        [
            memory_verdict(read_meminfo(meminfo_path)),
            clock.check(time.time(), time.monotonic(), clock_jump_s),
        ]
    )


def parse_command_output(returncode: int | None, stdout: str) -> ProbeResult:
    """A health command's result: exit 0 healthy, else (or None: timed out) failing; a last
    stdout line that is a JSON object with ``verdict`` (and ``detail``) refines it."""
    verdict = "healthy" if returncode == 0 else "failing"
    detail = "timed out" if returncode is None else f"exit {returncode}"
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    if lines:
        try:
            doc = json.loads(lines[-1])
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            if doc.get("verdict") in VERDICTS and returncode == 0:
                verdict = str(doc["verdict"])
            if isinstance(doc.get("detail"), str):
                detail = f"{detail}: {doc['detail']}"
    return ProbeResult(probe="command", verdict=verdict, detail=detail)


@dataclass(frozen=True)
class CommandProbe:
    """``--health-cmd CMD``: ``shlex.split(command)`` run without a shell, stdin closed, stderr
    discarded, at most ``timeout_s`` seconds (then its process group is SIGKILLed: failing,
    "timed out"); ``env``: its environment (None: this process's). A command that cannot start
    (not found, not executable) is failing. Only the last :data:`OUTPUT_TAIL` bytes of stdout
    are read (:func:`parse_command_output`)."""

    command: str
    timeout_s: float = 10.0
    env: Mapping[str, str] | None = field(default=None, compare=False, hash=False)

    def __call__(self) -> ProbeResult:
        argv = shlex.split(self.command)
        if not argv:
            return ProbeResult(probe="command", verdict="failing", detail="empty command")
        with tempfile.TemporaryFile() as out:  # a file, not a pipe: a chatty command never blocks
            try:
                p = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.DEVNULL,
                    env=None if self.env is None else dict(self.env),
                    start_new_session=True,  # its own process group: killed whole at the timeout
                )
            except OSError as e:
                return ProbeResult(
                    probe="command", verdict="failing", detail=f"cannot run {argv[0]!r}: {e.strerror or e}"
                )
            try:
                rc = p.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    p.kill()
                p.wait()
                return parse_command_output(None, "")
            size = out.seek(0, os.SEEK_END)
            out.seek(max(0, size - OUTPUT_TAIL))
            return parse_command_output(rc, out.read(OUTPUT_TAIL).decode(errors="replace"))


def nvml_probe() -> Callable[[], ProbeResult] | None:
    """An NVML probe where ``pynvml`` imports and initializes; None elsewhere (no GPU, no module)."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:
        return None

    def probe() -> ProbeResult:
        results = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(
                    h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            except Exception:
                ecc = 0
            if ecc:
                results.append(
                    ProbeResult(probe="nvml", verdict="failing", detail=f"GPU {i}: {ecc} uncorrected ECC")
                )
            try:
                reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            except Exception:
                reasons = 0
            bad = pynvml.nvmlClocksThrottleReasonHwSlowdown | pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
            if reasons & bad:
                results.append(ProbeResult(probe="nvml", verdict="degraded", detail=f"GPU {i}: throttled"))
        return worst(results) if results else ProbeResult(probe="nvml", verdict="healthy")

    return probe


def run_probes(probes: Iterable[Callable[[], ProbeResult]]) -> ProbeResult:
    """Run each probe (one that raises counts as degraded: the probe itself is broken) and keep
    the worst verdict."""
    results = []
    for p in probes:
        try:
            results.append(p())
        except Exception as e:
            results.append(
                ProbeResult(probe=getattr(p, "__name__", "probe"), verdict="degraded", detail=str(e))
            )
    return worst(results)
