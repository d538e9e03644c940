"""Live migration: the pause it costs, side by side with a kill + recovery and a stop-checkpoint-restart.

What is measured. A data-parallel job of 3 ranks trains the demo transformer (``--model``,
``small`` by default; gloo, CPU), 3 nodes x 1 rank (each node a separate agent process with its
own snapshot memory, one hot spare per node, one peer replica per rank). The figure is the
**pause**: the longest gap between the starts of two consecutive training steps of rank 0 (the
demo script's ``step_intervals_s``; the first two steps, which include lazy initialisation, are
left out) divided by the median gap, two ways: over the whole run, and **during the event** (only
the gaps that overlap the migration, from its start to its end, or the recovery, from the fault to
its end; rank 0's step start times, wall clock, from the demo's result). A ``no_event`` control
runs the same job untouched: its whole-run ratio is what this machine's noise alone gives.
Contenders, alternating run by run:

* ``nonstop_migrate``: when rank 1 starts step ``--event-step``, it is moved live to node 2
  (``migrate:rank=1,step=S,to=2``): node 2's spare restores the rank's committed step while the
  job trains, every rank stops after a boundary step, and the swap happens without a rollback.
  The coordinator's own figure (``migration_done``: the gap across the swap over the median step)
  is reported beside it;
* ``nonstop_kill``: the same rank is SIGKILLed at the same step and recovered (``kill:rank=1,step=S``);
* ``torchrun_restart``: what a planned move costs without nonstop: torchrun + DCP
  (``baseline_torchrun_dcp_train.py``, one ``--standalone`` torchrun with 3 workers) trains to step S
  and saves a DCP checkpoint (``dcp.save``), every process exits, and a new torchrun starts and
  resumes from it; the pause is from the last step before the stop to the first step after it.

And a **drain** of a node holding 2 ranks: 3 nodes x 2 ranks (``tiny`` model, one spare per
node), node 1 gets a preemption notice with ``--grace`` seconds (``preempt:node=1,step=S``):
seconds from the notice until the node is released, ranks moved, committed steps lost.

Summaries are median [min, max] over ``--runs`` runs. Results go to
``benchmarks/results/migration.json``::

    .venv/bin/python benchmarks/bench_migration.py                # small model, 3 runs each
    .venv/bin/python benchmarks/bench_migration.py --quick        # tiny model, 1 run each (smoke)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.agent.gc import collect_garbage  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import default_shm_dir  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402

DCP_SCRIPT = REPO / "benchmarks" / "baseline_torchrun_dcp_train.py"
SKIP = 2  # first step intervals left out: lazy initialisation


def pause_of(intervals: Sequence[float]) -> dict[str, float] | None:
    """Longest step gap, median gap and their ratio over ``intervals`` after the first ``SKIP``."""
    body = list(intervals)[SKIP:]
    if len(body) < 3:
        return None
    med = statistics.median(body)
    return {"max_gap_s": max(body), "median_step_s": med, "ratio": max(body) / med}


def event_window(events: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Wall-clock span of the event: a migration (start to done) or a recovery (fault to done)."""
    start = next((e["ts"] for e in events if e["event"] in ("migration_start", "fault_injected")), None)
    end = next((e["ts"] for e in events if e["event"] in ("migration_done", "recovery")), None)
    return (start, end) if start is not None and end is not None else None


def window_pause(starts: Sequence[float], events: list[dict[str, Any]]) -> dict[str, float] | None:
    """The longest gap between rank 0's consecutive step starts (wall clock, the demo's
    ``step_starts_unix``) that overlaps the event's window, over the median gap of the run (the
    issue's "longest gap during a migration"). None without an event (the control run)."""
    window = event_window(events)
    gaps = list(itertools.pairwise(list(starts)[SKIP:]))
    if window is None or len(gaps) < 3:
        return None
    med = statistics.median(b - a for a, b in gaps)
    during = [b - a for a, b in gaps if b >= window[0] and a <= window[1]]
    if not during:
        return None
    return {"max_gap_s": max(during), "median_step_s": med, "ratio": max(during) / med}


def nonstop_run(args: argparse.Namespace, run_dir: Path, fault: str | None, **cfg: Any) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=cfg.pop("steps", args.steps),
        model=cfg.pop("model", args.model),
        nproc_per_node=cfg.pop("nproc", 1),
        spares=1,
        nnodes=3,
        coordinator="127.0.0.1:0",
        job_dir=run_dir,
        faults=(fault,) if fault else (),
        persist_every=0,
        lease_ttl_s=args.lease_ttl,
        **cfg,
    )
    result = run_local_nodes(config, redirect_output=True)
    collect_garbage(default_shm_dir())
    events = read_events(run_dir / "events.jsonl")
    out = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    done = [e for e in events if e["event"] == "migration_done"]
    return {
        "ok": result.state.value == "done",
        "error": result.error,
        "pause": pause_of(out.get("step_intervals_s", [])),
        "window_pause": window_pause(out.get("step_starts_unix", []), events),
        "coordinator_pause_ratio": done[0]["pause_ratio"] if done else None,
        "migration": done[0] if done else None,
        "failures": result.failures,
        "lost_steps": max((f["lost_steps"] for f in result.failures), default=0),
        "events": [e for e in events if e["event"].startswith(("migration", "preempt", "node_"))],
    }


def _dcp_steps(events: Path) -> list[float]:
    """Times of rank 0's completed steps in one torchrun run's event file."""
    out = []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "step" and e.get("rank") == 0:
            out.append(float(e["ts"]))
    return out


def torchrun_run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """Train to the event step, save, stop; start again and resume (one torchrun each time)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", BENCH_NODE_TAG=f"mig-{os.getpid()}")
    times: list[float] = []
    for part, steps in (("stop", args.event_step), ("resume", args.steps)):
        events = run_dir / f"events-{part}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
        cmd += ["--log-dir", str(run_dir / f"torchelastic-{part}"), str(DCP_SCRIPT), "--model", args.model]
        cmd += ["--steps", str(steps), "--ckpt-every", str(args.event_step), "--sync-save"]
        cmd += ["--step-delay", str(args.step_delay), "--run-dir", str(run_dir), "--events", str(events)]
        with (run_dir / f"torchrun-{part}.log").open("w") as log:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode
        if rc != 0:
            return {"ok": False, "error": f"torchrun ({part}) exited with {rc}"}
        times += _dcp_steps(events)
    intervals = [b - a for a, b in itertools.pairwise(times)]
    return {"ok": True, "error": None, "pause": pause_of(intervals), "lost_steps": 0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="the joiner's prepare takes ~5 s on a 2-core VM")
    ap.add_argument("--event-step", type=int, default=8)
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (demo flag)")
    ap.add_argument("--grace", type=float, default=30.0, help="preemption grace of the drain (seconds)")
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="3 s on a 2-core VM (see bench_node_loss)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one run of each (smoke test)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "migration.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.runs, args.steps, args.event_step, args.step_delay = "tiny", 1, 30, 5, 0.1
    extra = ("--step-delay", str(args.step_delay)) if args.step_delay else ()
    tmp = Path(tempfile.mkdtemp(prefix="nonstop-bench-migration-"))
    runs: dict[str, list[dict[str, Any]]] = {
        "nonstop_migrate": [],
        "nonstop_kill": [],
        "torchrun_restart": [],
        "no_event": [],  # the same job untouched: how large the longest gap is on this machine anyway
    }
    drains: list[dict[str, Any]] = []
    s = args.event_step
    try:
        for i in range(args.runs):
            runs["nonstop_migrate"].append(
                nonstop_run(args, tmp / f"migrate-{i}", f"migrate:rank=1,step={s},to=2", script_extra=extra)
            )
            runs["nonstop_kill"].append(
                nonstop_run(args, tmp / f"kill-{i}", f"kill:rank=1,step={s}", script_extra=extra)
            )
            runs["torchrun_restart"].append(torchrun_run(args, tmp / f"torchrun-{i}"))
            runs["no_event"].append(nonstop_run(args, tmp / f"none-{i}", None, script_extra=extra))
            drains.append(
                nonstop_run(
                    args,
                    tmp / f"drain-{i}",
                    f"preempt:node=1,step={s},grace={args.grace:g}",
                    model="tiny",
                    nproc=2,
                    script_extra=("--step-delay", "0.1"),
                )
            )
            for name, rs in runs.items():
                p = rs[-1].get("pause") or {}
                print(
                    f"run {i} {name}: ok {rs[-1]['ok']} pause {p.get('ratio', float('nan')):.2f}x", flush=True
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def drain_figures(d: dict[str, Any]) -> dict[str, Any]:
        ev = d["events"]
        notice = next((e["ts"] for e in ev if e["event"] == "preempt_notice"), None)
        released = next((e["ts"] for e in ev if e["event"] == "node_released"), None)
        moved = [e["rank"] for e in ev if e["event"] == "migration_done"]
        return {
            "ok": d["ok"],
            "drained_s": (released - notice) if notice is not None and released is not None else None,
            "ranks_moved": moved,
            "lost_steps": d["lost_steps"],
            "failures": len(d["failures"]),
        }

    report: dict[str, Any] = {
        "benchmark": "migration",
        **run_stamp(),
        "machine": machine_info(),
        "params": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "contenders": {
            name: {
                "runs": [{k: v for k, v in r.items() if k != "events"} for r in rs],
                "pause_ratio": summarize([r["pause"]["ratio"] for r in rs if r.get("pause")]),
                "max_gap_s": summarize([r["pause"]["max_gap_s"] for r in rs if r.get("pause")]),
                "median_step_s": summarize([r["pause"]["median_step_s"] for r in rs if r.get("pause")]),
                "window_pause_ratio": summarize(
                    [r["window_pause"]["ratio"] for r in rs if r.get("window_pause")]
                ),
                "coordinator_pause_ratio": summarize(
                    [r["coordinator_pause_ratio"] for r in rs if r.get("coordinator_pause_ratio") is not None]
                ),
                "ok_runs": sum(1 for r in rs if r["ok"]),
            }
            for name, rs in runs.items()
        },
        "drain_2_ranks": [drain_figures(d) for d in drains],
    }
    for name, c in report["contenders"].items():
        print(
            f"{name:18s} longest gap of the run {fmt(c['pause_ratio'])}x, during the event "
            f"{fmt(c['window_pause_ratio'])}x  ok {c['ok_runs']}/{len(c['runs'])}"
        )
    for d in report["drain_2_ranks"]:
        print(
            f"drain: ok {d['ok']} in {d['drained_s']}s, ranks moved {d['ranks_moved']}, "
            f"lost {d['lost_steps']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(c["ok_runs"] == len(c["runs"]) for c in report["contenders"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
