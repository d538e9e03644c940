"""Rescue snapshots (issue 18): a failure between two snapshots, with and without the rescue.

What is measured. A data-parallel job of the demo transformer (``--model``, ``small`` by default;
gloo, CPU), 2 nodes x 2 ranks, one hot spare per node. When rank 1 starts step ``--event-step``
(14 by default: 6 steps past the snapshot of step 8 with ``--every`` K = 8) it is SIGKILLed and a
spare takes it. Three contenders, alternating run by run, then once without a
fault (the reference):

* ``every-step``: ``--snapshot-every 1`` (nonstop's default): every step snapshotted;
* ``rescue``: ``--snapshot-every K`` -- the survivors write the state after their last completed
  step when the failure interrupts the next, the spare takes a survivor's (policy/rescue.py);
* ``rollback``: ``--snapshot-every K --rescue-wait 0``: every rank goes back to the last snapshot.

Per run, from the job's event log and result: ``redone_steps`` (steps trained again after the
recovery), ``restore_step``, ``survivor_gap_steps`` (the longest gap between two completed steps
of a surviving rank around the failure, over the median step), ``plan_s`` (the plan stage: with
rescues, the wait for the survivors' reports), ``training_again_s``, ``step_s`` (the job's median
step: what snapshotting every step costs beside every K) and whether the final weights are bitwise
equal to the reference's. Summaries are median [min, max] over ``--runs`` runs (after ``--warmup``
rounds); results go to ``benchmarks/results/rescue.json``::

    .venv/bin/python benchmarks/bench_rescue.py            # small model, 3 runs
    .venv/bin/python benchmarks/bench_rescue.py --quick    # tiny model, 1 run (smoke)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import against_reference, fmt, machine_info, run_stamp, summary_by, two_node_job  # noqa: E402  (a sibling)

from nonstop.events.log import read_events  # noqa: E402

CONTENDERS = ("every-step", "rescue", "rollback")
KEYS = ("redone_steps", "restore_step", "survivor_gap_steps", "plan_s", "training_again_s", "step_s")


def _settings(args: argparse.Namespace, contender: str | None) -> dict[str, Any]:
    if contender == "every-step":
        return {"snapshot_every": 1}
    # (a bound on the wait, not its cost: the survivors report in milliseconds on a quiet machine)
    return {"snapshot_every": args.every, "rescue_wait_s": 0.0 if contender == "rollback" else 10.0}


def _run(args: argparse.Namespace, run_dir: Path, contender: str | None) -> dict[str, Any]:
    faults = (f"kill:rank=1,step={args.event_step}",) if contender is not None else ()
    settings = _settings(args, contender or "every-step")
    _, result, final_hash = two_node_job(
        run_dir, steps=args.steps, model=args.model, faults=faults, **settings
    )
    out: dict[str, Any] = {"contender": contender, "ok": final_hash is not None}
    if final_hash is None:
        out["error"] = result.error
        return out
    out["final_hash"] = final_hash
    out["step_s"] = result.median_step_s
    if contender is None:
        return out
    recs = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "recovery"]
    rec = recs[0]
    out.update(
        redone_steps=rec["redone_steps"],
        restore_step=rec["restore_step"],
        survivor_gap_steps=rec.get("survivor_gap_steps"),
        plan_s=rec["stages"]["plan"],
        training_again_s=rec["training_again_s"],
        lost_steps=sum(r["lost_steps"] or 0 for r in recs),
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=8, help="K of the rescue and rollback contenders")
    p.add_argument("--event-step", type=int, default=14)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, 20 steps, 1 run, no warm-up")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "rescue.json")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.event_step, args.runs, args.warmup = "tiny", 20, 12, 1, 0
    info = machine_info()
    ref, runs = against_reference(
        functools.partial(_run, args), CONTENDERS, warmup=args.warmup, runs=args.runs, name="rescue"
    )
    counted = [r for r in runs if not r["warmup"] and r["ok"]]
    summary = summary_by(runs, "contender", CONTENDERS, KEYS)
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "machine": info,
        "stamp": run_stamp(),
        "reference": {k: v for k, v in ref.items() if k != "final_hash"},
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    head = ("redone steps", 16), ("survivor gap (steps)", 22), ("plan (s)", 18), ("step (s)", 18)
    print(f"{'':12} " + " ".join(f"{h:>{w}}" for h, w in head) + " equal")
    for c in CONTENDERS:
        s = summary[c]
        print(
            f"{c:12} {fmt(s['redone_steps'], digits=0):>16} {fmt(s['survivor_gap_steps']):>22} "
            f"{fmt(s['plan_s'], digits=3):>18} {fmt(s['step_s'], digits=3):>18} {s['equal']}/{s['runs']}"
        )
    return 0 if all(r["ok"] and r["equal"] for r in counted) else 1


if __name__ == "__main__":
    raise SystemExit(main())
