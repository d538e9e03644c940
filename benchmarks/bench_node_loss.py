"""Node loss: detection, MTTR per stage and replication traffic of nonstop across nodes.

What is measured. A data-parallel job of 4 ranks trains the demo transformer
(``--model``, gloo, CPU) across ``N`` nodes (``--layouts``, default ``2x2,4x1``: nodes x ranks
per node), each node a separate agent process on this machine with its own snapshot memory,
as many hot spares per node as it has ranks (so the survivors can take a whole node's ranks)
and ``--replicas 1``. When a worker of the last node starts step
``--fault-step``, the node is lost: its agent and every process of the node are SIGKILLed
(nonstop's ``node:node=I,step=S`` fault), taking the node's memory (and the replicas it held)
with them. Each run reports, from the fault's timestamp:

* ``detect_s``: until the coordinator declares the failure (the agent's channel closes; the
  lease, ``--lease-ttl``, is the backstop for a silent node and plays no part here);
* the stages PLAN, LAUNCH (spares take the ranks and fetch the replicated step from a peer's
  memory), RESTORE, REBUILD, RESUME, ``training_again_s`` (end of REBUILD: every rank in the
  new group with its state restored) and ``mttr_s`` (end of RESUME: every rank has completed
  one step after the recovery; it includes that step's compute);
* ``lost_steps``: committed (replicated) steps redone: the goal is 0;
* replication: bytes on the wire / raw snapshot bytes over the whole run (lossless codec,
  delta against the holder's previous copy), rounds, and how far the replicated step lagged.

Summaries are medians (min-max) over ``--runs`` runs per layout. Results go to
``benchmarks/results/node_loss.json``::

    .venv/bin/python benchmarks/bench_node_loss.py                # small model, 3 runs per layout
    .venv/bin/python benchmarks/bench_node_loss.py --quick        # tiny model, one 2x2 run
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchcommon import machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.agent.gc import collect_garbage  # noqa: E402
from nonstop.config import JobConfig  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import default_shm_dir  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402


def summarize_present(values: Sequence[float | None]) -> dict[str, float] | None:
    """benchcommon's summary (median, min, max, n) of the values that were measured."""
    return summarize([v for v in values if v is not None])


def one_run(args: argparse.Namespace, nnodes: int, nproc: int, run_dir: Path) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg: JobConfig = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model=args.model,
        nproc_per_node=nproc,
        spares=nproc,  # enough hot spares on each node to take over a whole lost node
        nnodes=nnodes,
        coordinator="127.0.0.1:0",
        job_dir=run_dir,
        faults=(f"node:node={nnodes - 1},step={args.fault_step}",),
        persist_every=0,
        lease_ttl_s=args.lease_ttl,
        script_extra=(
            *(("--step-delay", str(args.step_delay)) if args.step_delay else ()),
            *getattr(args, "script_extra", ()),  # bench_node_loss_peers' nonstop_cold: --no-prewarm
        ),
        mesh=getattr(args, "mesh", None),  # bench_node_loss_peers --mesh; None: DDP
    )
    result = run_local_nodes(cfg, redirect_output=True)
    collect_garbage(default_shm_dir())  # the SIGKILLed node could not free its memory
    events = read_events(run_dir / "events.jsonl")
    rep = result.replication
    lag = [
        e["step"] - e2["step"]
        for e in events
        if e["event"] == "fault_injected"
        for e2 in [x for x in events if x["event"] == "replicated" and x["ts"] <= e["ts"]][-1:]
    ]
    out: dict[str, Any] = {
        "ok": result.state.value == "done",
        "error": result.error,
        "median_step_s": result.median_step_s,
        "replication": rep,
        "replicated_lag_at_fault_steps": lag[0] if lag else None,
    }
    if result.failures:
        f = result.failures[0]
        out.update(
            {
                "detect_s": f["detect_s"],
                "stages": f["stages"],
                "training_again_s": f["training_again_s"],
                "mttr_s": f["mttr_s"],
                "lost_steps": max(x["lost_steps"] for x in result.failures),
                "ranks_lost": len(result.failures),
                "fetches": next(
                    (e["fetches"] for e in events if e["event"] == "generation" and e.get("cause")), {}
                ),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--layouts", default="2x2,4x1", help="comma-separated NODESxRANKS (4 ranks each)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--fault-step", type=int, default=14)
    ap.add_argument(
        "--lease-ttl",
        type=float,
        default=3.0,
        help="node lease TTL (default 3 s here: with 4 node processes and 8 workers on 2 cores, a process "
        "can be starved for over 1 s and a 1 s lease then fences healthy nodes)",
    )
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (demo flag)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one 2x2 run (smoke test)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "node_loss.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.layouts, args.runs, args.steps, args.fault_step = "tiny", "2x2", 1, 14, 8
        args.step_delay = 0.05
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="nonstop-bench-node-"))
    report: dict[str, Any] = {
        "benchmark": "node_loss",
        **run_stamp(),
        "machine": machine_info(),
        "params": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
        "layouts": {},
    }
    try:
        for nnodes, nproc in layouts:
            runs = [one_run(args, nnodes, nproc, tmp / f"{nnodes}x{nproc}-{i}") for i in range(args.runs)]
            ok = [r for r in runs if r["ok"] and "mttr_s" in r]
            summary: dict[str, Any] = {
                "runs": runs,
                "ok_runs": len(ok),
                "detect_s": summarize_present([r["detect_s"] for r in ok]),
                "training_again_s": summarize_present([r["training_again_s"] for r in ok]),
                "mttr_s": summarize_present([r["mttr_s"] for r in ok]),
                "lost_steps_max": max((r["lost_steps"] for r in ok), default=None),
                "median_step_s": summarize_present([r["median_step_s"] for r in ok]),
                "wire_over_raw": summarize_present([r["replication"]["wire_over_raw"] for r in ok]),
                "stages": {
                    s: summarize_present([r["stages"][s] for r in ok])
                    for s in (ok[0]["stages"] if ok else {})
                },
            }
            report["layouts"][f"{nnodes}x{nproc}"] = summary
            m = summary["mttr_s"]
            print(
                f"{nnodes} nodes x {nproc}: ok {len(ok)}/{len(runs)}  detect "
                f"{(summary['detect_s'] or {}).get('median', float('nan')):.3f}s  training again "
                f"{(summary['training_again_s'] or {}).get('median', float('nan')):.3f}s  MTTR "
                f"{(m or {}).get('median', float('nan')):.3f}s  lost steps {summary['lost_steps_max']}  "
                f"wire/raw {(summary['wire_over_raw'] or {}).get('median', float('nan')):.3f}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(v["ok_runs"] == len(v["runs"]) for v in report["layouts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
