"""What every benchmark script shares: summaries (median, min, max), ratios per round, the
machine and commit a report was measured on, JSON-lines reading and the one-line format of a
summary. Imported by the scripts in this folder as a sibling module."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["fmt", "machine_info", "ratio_summary", "read_jsonl", "run_stamp", "summarize"]


def summarize(values: Sequence[float]) -> dict[str, float] | None:
    vals = [float(v) for v in values]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def machine_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": importlib.metadata.version("torch"),
        "loadavg_at_start": list(os.getloadavg()),
    }


def run_stamp() -> dict[str, str]:
    """When a benchmark ran and on which commit of this checkout (for its JSON report)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a SIGKILL
    return out


def ratio_summary(
    num: list[dict[str, Any]], den: list[dict[str, Any]], key: str = "mttr_s"
) -> dict[str, Any] | None:
    """``num[i][key] / den[i][key]`` per round (both runs ok), then median, min and max."""
    per_round = [
        a[key] / b[key]
        for a, b in zip(num, den, strict=True)
        if a.get("ok") and b.get("ok") and a.get(key) is not None and b.get(key)
    ]
    s = summarize(per_round)
    return None if s is None else {**s, "per_round": per_round}


def fmt(s: dict[str, float] | None, *, digits: int = 2) -> str:
    if s is None:
        return "-"
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
