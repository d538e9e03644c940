"""Every-step snapshot overhead on W-train: throughput with a snapshot every step ÷ without.

What is measured. A real data-parallel job (``nonstop run``, ``--nproc`` ranks on gloo,
``OMP_NUM_THREADS`` = cpu_count // nproc) trains the demo decoder-only transformer
(``--model``, ``medium`` = ~26M parameters: ~0.3 GB of model + AdamW state per rank) on the
demo's generated data. Three contenders run the same job, alternating round by round
(one warm-up round is not counted):

* ``off``: ``--snapshot off`` (no per-step snapshot; the reference throughput);
* ``sync``: ``--snapshot sync`` (the copy into shared memory blocks the loop);
* ``overlapped``: ``--snapshot overlapped`` (the default: the bulk copy of step k runs in a
  background thread during step k+1, fenced before its optimizer step).

The figure is the loop's pace on rank 0: the interval between the starts of consecutive
``train_step`` calls (compute + snapshot stall + everything else between steps), median over
the steps after ``--skip`` warm-up steps. Throughput ratio = median interval with ``off`` ÷
median interval with the contender, per round, then median/min/max over rounds. Lazy
persistence is disabled (``--persist-every 0``) so only capture is measured; the final
persist at exit happens after the timed steps.

With ``--exact`` the contenders are instead ``overlapped`` (the gradient allreduce) and
``exact``: the same job made elastic (``--min-world-size`` = nproc - 1), whose gradient mean does
not depend on the world size (``nonstop/train/exactsum.py``: an all-to-all, an ordered sum and an
all-gather); the ratio is then overlapped's interval / exact's.

With ``--budget F`` the contenders are ``off``, ``overlapped`` (every step) and ``budget``: the same
job with ``--snapshot-budget F`` (``nonstop/policy/cadence.py``: the coordinator measures the stall
over the first 20 steps and widens the interval to the smallest within F), run long enough (60 steps,
the first 30 not counted) that the widened interval is what is measured; the job's
``snapshot_cadence`` event (the interval chosen, the stall and step measured) is kept per round.

Run it::

    .venv/bin/python benchmarks/bench_step_overhead.py             # -> results/step_overhead.json
    .venv/bin/python benchmarks/bench_step_overhead.py --quick     # tiny model, smoke run
    .venv/bin/python benchmarks/bench_step_overhead.py --exact --nproc 3   # -> step_overhead-exact.json
    .venv/bin/python benchmarks/bench_step_overhead.py --budget 0.0001     # -> step_overhead-budget.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import run_job  # noqa: E402

MODES = ("off", "sync", "overlapped")
EXACT_MODES = ("overlapped", "exact")  # --exact: the elastic job's world-size-independent mean
BUDGET_MODES = ("off", "overlapped", "budget")  # --budget F: every step vs the interval tuned to F
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "step_overhead.json"


def one_job(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    job_dir = work / f"job-{mode}-{time.monotonic_ns()}"
    result_file = job_dir / "result.json"
    cfg = demo_job_config(
        result=result_file,
        steps=args.steps,
        model=args.model,
        batch=args.batch,
        nproc_per_node=args.nproc,
        job_dir=job_dir,
        snapshot="overlapped" if mode in ("exact", "budget") else mode,
        snapshot_budget=args.budget if mode == "budget" else 0.0,
        min_world_size=args.nproc - 1 if mode == "exact" else 0,
        persist_every=0,
        persist_url=str(job_dir / "ckpt"),
    )
    res = run_job(cfg, redirect_output=True)
    if res.state is not JobState.DONE or not result_file.exists():
        raise RuntimeError(f"{mode} job failed: {res.error}")
    out = json.loads(result_file.read_text())
    intervals = out["step_intervals_s"][args.skip :]
    cadence = [e for e in read_events(job_dir / "events.jsonl") if e["event"] == "snapshot_cadence"]
    shutil.rmtree(job_dir, ignore_errors=True)
    got: dict[str, Any] = {"median_interval_s": statistics.median(intervals), "intervals_s": intervals}
    if mode == "budget":
        if not cadence:
            raise RuntimeError("the budget job never announced an interval: run more --steps")
        got["cadence"] = cadence
    return got


def summarize(rounds: list[dict[str, dict[str, Any]]], modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = modes[0]
    for mode in modes:
        vals = [r[mode]["median_interval_s"] for r in rounds]
        entry: dict[str, Any] = {
            "median_interval_s": statistics.median(vals),
            "min_s": min(vals),
            "max_s": max(vals),
        }
        if mode != base:
            ratios = [r[base]["median_interval_s"] / r[mode]["median_interval_s"] for r in rounds]
            entry[f"throughput_vs_{base}"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "how": f"per round: median interval with {base} / with this mode; then median/min/max",
            }
        out[mode] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="medium")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--skip", type=int, default=3, help="first step intervals not counted (warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="counted rounds after one warm-up round")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run")
    ap.add_argument("--exact", action="store_true", help="allreduce vs the elastic job's exact mean")
    ap.add_argument("--budget", type=float, default=0.0, help="every step vs --snapshot-budget F")
    args = ap.parse_args(argv)
    modes = EXACT_MODES if args.exact else BUDGET_MODES if args.budget > 0 else MODES
    if args.exact and args.out == DEFAULT_OUT:
        args.out = DEFAULT_OUT.with_name("step_overhead-exact.json")
    if args.budget > 0 and args.out == DEFAULT_OUT:
        args.out = DEFAULT_OUT.with_name("step_overhead-budget.json")
    if args.budget > 0:  # the tuner measures 20 steps, then announces a few steps ahead
        args.steps, args.skip = max(args.steps, 60), max(args.skip, 30)
    if args.quick:
        args.model, args.runs = "tiny", 1
        args.steps, args.skip = (80, 60) if args.budget > 0 else (8, 2)  # (tiny steps: a longer margin)
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-overhead-", dir=REPO_ROOT / ".nonstop") as tmp:
        for i in range(args.runs + 1):
            r = {}
            for mode in modes:
                r[mode] = one_job(mode, args, Path(tmp))
                ms = r[mode]["median_interval_s"] * 1e3
                print(f"[bench] round {i} {mode}: median step interval {ms:.1f} ms", flush=True)
            if i > 0:
                rounds.append(r)
    report = {
        "benchmark": "step_overhead",
        "what": "W-train throughput with a snapshot every step / without (loop pace on rank 0)",
        "workload": {k: getattr(args, k) for k in ("nproc", "model", "batch", "steps", "skip", "runs")},
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "rounds": rounds,
        "summary": summarize(rounds, modes),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'mode':<12} {'median step ms':>15} {'throughput vs ' + modes[0]:>26}")
    for mode, e in report["summary"].items():
        ratio = e.get(f"throughput_vs_{modes[0]}", {}).get("median")
        print(
            f"{mode:<12} {e['median_interval_s'] * 1e3:>15.1f} {'' if ratio is None else f'{ratio:.3f}':>26}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
