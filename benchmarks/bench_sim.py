"""The simulator's own figures: speed, memory growth, accuracy, and the projection table.

What is measured.

* **Speed**: one simulated run of 16,384 GPUs (2,048 nodes x 8) x 54 days, Meta's higher rate
  (6.50 failures / 1,000 node-days), per strategy; contenders alternate run by run (one warm-up,
  then ``--runs`` counted); median and min-max of the wall time.
* **Memory**: peak allocation (tracemalloc; numpy reports its buffers to it) of one nonstop run
  vs the job's node count, Weibull failures (shape 0.8: the sampler's per-node arrays are the
  largest allocation); bytes per node should stay flat (memory linear in nodes).
* **Accuracy**: simulated ETTR vs the closed forms (BENCH.md's "simulator accuracy" row): Meta's
  E[ETTR] at dt = 5 and 60 min (N = 2,048, r_f = 6.5e-3/node-day, u0 = 5 min, w_cp = 0) and the
  exact renewal formula.
* **Projection**: ETTR and lost GPU-hours per day at 1,024, 16,384 and 100,352 GPUs for each
  strategy, median [min-max] over ``--seeds`` failure draws (the same draws for every strategy),
  with the calibration used (every figure's source) in the JSON. Besides nonstop's defaults, two
  elastic variants (``--min-world-size`` 90% of the GPUs, ``--shards-per-rank`` 4): ``--survivors
  auto`` (the runtime's policy chooses per failure) and ``continue`` (always shrink first); and
  ``nonstop advised``: ``nonstop advise``'s settings for that job, chosen on two other failure
  draws (its choice is in each row's ``params``), and the same with ``--may-drop-batch``.
* **Fail-slow** (``--fail-slow``, alone, to its own file): the same projection with fail-slow
  ranks and degraded-before-failure signals (:mod:`nonstop.sim.failslow`, its default rates,
  each sourced or flagged as an assumption), nonstop with and without its proactive moves (the
  runtime's ``--straggler migrate --on-degraded drain`` against ``warn``/``warn``), beside the
  baselines, which have none; then what the moves are worth at 16,384 GPUs (llama3) as the
  assumed fail-slow rate and share of warned failures vary (``advisor.proactive_worth``, means
  over the seeds).

Run it::

    .venv/bin/python benchmarks/bench_sim.py              # -> benchmarks/results/sim.json
    .venv/bin/python benchmarks/bench_sim.py --quick      # smaller, for a smoke run
    .venv/bin/python benchmarks/bench_sim.py --fail-slow  # -> benchmarks/results/sim-failslow.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from nonstop.policy.decisions import FailureKind  # noqa: E402
from nonstop.policy.survivors import SurvivorMode  # noqa: E402
from nonstop.sim import theory  # noqa: E402
from nonstop.sim.advisor import advise, proactive_worth  # noqa: E402
from nonstop.sim.api import JobSpec, SimResult, Strategy  # noqa: E402
from nonstop.sim.calibrate import Calibration, load_calibration  # noqa: E402
from nonstop.sim.engine import EventSource, simulate  # noqa: E402
from nonstop.sim.failslow import DEFAULT_FAILSLOW, FailSlowModel, WithFailSlow  # noqa: E402
from nonstop.sim.failures import Cause, FailureModel, preset  # noqa: E402
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams  # noqa: E402
from nonstop.sim.proactivesim import NO_PROACTIVE  # noqa: E402
from nonstop.sim.strategies import CheckpointRestart, TorchftLike  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "sim.json"
FAILSLOW_OUT = REPO_ROOT / "benchmarks" / "results" / "sim-failslow.json"
ADVISE_HOST_GB = 1024.0  # nonstop advise's default --host-mem-gb
ADVISE_SEEDS = (100, 101)  # the advisor's draws: not the projection's 0 .. --seeds - 1


def machine_info() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": list(os.getloadavg()),
        "commit": commit,
    }


def stats(vals: list[float]) -> dict[str, float]:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def strategies(
    job: JobSpec, model: FailureModel, cal: Calibration, *, variants: bool = False
) -> list[Strategy]:
    lam = model.job_rate_per_s(job.num_nodes)
    blocking = cal.dcp_blocking_s(job.state_bytes_per_gpu)
    write = cal.durable_write_s(job.state_bytes_per_gpu, job.num_gpus, job.gpus_per_node)
    interval = max(theory.optimal_interval(ckpt_s=blocking, rate_per_s=lam), write)
    out: list[Strategy] = [
        CheckpointRestart(job=job, interval_s=interval, calibration=cal),
        TorchftLike(job=job, calibration=cal),
        Nonstop(job=job, calibration=cal),
    ]
    if variants:
        for mode in (SurvivorMode.AUTO, SurvivorMode.CONTINUE):
            params = NonstopParams(min_world_size=int(0.9 * job.num_gpus), shards_per_rank=4, survivors=mode)
            ns = Nonstop(job=job, params=params, calibration=cal)
            ns.name = f"nonstop elastic {mode.value}"
            out.append(ns)
        out.append(advised(job, model, cal))
        out.append(advised(job, model, cal, may_drop_batch=True))
    return out


def advised(job: JobSpec, model: FailureModel, cal: Calibration, *, may_drop_batch: bool = False) -> Nonstop:
    """nonstop with ``nonstop advise``'s settings for this job (its default host memory), chosen
    on other failure draws (:data:`ADVISE_SEEDS`) than the ones the projection measures it on;
    ``may_drop_batch``: ``advise --may-drop-batch`` (a shrunk job may skip the lost shares of its
    batch, torchft's semantics)."""
    adv = advise(
        job=job,
        model=model,
        calibration=cal,
        host_budget_bytes=ADVISE_HOST_GB * 1e9,
        seeds=ADVISE_SEEDS,
        may_drop_batch=may_drop_batch,
    )
    ns = Nonstop(job=job, params=adv.best.params(), calibration=cal)
    ns.name = "nonstop advised, batch may drop" if may_drop_batch else "nonstop advised"
    return ns


def bench_speed(cal: Calibration, runs: int, days: float) -> dict[str, Any]:
    job = JobSpec(num_gpus=16_384, days=days)
    model = preset("meta-high")
    strats = strategies(job, model, cal)
    times: dict[str, list[float]] = {s.name: [] for s in strats}
    failures = 0
    for rnd in range(runs + 1):  # round 0: warm-up
        for s in strats:
            t0 = time.perf_counter()
            r = simulate(job, model, s, seed=rnd)
            dt = time.perf_counter() - t0
            failures = r.failures
            if rnd:
                times[s.name].append(dt)
    return {
        "job": {"num_gpus": job.num_gpus, "days": job.days, "preset": model.name},
        "failures_per_run": failures,
        "wall_s": {k: stats(v) for k, v in times.items()},
        "goal_s": 10.0,
    }


def bench_memory(cal: Calibration, days: float, sizes: list[int]) -> list[dict[str, Any]]:
    out = []
    for gpus in sizes:
        job = JobSpec(num_gpus=gpus, days=days)
        # persist rarely: at millions of GPUs one persist takes longer than the default interval
        strat = Nonstop(job=job, params=NonstopParams(persist_every_s=1e6), calibration=cal)
        # Weibull renewals draw per-node arrays (the Poisson path draws per failure only)
        model = FailureModel(rate_per_node_day=6.5e-3, shape=0.8)
        tracemalloc.start()
        r = simulate(job, model, strat, seed=0)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.append(
            {
                "num_gpus": gpus,
                "num_nodes": job.num_nodes,
                "failures": r.failures,
                "peak_bytes": peak,
                "bytes_per_node": peak / job.num_nodes,
            }
        )
    return out


def bench_accuracy(cal: Calibration, days: float, seeds: int) -> list[dict[str, Any]]:
    job = JobSpec(num_gpus=2048 * 8, days=days)
    model = FailureModel(
        rate_per_node_day=6.5e-3, causes=(Cause(name="crash", weight=1, kind=FailureKind.EXIT),)
    )
    lam = model.job_rate_per_s(job.num_nodes)
    out = []
    for minutes in (5, 60):
        strat = CheckpointRestart(
            job=job,
            interval_s=minutes * 60.0,
            calibration=cal,
            blocking_s=0,
            write_s=0,
            restart_s=300,
            load_s=0,
            detect_s=0,
            hang_detect_s=0,
            spare_nodes=0,
            node_replace_s=0,
            first_step_extra_s=0,
        )
        sims = [simulate(job, model, strat, seed=s).ettr for s in range(seeds)]
        sim = statistics.mean(sims)
        meta = theory.meta_ettr(num_nodes=2048, rate_per_node_day=6.5e-3, u0_s=300, interval_s=minutes * 60)
        exact = theory.exact_ettr(tau=minutes * 60.0, ckpt_s=0, restart_s=300, rate_per_s=lam)
        out.append(
            {
                "interval_min": minutes,
                "regime_N_rf_u0_plus_dt": lam * (300 + minutes * 60),
                "simulated": sim,
                "simulated_stderr": statistics.stdev(sims) / len(sims) ** 0.5,
                "meta_closed_form": meta,
                "exact_renewal": exact,
                "error_vs_meta_pct": 100 * (sim - meta) / meta,
                "error_vs_exact_pct": 100 * (sim - exact) / exact,
            }
        )
    return out


def failslow_strategies(job: JobSpec, model: FailureModel, cal: Calibration) -> list[Strategy]:
    """The three strategies, and nonstop detecting slow ranks and degraded nodes but moving none."""
    out = strategies(job, model, cal)
    blind = Nonstop(job=job, params=NonstopParams(straggler=NO_PROACTIVE), calibration=cal)
    blind.name = "nonstop no-proactive"
    return [*out, blind]


def bench_projection(
    cal: Calibration, days: float, seeds: int, sizes: list[int], *, fail_slow: bool = False
) -> list[dict[str, Any]]:
    rows = []
    for preset_name in ("llama3", "meta-high"):
        model = preset(preset_name)
        source: EventSource = WithFailSlow(base=model) if fail_slow else model
        for gpus in sizes:
            job = JobSpec(num_gpus=gpus, days=days)
            if fail_slow:
                strats = failslow_strategies(job, model, cal)
            else:
                strats = strategies(job, model, cal, variants=True)
            for s in strats:
                runs: list[SimResult] = [simulate(job, source, s, seed=k) for k in range(seeds)]
                stage_hours = {
                    k: statistics.median(r.lost_by_stage[k] / 3600 / days for r in runs)
                    for k in runs[0].lost_by_stage
                }
                rows.append(
                    {
                        "preset": preset_name,
                        "num_gpus": gpus,
                        "strategy": s.name,
                        "ettr": stats([r.ettr for r in runs]),
                        "lost_gpu_hours_per_day": stats([r.lost_gpu_hours_per_day() for r in runs]),
                        "lost_gpu_hours_per_day_by_stage_median": stage_hours,
                        "goodput_per_provisioned_gpu": stats([r.goodput_per_provisioned_gpu for r in runs]),
                        "failures": stats([float(r.failures) for r in runs]),
                        "resizes_median": {
                            k: statistics.median(r.resizes.get(k, 0) for r in runs)
                            for k in sorted({k for r in runs for k in r.resizes})
                        },
                        "spare_gpus": runs[0].spare_gpus,
                        "slowdowns": stats([float(r.slowdowns) for r in runs]),
                        "proactive_moves_median": {
                            k: statistics.median(r.proactive.get(k, 0) for r in runs)
                            for k in sorted({k for r in runs for k in r.proactive})
                        },
                        "params": runs[0].params,
                    }
                )
    return rows


def fmt(s: dict[str, float], digits: int, *, comma: bool = False) -> str:
    f = f",.{digits}f" if comma else f".{digits}f"
    return f"{s['median']:{f}} [{s['min']:{f}}-{s['max']:{f}}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--days", type=float, default=54.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--fail-slow", action="store_true", help="only the fail-slow projection")
    args = ap.parse_args()
    if args.fail_slow:
        return main_failslow(args)
    args.out = args.out or DEFAULT_OUT
    sizes = [1_024, 16_384, 100_352]
    mem_sizes = [16_384, 131_072, 1_048_576]
    acc_days, acc_seeds = 400.0, 5
    if args.quick:
        args.runs, args.seeds, args.days = 2, 2, 7.0
        sizes, mem_sizes, acc_days, acc_seeds = [1_024, 16_384], [16_384, 131_072], 50.0, 2
    started = time.perf_counter()
    cal = load_calibration()
    doc: dict[str, Any] = {
        "benchmark": "sim",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable.split("/")[-1], *sys.argv],
        "machine": machine_info(),
        "workload": {
            "days": args.days,
            "runs": args.runs,
            "seeds": args.seeds,
            "state_bytes_per_gpu": JobSpec(num_gpus=8).state_bytes_per_gpu,
            "step_s": JobSpec(num_gpus=8).step_s,
            "gpus_per_node": 8,
            "sizes": sizes,
        },
        "calibration": cal.to_json(),
    }
    print("measuring speed ...", file=sys.stderr, flush=True)
    doc["speed"] = bench_speed(cal, args.runs, args.days)
    print("measuring memory ...", file=sys.stderr, flush=True)
    doc["memory"] = bench_memory(cal, args.days, mem_sizes)
    print("measuring accuracy ...", file=sys.stderr, flush=True)
    doc["accuracy"] = bench_accuracy(cal, acc_days, acc_seeds)
    print("measuring projection ...", file=sys.stderr, flush=True)
    doc["projection"] = bench_projection(cal, args.days, args.seeds, sizes)
    doc["wall_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")

    sp = doc["speed"]
    print(
        f"## Speed: {sp['job']['num_gpus']:,} GPUs x {sp['job']['days']:g} days, "
        f"{sp['failures_per_run']} failures"
    )
    for name, s in sp["wall_s"].items():
        print(f"- {name}: {fmt(s, 3)} s per run (goal <= 10 s)")
    print("\n## Memory (nonstop run, Weibull 0.8, tracemalloc peak)\n")
    print("| GPUs | nodes | failures | peak MiB | bytes/node |")
    print("|---|---|---|---|---|")
    for m in doc["memory"]:
        print(
            f"| {m['num_gpus']:,} | {m['num_nodes']:,} | {m['failures']:,} | {m['peak_bytes'] / 2**20:.2f} "
            f"| {m['bytes_per_node']:,.0f} |"
        )
    print("\n## Accuracy (N = 2,048, r_f = 6.5e-3/node-day, u0 = 5 min, w_cp = 0)\n")
    print("| dt | N r_f (u0+dt) | simulated | Meta closed form | exact renewal | vs Meta | vs exact |")
    print("|---|---|---|---|---|---|---|")
    for a in doc["accuracy"]:
        print(
            f"| {a['interval_min']} min | {a['regime_N_rf_u0_plus_dt']:.3f} | {a['simulated']:.4f} "
            f"| {a['meta_closed_form']:.4f} | {a['exact_renewal']:.4f} | {a['error_vs_meta_pct']:+.2f}% "
            f"| {a['error_vs_exact_pct']:+.3f}% |"
        )
    print(f"\n## Projection ({args.days:g} days, median [min-max] of {args.seeds} failure draws)\n")
    print("| failures | GPUs | strategy | ETTR | lost GPU-h/day | goodput / provisioned GPU |")
    print("|---|---|---|---|---|---|")
    for p in doc["projection"]:
        print(
            f"| {p['preset']} | {p['num_gpus']:,} | {p['strategy']} | {fmt(p['ettr'], 4)} "
            f"| {fmt(p['lost_gpu_hours_per_day'], 0, comma=True)} "
            f"| {p['goodput_per_provisioned_gpu']['median']:.4f} |"
        )
    print(f"\nwrote {args.out} ({doc['wall_s']:.0f} s)")
    return 0


def bench_sensitivity(cal: Calibration, days: float, seeds: int) -> list[dict[str, Any]]:
    """What the moves are worth at 16,384 GPUs (llama3) as the assumptions vary."""
    job = JobSpec(num_gpus=16_384, days=days)
    rows = []
    for scale in (0.0, 0.1, 0.3, 1.0, 3.0):
        for warned in (0.0, 0.2, 0.5):
            model = FailSlowModel(
                rate_per_gpu_hour=scale * DEFAULT_FAILSLOW.rate_per_gpu_hour, warned_fraction=warned
            )
            worth = proactive_worth(
                job=job, model=preset("llama3"), failslow=model, calibration=cal, seeds=tuple(range(seeds))
            )
            rows.append({"rate_scale": scale, "warned_fraction": warned, **worth.to_json()})
    return rows


def main_failslow(args: argparse.Namespace) -> int:
    """The projection with fail-slow ranks and degraded signals, and what proactive moves are worth."""
    sizes = [1_024, 16_384] if args.quick else [1_024, 16_384, 100_352]
    if args.quick:
        args.seeds, args.days = 2, 7.0
    started = time.perf_counter()
    cal = load_calibration()
    doc: dict[str, Any] = {
        "benchmark": "sim-failslow",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [sys.executable.split("/")[-1], *sys.argv],
        "machine": machine_info(),
        "workload": {"days": args.days, "seeds": args.seeds, "sizes": sizes},
        "fail_slow": DEFAULT_FAILSLOW.to_json(),
        "calibration": cal.to_json(),
    }
    print("measuring the fail-slow projection ...", file=sys.stderr, flush=True)
    doc["projection"] = bench_projection(cal, args.days, args.seeds, sizes, fail_slow=True)
    print("measuring the sensitivity to the assumptions ...", file=sys.stderr, flush=True)
    doc["sensitivity"] = bench_sensitivity(cal, args.days, args.seeds)
    doc["wall_s"] = time.perf_counter() - started
    out = args.out or FAILSLOW_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"## Fail-slow projection ({args.days:g} days, median [min-max] of {args.seeds} draws)\n")
    print("| failures | GPUs | strategy | ETTR | lost GPU-h/day | of it fail_slow | proactive moves |")
    print("|---|---|---|---|---|---|---|")
    for p in doc["projection"]:
        moves = ", ".join(f"{k} {v:g}" for k, v in p["proactive_moves_median"].items()) or "-"
        print(
            f"| {p['preset']} | {p['num_gpus']:,} | {p['strategy']} | {fmt(p['ettr'], 4)} "
            f"| {fmt(p['lost_gpu_hours_per_day'], 0, comma=True)} "
            f"| {p['lost_gpu_hours_per_day_by_stage_median'].get('fail_slow', 0.0):,.0f} | {moves} |"
        )
    print("\n## What the moves are worth at 16,384 GPUs (llama3) as the assumptions vary (means)\n")
    print("| fail-slow rate (x the default) | warned share | ETTR with | ETTR without | GPU-h/day saved |")
    print("|---|---|---|---|---|")
    for w in doc["sensitivity"]:
        saved = w["lost_gpu_hours_per_day_without"] - w["lost_gpu_hours_per_day_with"]
        print(
            f"| {w['rate_scale']:g} | {w['warned_fraction']:g} | {w['ettr_with']:.4f} "
            f"| {w['ettr_without']:.4f} | {saved:,.0f} |"
        )
    print(f"\nwrote {out} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
