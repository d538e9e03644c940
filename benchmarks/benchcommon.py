"""What every benchmark script shares: summaries (median, min, max), ratios per round, the
machine and commit a report was measured on, JSON-lines reading and the one-line format of a
summary. Imported by the scripts in this folder as a sibling module."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "against_reference",
    "fmt",
    "machine_info",
    "ratio_summary",
    "read_jsonl",
    "run_stamp",
    "summarize",
    "summary_by",
    "two_node_job",
]


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


Run = dict[str, Any]


def against_reference(
    run: Callable[[Path, str | None], Run], contenders: Sequence[str], *, warmup: int, runs: int, name: str
) -> tuple[Run, list[Run]]:
    """A job without faults (``run(dir, None)``: the reference), then ``warmup + runs`` rounds of
    every contender in turn (``run(dir, contender)``), in a scratch directory removed after. Each
    run is marked ``warmup`` and ``equal`` (ok, and its ``final_hash`` the reference's) and printed
    as a JSON line without the hash."""
    work = Path(tempfile.mkdtemp(prefix=f"nonstop-bench-{name}-"))
    out: list[Run] = []
    try:
        ref = run(work / "reference", None)
        for i in range(warmup + runs):
            for c in contenders:
                r = run(work / f"{c}-{i}", c)
                r["warmup"] = i < warmup
                r["equal"] = r.get("final_hash") == ref.get("final_hash") if r["ok"] else False
                out.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "final_hash"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ref, out


def summary_by(
    runs: Sequence[Run], field: str, contenders: Sequence[str], keys: Sequence[str]
) -> dict[str, Any]:
    """For each contender (``run[field]``), over its counted runs (not warm-up, ok): every key's
    :func:`summarize`, how many ended ``equal`` and how many there were."""
    counted = [r for r in runs if not r["warmup"] and r["ok"]]
    out: dict[str, Any] = {}
    for c in contenders:
        mine = [r for r in counted if r[field] == c]
        out[c] = {k: summarize([r[k] for r in mine if r.get(k) is not None]) for k in keys}
        out[c] |= {"equal": sum(r["equal"] for r in mine), "runs": len(mine)}
    return out


def two_node_job(
    run_dir: Path, *, steps: int, model: str, faults: tuple[str, ...], **settings: Any
) -> tuple[Any, Any, str | None]:
    """Run, in a fresh ``run_dir``, a demo job of 2 local nodes x 2 ranks with a hot spare each
    (``settings``: more of its config): its JobConfig, its JobResult, and its final weights' hash
    once it is done (else None). For the recovery benchmarks (bench_rescue, bench_survivors)."""
    from nonstop.coordinator.loop import JobState
    from nonstop.demo.runner import demo_job_config
    from nonstop.launch.local_nodes import run_local_nodes

    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = demo_job_config(
        result=run_dir / "result.json",
        steps=steps,
        model=model,
        nproc_per_node=2,
        nnodes=2,
        spares=1,
        job_dir=run_dir,
        faults=faults,
        coordinator="127.0.0.1:0",
        lease_ttl_s=3.0,
        # a fixed interval unless the benchmark sets one, as its BENCHMARKS.md figures were measured
        **({"snapshot_budget": 0.0} | settings),
    )
    result = run_local_nodes(config, redirect_output=True)
    if result.state is not JobState.DONE:
        return config, result, None
    return config, result, json.loads((run_dir / "result.json").read_text())["final_hash"]
