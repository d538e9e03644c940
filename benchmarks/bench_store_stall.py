"""What control-store stall a job rides through on the defaults (issue 17, item 4).

What is measured. A 3-node job of the tiny demo model (one rank and one hot spare per node, each
node its own agent process, the job's state in a real etcd started by ``scripts/etcd.sh``, the
default ``--lease-ttl`` of 1 s) trains ``--steps`` steps. Once step 2 is replicated, etcd is frozen
with SIGSTOP for D seconds, then resumed (SIGCONT); the job then runs to its end. For each stall
D (``--stalls``), and once without a stall (the reference), from the job's result and event log:

* ``ok``: the job finished; ``equal``: its final weights are bitwise equal to the reference's;
* ``fenced``: node agents that fenced themselves; ``nodes_lost``, ``failures``: what the
  coordinator counted; ``coordinator_restarts``: times the coordinator lost its leadership and
  was started again (``coordinator_resumed`` events);
* ``lapsed``: node leases that ended in the stall while the coordinator heard the node (kept,
  and registered again: ``node_lease_lapsed`` / ``node_lease_renewed``);
* ``steps_during_stall``: replication rounds (one per step replicated) while etcd was frozen --
  training goes on through a stall it rides;
* ``extra_s``: the job's wall time over the reference's.

Results go to ``benchmarks/results/store_stall.json``::

    .venv/bin/python benchmarks/bench_store_stall.py               # stalls 1 3 5 7 9 12 s
    .venv/bin/python benchmarks/bench_store_stall.py --quick       # one 1 s stall (smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import machine_info, run_stamp  # noqa: E402  (a sibling script)

from nonstop.chaos.cluster import Etcd, free_port  # noqa: E402
from nonstop.coordinator.loop import JobResult, JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402

START_STEP = 2  # the stall begins once this step is replicated


def _events(job_dir: Path) -> list[dict[str, Any]]:
    try:
        return read_events(job_dir / "events.jsonl")
    except (OSError, ValueError):
        return []


def _run(args: argparse.Namespace, etcd: Etcd, run_dir: Path, stall_s: float) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json", model="tiny", batch=4, job_dir=run_dir, steps=args.steps,
        script_extra=("--step-delay", str(args.step_delay)), nnodes=3, nproc_per_node=1, spares=1,
        coordinator=f"127.0.0.1:{free_port()}", store=etcd.url, secret_file=etcd.secret_file,
    )  # fmt: skip
    box: dict[str, JobResult] = {}
    t0 = time.monotonic()
    job = threading.Thread(target=lambda: box.update(r=run_local_nodes(config, redirect_output=True)))
    job.start()
    frozen_at = resumed_at = None
    if stall_s > 0:
        deadline = time.monotonic() + 300
        while job.is_alive() and time.monotonic() < deadline:
            if any(e["event"] == "replicated" and e["step"] >= START_STEP for e in _events(run_dir)):
                break
            time.sleep(0.05)
        if job.is_alive():
            os.kill(etcd.pid, signal.SIGSTOP)
            frozen_at = time.time()
            try:
                time.sleep(stall_s)
            finally:
                os.kill(etcd.pid, signal.SIGCONT)
                resumed_at = time.time()
    job.join(timeout=900)
    wall = time.monotonic() - t0
    result = box.get("r")
    events = _events(run_dir)
    kinds = [e["event"] for e in events]
    out: dict[str, Any] = {
        "stall_s": stall_s,
        "ok": result is not None and result.state is JobState.DONE,
        "error": None if result is None else result.error,
        "wall_s": wall,
        "fenced": len(list(run_dir.glob("fenced-node-*.json"))),
        "nodes_lost": kinds.count("node_lost"),
        "failures": kinds.count("failure"),
        "coordinator_restarts": kinds.count("coordinator_resumed"),
        "lapsed": kinds.count("node_lease_lapsed"),
        "renewed": kinds.count("node_lease_renewed"),
    }
    if frozen_at is not None and resumed_at is not None:
        out["frozen"] = [frozen_at, resumed_at]
        out["steps_during_stall"] = sum(
            e["event"] == "replicated" and frozen_at <= e["ts"] <= resumed_at for e in events
        )
    if out["ok"]:
        out["final_hash"] = json.loads((run_dir / "result.json").read_text())["final_hash"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stalls", type=float, nargs="+", default=[1, 3, 5, 7, 9, 12], metavar="S")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--step-delay", type=float, default=0.3, help="seconds each demo step sleeps")
    p.add_argument("--quick", action="store_true", help="one 1 s stall, 10 steps (smoke)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "store_stall.json")
    p.add_argument("--keep", action="store_true", help="keep the jobs' directories (printed)")
    args = p.parse_args(argv)
    if args.quick:
        args.stalls, args.steps = [1.0], 10
    why = Etcd.unavailable()
    if why is not None:
        print(f"bench_store_stall: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="nonstop-bench-store-stall-"))
    etcd = Etcd(state=work / "etcd")
    etcd.start()
    runs: list[dict[str, Any]] = []
    try:
        ref = _run(args, etcd, work / "reference", 0.0)
        if not ref["ok"]:
            print(f"bench_store_stall: the reference job failed: {ref['error']}", file=sys.stderr)
            return 1
        for i, stall in enumerate(args.stalls):
            r = _run(args, etcd, work / f"stall-{i}", stall)
            r["equal"] = r.get("final_hash") == ref["final_hash"]
            r["extra_s"] = r["wall_s"] - ref["wall_s"]
            runs.append({k: v for k, v in r.items() if k != "final_hash"})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        etcd.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    rode = [r["stall_s"] for r in runs if r["ok"] and r["equal"] and not r["fenced"] and not r["failures"]]
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "machine": machine_info(),
        "stamp": run_stamp(),
        "reference": {k: v for k, v in ref.items() if k != "final_hash"},
        "runs": runs,
        "longest_ridden_s": max(rode, default=None),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'stall (s)':>10} {'ok':>4} {'equal':>6} {'fenced':>7} {'lost':>5} {'restarts':>9} {'lapsed':>7} "
          f"{'steps in stall':>15} {'extra (s)':>10}")  # fmt: skip
    for r in runs:
        print(
            f"{r['stall_s']:>10g} {r['ok']!s:>4} {r['equal']!s:>6} {r['fenced']:>7} {r['nodes_lost']:>5} "
            f"{r['coordinator_restarts']:>9} {r['lapsed']:>7} {r.get('steps_during_stall', '-')!s:>15} "
            f"{r['extra_s']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
