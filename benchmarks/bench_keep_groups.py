"""What keeping the untouched mesh groups saves on gloo, side by side with building them all again.

What is measured. A sharded job, HSDP ``--mesh replicate=2,shard=2`` on 2 nodes x 2 ranks (each
node a separate agent process, one hot spare per node; gloo, CPU), trains the demo transformer
(``--model``) and, at step ``--event-step``:

* ``--event migrate`` (default): moves rank 3 live to node 0's spare. Every rank leaves the old
  generation at a step boundary, so with the default (``keep``) only the mover's groups are
  built again -- its shard group {2, 3} and its replica group {1, 3} -- and {0, 1} and {0, 2}
  are kept;
* ``--event kill``: kills rank 3 mid-step; node 1's spare takes it. The survivors sever the
  groups rank 3 was in and settle the others (``nonstop/train/settle.py``): what is kept
  depends on where each survivor was in the step (typically {0, 1}).

``rebuild_all`` (``--rebuild-all-groups``) builds all four. The two alternate run by run.

Figures, from the migration's generation (the coordinator's ``groups_joined`` events, one per
rank, and its ``migration_done``):

* ``mesh_s``: the seconds the slowest rank spent building its mesh (the groups kept or built,
  the agreement through the store; the default group excluded);
* ``rebuild_s``: the seconds the slowest rank spent joining the generation (default group, mesh,
  the model built on it and the restored state copied in);
* ``pause_ratio``: the migration's pause, the gap across the swap over the median step; for a
  kill, the recovery's ``survivor_gap_steps`` (the longest gap between two steps of a survivor
  around the failure, over the median step).

Summaries are median [min, max] over ``--runs`` runs; results go to
``benchmarks/results/keep_groups.json`` (``keep_groups_kill.json`` for a kill)::

    .venv/bin/python benchmarks/bench_keep_groups.py                 # 5 runs each
    .venv/bin/python benchmarks/bench_keep_groups.py --event kill    # 5 runs each
    .venv/bin/python benchmarks/bench_keep_groups.py --quick         # 1 run each (smoke)
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
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.agent.gc import collect_garbage  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import default_shm_dir  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402

CONTENDERS = {"keep": True, "rebuild_all": False}


def one_run(args: argparse.Namespace, run_dir: Path, keep: bool) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model=args.model,
        batch=4,
        nproc_per_node=2,
        spares=1,
        nnodes=2,
        coordinator="127.0.0.1:0",
        lease_ttl_s=args.lease_ttl,
        job_dir=run_dir,
        mesh="replicate=2,shard=2",
        faults=(f"{args.event}:rank=3,step={args.event_step}",),
        persist_every=0,
        keep_groups=keep,
    )
    result = run_local_nodes(config, redirect_output=True)
    collect_garbage(default_shm_dir())
    events = read_events(run_dir / "events.jsonl")
    joined = [e for e in events if e["event"] == "groups_joined"]
    if args.event == "migrate":
        pauses = [e["pause_ratio"] for e in events if e["event"] == "migration_done"]
    else:
        pauses = [e["survivor_gap_steps"] for e in events if e["event"] == "recovery"]
    if result.state.value != "done" or not joined or len(pauses) != 1 or pauses[0] is None:
        return {"ok": False, "error": result.error or f"{len(pauses)} {args.event} record(s): {pauses}"}
    gen = max(e["gen"] for e in joined)
    last = [e for e in joined if e["gen"] == gen]
    return {
        "ok": True,
        "kept": sum(e["kept"] for e in last),
        "built": sum(e["built"] for e in last),
        "mesh_s": max(e["mesh_s"] for e in last),
        "rebuild_s": max(e["rebuild_s"] for e in last),
        "pause_ratio": pauses[0],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--event-step", type=int, default=8)
    ap.add_argument("--event", choices=("migrate", "kill"), default="migrate")
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="3 s on a 2-core VM (see bench_node_loss)")
    ap.add_argument("--quick", action="store_true", help="one run of each (smoke test)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/keep_groups[_kill].json")
    args = ap.parse_args(argv)
    if args.out is None:
        name = "keep_groups.json" if args.event == "migrate" else "keep_groups_kill.json"
        args.out = REPO / "benchmarks" / "results" / name
    if args.quick:
        args.runs, args.steps, args.event_step = 1, 16, 5
    tmp = Path(tempfile.mkdtemp(prefix="nonstop-bench-keep-groups-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    try:
        for i in range(args.runs):
            for name, keep in CONTENDERS.items():
                r = one_run(args, tmp / f"{name}-{i}", keep)
                runs[name].append(r)
                print(f"run {i} {name}: {r}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if r["ok"]]
        summary[name] = {
            "ok": f"{len(ok)}/{len(rs)}",
            **{
                k: summarize([r[k] for r in ok])
                for k in ("kept", "built", "mesh_s", "rebuild_s", "pause_ratio")
            },
        }
    pairs = [(k, a) for k, a in zip(runs["keep"], runs["rebuild_all"], strict=True) if k["ok"] and a["ok"]]
    summary["saved"] = {
        "mesh_s": summarize([a["mesh_s"] - k["mesh_s"] for k, a in pairs]),
        "rebuild_s": summarize([a["rebuild_s"] - k["rebuild_s"] for k, a in pairs]),
    }
    report = {
        "benchmark": "keep_groups",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(),
        **run_stamp(),
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    pause = "migration pause" if args.event == "migrate" else "survivor gap"
    print(f"| contender | groups kept / built | mesh (s) | join (s) | {pause} (x step) |")
    print("|---|---|---|---|---|")
    for name in CONTENDERS:
        s = summary[name]
        kept = s["kept"]["median"] if s["kept"] else "-"
        built = s["built"]["median"] if s["built"] else "-"
        print(
            f"| {name} | {kept} / {built} | {fmt(s['mesh_s'], digits=3)} | {fmt(s['rebuild_s'], digits=3)} "
            f"| {fmt(s['pause_ratio'])} |"
        )
    print(
        f"saved per {args.event}: mesh {fmt(summary['saved']['mesh_s'], digits=3)} s, join "
        f"{fmt(summary['saved']['rebuild_s'], digits=3)} s -> {args.out}"
    )
    return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
