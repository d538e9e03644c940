"""Elastic shrink and grow: throughput before, while shrunk and after growing back, and the proof
that the samples trained on are an uninterrupted run's.

What is measured. A data-parallel job of 3 ranks trains the demo transformer (``--model``, ``small``
by default; gloo, CPU), 3 nodes x 1 rank, **no spare anywhere**, ``--min-world-size 2``. When a
worker on node 2 starts step ``--event-step`` node 2 is SIGKILLed (``node:node=2,step=S``): the job
shrinks at once to 2 ranks (rank 1 plays data shards 1 and 2 by gradient accumulation; the global
batch stays 3 x ``--batch``). As soon as the shrink is logged, node 2 is started again (a node
joining the running job): its process waits as a spare, and the job grows back to 3 ranks at a step
boundary. Per run, from the demo's ``--samples-log`` (rank 0's micro-batch timestamps):

* steps/s and samples/s of each phase (full, shrunk, grown back), the first 2 steps of each phase
  left out; the ratios shrunk/full and grown/full;
* the longest step gap of rank 0 at the shrink and at the grow, over the full phase's median step;
* whether the sample sequence equals an uninterrupted run's (``nonstop.demo.samples.check_sequence``)
  and the final loss relative to an uninterrupted run of the same job (same samples, same global
  batch; float rounding differs with the reduction order, so not bitwise).

With ``--mesh replicate=2,shard=2`` the job is the sharded demo as elastic HSDP, 2 nodes x 2 ranks
(a replica group each): node 1 is lost, its whole replica group is dropped (group 0 plays all 4
data shards, FSDP2 dividing by the full data-parallel size) and comes back when node 1 rejoins.

Summaries are median [min, max] over ``--runs`` runs. Results go to
``benchmarks/results/elastic.json`` (``elastic-hsdp.json`` with ``--mesh``)::

    .venv/bin/python benchmarks/bench_elastic.py              # small model, 3 runs
    .venv/bin/python benchmarks/bench_elastic.py --quick      # tiny model, 1 run (smoke)
    .venv/bin/python benchmarks/bench_elastic.py --mesh replicate=2,shard=2   # elastic HSDP
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
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
from nonstop.config import JobConfig  # noqa: E402
from nonstop.coordinator.loop import JobResult  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.demo.samples import MicroBatch, check_sequence, read_log  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import default_shm_dir  # noqa: E402
from nonstop.launch.local_nodes import LocalNodesJob  # noqa: E402

SKIP = 2  # steps at the start of each phase left out (lazy initialisation, the restore)


def _shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(nodes, ranks per node, the node lost): 3 x 1 data-parallel, or 2 x 2 elastic HSDP."""
    return (2, 2, 1) if args.mesh else (3, 1, 2)


def _config(args: argparse.Namespace, run_dir: Path, faults: tuple[str, ...]) -> JobConfig:
    extra = ["--samples-log", str(run_dir / "samples")]
    if args.step_delay:
        extra += ["--step-delay", str(args.step_delay)]
    return demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model=args.model,
        batch=args.batch,
        script_extra=tuple(extra),
        nproc_per_node=_shape(args)[1],
        spares=0,
        nnodes=_shape(args)[0],
        coordinator="127.0.0.1:0",
        job_dir=run_dir,
        faults=faults,
        persist_every=0,
        lease_ttl_s=args.lease_ttl,
        min_world_size=2,
        mesh=args.mesh,
    )


def _run(config: JobConfig, *, rejoin_after: str | None, node: int = 2) -> JobResult:
    """Run the job; start ``node`` again once ``rejoin_after`` is logged."""
    job = LocalNodesJob(config)
    if rejoin_after is not None:
        job.wait_event(rejoin_after, timeout=300)
        job.start_node(node)
    try:
        return job.result(timeout=1800)
    finally:
        collect_garbage(default_shm_dir())


def _phase(recs: list[MicroBatch], batch: int, shards: int) -> dict[str, float] | None:
    """Throughput of rank 0 over one generation's steps (first SKIP left out)."""
    starts = sorted({r.step: r.t for r in recs}.items())[SKIP:]
    if len(starts) < 3:
        return None
    span = starts[-1][1] - starts[0][1]
    steps_s = (len(starts) - 1) / span
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(starts)]
    return {
        "steps_per_s": steps_s,
        "samples_per_s": steps_s * batch * shards,
        "median_step_s": statistics.median(gaps),
    }


def elastic_run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    lost = _shape(args)[2]
    config = _config(args, run_dir, (f"node:node={lost},step={args.event_step}",))
    result = _run(config, rejoin_after="shrink", node=lost)
    shards = config.world_size  # data-parallel shards (HSDP 2x2: 4)
    events = read_events(run_dir / "events.jsonl")
    out = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    gens = [e for e in events if e["event"] == "generation"]
    shrunk = next((g["generation"] for g in gens if g.get("cause")), None)
    grown = next((g["generation"] for g in gens if g.get("grow")), None)
    recs = read_log(run_dir / "samples")
    rank0 = [r for r in recs if r.shard == 0]  # node 0's process plays shard 0 throughout
    phases = {
        name: _phase([r for r in rank0 if r.gen == gen], args.batch, shards)
        for name, gen in (("full", 1), ("shrunk", shrunk), ("grown", grown))
        if gen is not None
    }
    full = phases.get("full")
    # the longest step gap of rank 0 where the world size changed, over the full phase's median step
    starts = sorted({(r.step, r.gen): r.t for r in rank0}.items(), key=lambda kv: kv[1])
    gaps = {}
    for name, gen in (("shrink", shrunk), ("grow", grown)):
        first = next((i for i, ((_, g), _) in enumerate(starts) if g == gen), None)
        if first is not None and first > 0 and full is not None:
            gaps[name] = (starts[first][1] - starts[first - 1][1]) / full["median_step_s"]
    grow_done = next((e for e in events if e["event"] == "grow_done"), None)
    return {
        "ok": result.state.value == "done" and all(phases.get(k) for k in ("full", "shrunk", "grown")),
        "error": result.error,
        "phases": phases,
        "shrunk_over_full": (phases["shrunk"]["samples_per_s"] / full["samples_per_s"])
        if full and phases.get("shrunk")
        else None,
        "grown_over_full": (phases["grown"]["samples_per_s"] / full["samples_per_s"])
        if full and phases.get("grown")
        else None,
        "gap_over_median": gaps,
        "grow_s": grow_done["seconds"] if grow_done else None,
        "sequence_problems": check_sequence(recs, steps=args.steps, num_shards=shards, batch=args.batch),
        "final_loss": out.get("final_loss"),
        "failures": result.failures,
    }


def reference_run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = _config(args, run_dir, ())
    result = _run(config, rejoin_after=None)
    out = json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}
    recs = read_log(run_dir / "samples")
    return {
        "ok": result.state.value == "done",
        "final_loss": out.get("final_loss"),
        "full": _phase([r for r in recs if r.shard == 0], args.batch, config.world_size),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="the rejoining node needs ~10 s to be a spare")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--event-step", type=int, default=10)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="3 s on a 2-core VM (see bench_node_loss)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one run (smoke test)")
    ap.add_argument("--mesh", default=None, help="replicate=2,shard=2: elastic HSDP on 2 nodes x 2")
    ap.add_argument("--out", type=Path, default=None, help="default results/elastic[-hsdp].json")
    args = ap.parse_args(argv)
    if args.mesh is not None and args.mesh != "replicate=2,shard=2":
        ap.error("--mesh: this benchmark runs replicate=2,shard=2 (2 nodes x 2 ranks)")
    if args.out is None:
        args.out = REPO / "benchmarks" / "results" / ("elastic-hsdp.json" if args.mesh else "elastic.json")
    if args.quick:
        args.model, args.runs, args.steps, args.event_step, args.step_delay = "tiny", 1, 80, 5, 0.1
    tmp = Path(tempfile.mkdtemp(prefix="nonstop-bench-elastic-"))
    runs: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    try:
        for i in range(args.runs):
            runs.append(elastic_run(args, tmp / f"elastic-{i}"))
            refs.append(reference_run(args, tmp / f"reference-{i}"))
            r = runs[-1]
            print(
                f"run {i}: ok {r['ok']} shrunk/full {r['shrunk_over_full']} "
                f"grown/full {r['grown_over_full']} sequence problems {len(r['sequence_problems'])}",
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = [r for r in runs if r["ok"]]
    ref_loss = statistics.median([x["final_loss"] for x in refs if x["ok"] and x["final_loss"] is not None])
    report = {
        **run_stamp(),
        "machine": machine_info(),
        "workload": {
            "model": args.model,
            "ranks": 4 if args.mesh else 3,
            "mesh": args.mesh,
            "batch_per_shard": args.batch,
            "steps": args.steps,
            "event_step": args.event_step,
            "step_delay_s": args.step_delay,
            "runs": args.runs,
        },
        "summary": {
            "ok_runs": len(ok),
            "full_samples_per_s": summarize([r["phases"]["full"]["samples_per_s"] for r in ok]),
            "shrunk_samples_per_s": summarize([r["phases"]["shrunk"]["samples_per_s"] for r in ok]),
            "grown_samples_per_s": summarize([r["phases"]["grown"]["samples_per_s"] for r in ok]),
            "shrunk_over_full": summarize([r["shrunk_over_full"] for r in ok]),
            "grown_over_full": summarize([r["grown_over_full"] for r in ok]),
            "shrink_gap_over_median": summarize([r["gap_over_median"]["shrink"] for r in ok]),
            "grow_gap_over_median": summarize([r["gap_over_median"]["grow"] for r in ok]),
            "grow_s": summarize([r["grow_s"] for r in ok if r["grow_s"] is not None]),
            "sequence_equal_runs": sum(1 for r in ok if not r["sequence_problems"]),
            "final_loss_rel_diff": summarize([abs(r["final_loss"] - ref_loss) / ref_loss for r in ok]),
            "reference_samples_per_s": summarize([x["full"]["samples_per_s"] for x in refs if x["full"]]),
        },
        "runs": runs,
        "references": refs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    s = report["summary"]
    what = f"HSDP {args.mesh}, 2 nodes x 2" if args.mesh else "3 ranks"
    print(f"\nElastic shrink and grow, {what}, model {args.model}, node lost at step {args.event_step}")
    ref = fmt(s["reference_samples_per_s"])
    print(f"  samples/s full     {fmt(s['full_samples_per_s'])} (uninterrupted run: {ref})")
    print(f"  samples/s shrunk   {fmt(s['shrunk_samples_per_s'])}  ratio {fmt(s['shrunk_over_full'])}")
    print(f"  samples/s grown    {fmt(s['grown_samples_per_s'])}  ratio {fmt(s['grown_over_full'])}")
    shrink, grow = fmt(s["shrink_gap_over_median"]), fmt(s["grow_gap_over_median"])
    print(f"  step gap / median  shrink {shrink}  grow {grow}")
    print(f"  sample sequence equal to an uninterrupted run in {s['sequence_equal_runs']} of {len(ok)} runs")
    print(f"  final loss vs uninterrupted: relative difference {fmt(s['final_loss_rel_diff'], digits=6)}")
    print(f"  -> {args.out}")
    return 0 if len(ok) == args.runs and s["sequence_equal_runs"] == len(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
