"""Survivors never wait (issue 18): shrink first against replace first, side by side.

What is measured. A data-parallel job of the demo transformer (``--model``, ``small`` by default;
gloo, CPU), 2 nodes x 2 ranks, one hot spare per node, ``--min-world-size 2``. When rank 1 starts
step ``--event-step`` it is SIGKILLed (``--fault``, any demo fault spec). The same job runs with
``--survivors wait`` (the spare takes the rank, every rank restores, one rebuild: what nonstop always
did) and ``--survivors continue`` (the survivors go on at once as 3 ranks, the spare prepares in the
background and joins at a step boundary), alternating run by run, then once without a fault (the
reference). Per run, from the job's event log:

* ``survivor_gap_steps``: the longest gap between two completed steps of any surviving rank around
  the failure, over the median step (the coordinator's recovery record), and in seconds;
* ``training_again_s``: fault -> every rank of the next generation in its new group;
* ``full_s``: fault -> every rank of the full-size job training (``continue``: the grow's end;
  ``wait``: the recovery's first step everywhere); ``grow_pause_steps``: the grow's gap across its
  boundary over the median step;
* ``lost_steps`` and whether the final weights are bitwise equal to the reference's.

``--restore-delay X`` stands in for a state that takes X seconds to restore (a large model on a
slow link): rank 3 is killed instead, and whichever process restores it -- the spare taking the
rank (``wait``) or the spare preparing to join (``continue``) -- sleeps X seconds in its restore
(``slow:...,at=recovery`` / ``at=prepare``). Results then go to ``survivors-delay.json``.

Summaries are median [min, max] over ``--runs`` runs (after ``--warmup`` rounds). Results go to
``benchmarks/results/survivors.json``::

    .venv/bin/python benchmarks/bench_survivors.py            # small model, 3 runs
    .venv/bin/python benchmarks/bench_survivors.py --quick    # tiny model, 1 run (smoke)
    .venv/bin/python benchmarks/bench_survivors.py --restore-delay 3   # a slow restore
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

MODES = ("wait", "continue")


def _run(args: argparse.Namespace, run_dir: Path, mode: str | None) -> dict[str, Any]:
    faults: tuple[str, ...] = ()
    if mode is not None and args.restore_delay > 0:
        faults = (
            f"kill:rank=3,step={args.event_step}",
            f"slow:rank=3,step=0,seconds={args.restore_delay:g},at=recovery",
            f"slow:rank=3,step=0,seconds={args.restore_delay:g},at=prepare",
        )
    elif mode is not None:
        faults = (args.fault.format(step=args.event_step),)
    config, result, final_hash = two_node_job(
        run_dir, steps=args.steps, model=args.model, faults=faults, min_world_size=2, survivors=mode or "wait"
    )
    out: dict[str, Any] = {"mode": mode, "ok": final_hash is not None}
    if final_hash is None:
        out["error"] = result.error
        return out
    out["final_hash"] = final_hash
    out["median_step_s"] = result.median_step_s
    if mode is None:
        return out
    events = read_events(run_dir / "events.jsonl")
    fault_ts = min(e["ts"] for e in events if e["event"] == "fault_injected")
    recoveries = [e for e in events if e["event"] == "recovery"]
    rec = recoveries[0]
    out.update(
        survivor_gap_s=rec.get("survivor_gap_s"),
        survivor_gap_steps=rec.get("survivor_gap_steps"),
        training_again_s=rec["training_again_s"],
        lost_steps=sum(r["lost_steps"] or 0 for r in recoveries),
        shrinks=sum(e["event"] == "shrink" for e in events),
    )
    grows = [e for e in events if e["event"] == "grow_done" and e["world_size"] == config.world_size]
    if mode == "continue" and grows:
        out["full_s"] = grows[0]["ts"] - fault_ts
        out["grow_pause_steps"] = grows[0].get("pause_ratio")
    elif mode == "wait":
        out["full_s"] = rec["mttr_s"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--event-step", type=int, default=12)
    p.add_argument("--fault", default="kill:rank=1,step={step}", help="a demo fault spec; {step} is filled")
    p.add_argument("--restore-delay", type=float, default=0.0, help="seconds a restore of the rank takes")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, 24 steps, 1 run, no warm-up")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "survivors.json")
    args = p.parse_args(argv)
    if args.restore_delay > 0 and args.out == p.get_default("out"):
        args.out = args.out.with_name("survivors-delay.json")
    if args.quick:
        args.model, args.steps, args.event_step, args.runs, args.warmup = "tiny", 24, 8, 1, 0
    info = machine_info()
    ref, runs = against_reference(
        functools.partial(_run, args), MODES, warmup=args.warmup, runs=args.runs, name="survivors"
    )
    counted = [r for r in runs if not r["warmup"] and r["ok"]]
    keys = (
        "survivor_gap_steps",
        "survivor_gap_s",
        "training_again_s",
        "full_s",
        "grow_pause_steps",
        "lost_steps",
    )
    summary = summary_by(runs, "mode", MODES, keys)
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
    print(f"{'':10} {'survivors gap (steps)':>24} {'training again (s)':>22} {'full size (s)':>22} equal")
    for mode in MODES:
        s = summary[mode]
        print(
            f"{mode:10} {fmt(s['survivor_gap_steps']):>24} {fmt(s['training_again_s']):>22} "
            f"{fmt(s['full_s']):>22} {s['equal']}/{s['runs']}"
        )
    return 0 if all(r["ok"] and r["equal"] for r in counted) else 1


if __name__ == "__main__":
    raise SystemExit(main())
