"""How many old ranks' steps a node gathers to reshard a job without replicas, and what planning
it costs the coordinator: ``nonstop/reshardplan.py`` (by the model's layouts) against gathering
every old rank's (what a node did before, and still does before any layout is reported).

The model is the demo GPT's ``--model`` preset (its real DTensor layouts under FSDP2: every
parameter ``Shard(dim=0)`` over ``shard``, as ``nonstop.demo.train_sharded.shard_model`` places
them, computed from the module without building a mesh). For each resize ``W_old -> W_new`` of
``--per-node`` ranks per node: the old ranks each node's ranks need (max and median over nodes),
the whole job's planning time (median of ``--repeat``), and the old ranks' states each rank reads
on a resume from the durable tier (where every rank reads its own; before, all of them). Results go to
``benchmarks/results/reshard_plan.json`` (``--out``)::

    .venv/bin/python benchmarks/bench_reshard_plan.py
    .venv/bin/python benchmarks/bench_reshard_plan.py --quick     # tiny model (smoke, ~2 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import machine_info, run_stamp  # noqa: E402  (a sibling script)

from nonstop.demo.model import GPT, PRESETS  # noqa: E402
from nonstop.mesh import MeshSpec  # noqa: E402
from nonstop.reshardplan import TensorLayout, needed_old_ranks  # noqa: E402

RESIZES = ((8, 6), (64, 56), (256, 248), (1024, 1016), (1016, 1024))


def fsdp_layouts(model_name: str) -> list[TensorLayout]:
    """The distinct layouts FSDP2 gives the demo GPT's parameters on a ``shard`` mesh."""
    model = GPT(PRESETS[model_name])
    seen = {TensorLayout(tuple(p.shape), ("Shard(dim=0)",), ("shard",)): None for p in model.parameters()}
    return list(seen)


def _meshes(old_w: int, new_w: int) -> tuple[MeshSpec, MeshSpec]:
    job = MeshSpec.parse(f"shard={max(old_w, new_w)}")  # the job's declared (full) mesh
    return job.with_world(old_w), job.with_world(new_w)


def plan(layouts: list[TensorLayout], old_w: int, new_w: int, per_node: int) -> list[int]:
    """Per node of the new job: how many old ranks its ranks need."""
    old, new = _meshes(old_w, new_w)
    nodes = range(-(-new_w // per_node))
    return [
        len(needed_old_ranks(layouts, old, new, range(n * per_node, min((n + 1) * per_node, new_w))))
        for n in nodes
    ]


def per_rank(layouts: list[TensorLayout], old_w: int, new_w: int) -> list[int]:
    """Per rank of the new job: how many old ranks' states it reads on a resume from the durable
    tier (``train/restore.py``: ``durable_plan``), where each rank reads its own."""
    old, new = _meshes(old_w, new_w)
    return [len(needed_old_ranks(layouts, old, new, [r])) for r in range(new_w)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/reshard_plan.json")
    ap.add_argument("--quick", action="store_true", help="the tiny model, 1 repeat (smoke)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.repeat = "tiny", 1
    name = "reshard_plan-quick.json" if args.quick else "reshard_plan.json"
    args.out = args.out or REPO / "benchmarks" / "results" / name
    layouts = fsdp_layouts(args.model)
    rows: list[dict[str, Any]] = []
    for old_w, new_w in RESIZES:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            counts = plan(layouts, old_w, new_w, args.per_node)
            times.append(time.perf_counter() - t0)
        reads = per_rank(layouts, old_w, new_w)
        rows.append(
            {
                "old_world": old_w,
                "durable_reads_per_rank_median": statistics.median(reads),
                "durable_reads_per_rank_max": max(reads),
                "new_world": new_w,
                "nodes": len(counts),
                "old_ranks_per_node_max": max(counts),
                "old_ranks_per_node_median": statistics.median(counts),
                "old_ranks_per_node_before": old_w,
                "plan_s_median": statistics.median(times),
            }
        )
        r = rows[-1]
        print(
            f"{old_w:>5} -> {new_w:<5} ranks ({r['nodes']} nodes of {args.per_node}): a node gathers "
            f"{r['old_ranks_per_node_median']:g} (max {r['old_ranks_per_node_max']}) of {old_w} old ranks; "
            f"plan {r['plan_s_median'] * 1e3:.1f} ms for the job; a durable resume reads "
            f"{r['durable_reads_per_rank_median']:g} (max {r['durable_reads_per_rank_max']}) per rank"
        )
    report = {
        "benchmark": "reshard_plan",
        **run_stamp(),
        "machine": machine_info(),
        "settings": {
            "model": args.model,
            "per_node": args.per_node,
            "repeat": args.repeat,
            "quick": args.quick,
        },
        "layouts": len(layouts),
        "resizes": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
