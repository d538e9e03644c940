"""Fail-slow (issue 21): one rank computing F x slower, left alone against migrated live.

What is measured. A data-parallel job of the demo transformer (``--model``, ``tiny`` by default,
batch 4, ``--step-delay`` 0.1 s of compute per step so that a step's time is mostly the rank's own
and a busy 2-core machine does not drown the ratio; gloo, CPU), 3 local nodes x 1 rank, one hot
spare per node, a 5 s heartbeat timeout (a loaded machine starves processes: no spurious hang).
From step ``--event-step`` on, rank 1 computes ``--factor`` x longer than it did (fault
``slowdown:rank=1,step=S,factor=F``: every step's own compute stretched). Three modes alternate
run by run: ``undisturbed`` (no fault; the reference), ``warn`` (the slowdown, ``--straggler warn``:
detected and reported, nothing done) and ``migrate`` (the slowdown, ``--straggler migrate`` with
``--migration-cost`` 0.5 s: rank 1 moved live to another node's spare). Per run, from the event log
and the demo's per-step start times (rank 0's ``step_intervals_s``; interval i = step i to i+1):

* ``detect_steps``: the first ``straggler`` event's step - the slowdown's step, and its ``factor``
  (rank 1's compute over its peers' median);
* ``boundary`` and ``pause_ratio``: the migration's step boundary and its longest step gap there
  over the median step (``migration_done``); ``migrated``: rank, reason;
* step intervals, median, in seconds: ``before_s`` (steps 1..S-1), ``during_s`` (S+1 up to the
  step before the boundary, or the end), ``after10_s`` (the 10 steps after the boundary, the new
  process's first one left out) and ``last10_s`` (the run's last 10);
* ``throughput_*``: the undisturbed run's (same round) median step over that figure (1.0: the
  undisturbed pace), and ``total_ratio``: the run's training time over the undisturbed run's;
* ``equal``: final weights bitwise equal to the first undisturbed run's; ``false_positives``:
  ``straggler`` events on a rank that was not slowed (every one of the undisturbed run's).

Summaries are median [min, max] over ``--runs`` rounds. Results go to
``benchmarks/results/straggler.json``::

    .venv/bin/python benchmarks/bench_straggler.py            # 60 steps, 3 rounds (~7 min)
    .venv/bin/python benchmarks/bench_straggler.py --quick    # 32 steps, 1 round (smoke)
    .venv/bin/python benchmarks/bench_straggler.py --factor 2 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.config import DetectorConfig  # noqa: E402
from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402
from nonstop.policy.straggler import StragglerConfig  # noqa: E402

MODES = ("undisturbed", "warn", "migrate")
SLOW_RANK = 1


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _run(args: argparse.Namespace, run_dir: Path, mode: str) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    s = args.event_step
    faults = () if mode == "undisturbed" else (f"slowdown:rank={SLOW_RANK},step={s},factor={args.factor:g}",)
    straggler = StragglerConfig(
        mode="migrate" if mode == "migrate" else "warn", migration_cost_s=args.migration_cost
    )
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model=args.model,
        batch=4,
        script_extra=("--step-delay", f"{args.step_delay:g}"),
        nproc_per_node=1,
        nnodes=3,
        spares=1,
        job_dir=run_dir,
        faults=faults,
        coordinator="127.0.0.1:0",
        lease_ttl_s=3.0,  # a loaded 2-core machine can starve a process: no spurious fencing
        detector=DetectorConfig(heartbeat_timeout_s=args.heartbeat_timeout),
        straggler=straggler,
    )
    t0 = time.monotonic()
    result = run_local_nodes(config, redirect_output=True)
    out: dict[str, Any] = {"mode": mode, "ok": result.state is JobState.DONE}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    result_file = run_dir / "result.json"
    if not out["ok"] or not result_file.exists():
        out["ok"] = False
        out["error"] = result.error
        return out
    doc = json.loads(result_file.read_text())
    iv: list[float] = doc["step_intervals_s"]
    events = read_events(run_dir / "events.jsonl")
    flagged = [e for e in events if e["event"] == "straggler"]
    on_slow = [e for e in flagged if mode != "undisturbed" and e.get("rank") == SLOW_RANK]
    done = [e for e in events if e["event"] == "migration_done"]
    b = done[0]["boundary"] if done else None
    out.update(
        final_hash=doc["final_hash"],
        flagged=[[e.get("rank"), e.get("step"), e.get("factor")] for e in flagged],
        false_positives=len(flagged) - len(on_slow),
        detect_steps=on_slow[0]["step"] - s if on_slow else None,
        detect_factor=on_slow[0].get("factor") if on_slow else None,
        migrations=[
            {k: e.get(k) for k in ("rank", "reason", "source", "target", "boundary", "pause_ratio")}
            for e in done
        ],
        boundary=b,
        pause_ratio=done[0].get("pause_ratio") if done else None,
        all_s=_median(iv[1:]),
        before_s=_median(iv[1:s]),
        during_s=_median(iv[s + 1 : (b - 1) if b is not None else len(iv)]),
        after10_s=_median(iv[b + 1 : b + 11]) if b is not None else None,
        last10_s=_median(iv[-10:]),
        total_s=sum(iv),
    )
    return out


def _relate(r: dict[str, Any], ref: dict[str, Any] | None, ref_hash: str | None) -> None:
    """Figures of run ``r`` relative to its round's undisturbed run ``ref``."""
    r["equal"] = r["ok"] and r.get("final_hash") == ref_hash
    if not r["ok"] or ref is None or not ref["ok"] or not ref["all_s"]:
        return
    base = ref["all_s"]
    for key in ("during", "after10", "last10"):
        v = r.get(f"{key}_s")
        r[f"throughput_{key}"] = base / v if v else None
    r["total_ratio"] = r["total_s"] / ref["total_s"] if ref["total_s"] else None


KEYS = (
    "detect_steps",
    "detect_factor",
    "boundary",
    "pause_ratio",
    "before_s",
    "during_s",
    "after10_s",
    "last10_s",
    "throughput_during",
    "throughput_after10",
    "throughput_last10",
    "total_s",
    "total_ratio",
    "false_positives",
    "wall_s",
)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--event-step", type=int, default=10, help="the step the slowdown starts at")
    p.add_argument("--factor", type=float, default=3.0, help="how many times longer rank 1 computes")
    p.add_argument("--step-delay", type=float, default=0.1, help="seconds of compute each step adds")
    p.add_argument("--migration-cost", type=float, default=0.5, help="--migration-cost of the migrate mode")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=3, help="rounds of the three modes")
    p.add_argument("--quick", action="store_true", help="tiny model, 32 steps, slowdown at 8, 1 round")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "straggler.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.event_step, args.runs = "tiny", 32, 8, 1
    if args.steps < args.event_step + 12:
        p.error("--steps must leave at least 12 steps after --event-step")
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="nonstop-bench-straggler-"))
    runs: list[dict[str, Any]] = []
    ref_hash: str | None = None
    try:
        for i in range(args.runs):
            ref: dict[str, Any] | None = None
            for mode in MODES:
                r = _run(args, work / f"{mode}-{i}", mode)
                r["round"] = i
                if mode == "undisturbed":
                    ref = r
                    if ref_hash is None and r["ok"]:
                        ref_hash = r["final_hash"]
                _relate(r, ref, ref_hash)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "final_hash"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in runs if r["ok"]]
    summary = {
        mode: {k: summarize([r[k] for r in ok if r["mode"] == mode and r.get(k) is not None]) for k in KEYS}
        | {
            "runs": sum(r["mode"] == mode for r in runs),
            "ok": sum(r["mode"] == mode for r in ok),
            "equal": sum(r["equal"] for r in ok if r["mode"] == mode),
            "detected": sum(r["detect_steps"] is not None for r in ok if r["mode"] == mode),
            "migrated": sum(bool(r["migrations"]) for r in ok if r["mode"] == mode),
        }
        for mode in MODES
    }
    report = {
        "settings": vars(args) | {"out": str(args.out), "slow_rank": SLOW_RANK},
        "machine": info | {"loadavg_at_end": list(os.getloadavg())},
        "stamp": run_stamp(),
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"\nslowdown x{args.factor:g} of rank {SLOW_RANK} at step {args.event_step} of {args.steps}, "
        f"model {args.model}; median [min-max] over {args.runs} round(s)"
    )
    print(
        f"{'':12} {'detect (steps)':>16} {'boundary':>14} {'pause (steps)':>18} {'during (s)':>20} "
        f"{'after 10 (s)':>20} {'last 10 (s)':>20} {'thru last10':>18} {'total/undist':>18} equal"
    )
    for mode in MODES:
        s = summary[mode]
        print(
            f"{mode:12} {fmt(s['detect_steps'], digits=0):>16} {fmt(s['boundary'], digits=0):>14} "
            f"{fmt(s['pause_ratio']):>18} {fmt(s['during_s'], digits=3):>20} "
            f"{fmt(s['after10_s'], digits=3):>20} {fmt(s['last10_s'], digits=3):>20} "
            f"{fmt(s['throughput_last10']):>18} {fmt(s['total_ratio']):>18} {s['equal']}/{s['runs']}"
        )
    return 0 if len(ok) == len(runs) and all(r["equal"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
