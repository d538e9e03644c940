"""False hang kills on an oversubscribed machine: the agent's confirmation against a bare timeout.

What is measured. A data-parallel job of the demo transformer (``tiny``, batch 4, gloo, CPU),
3 local nodes x 1 rank, one hot spare per node, the **default** 1 s heartbeat timeout, beside
``--burners`` processes that spin on the CPU for the whole run (default: one per core, so the
job's processes get at most half the machine). The lease TTL is 3 s so that a node's lease, a
different judgement, does not end a run; this benchmark is about the heartbeat's. Two detector
modes alternate run by run:

* ``confirm`` (the default): a silent worker's node agent watches it for 0.2 s in ``/proc`` and
  kills it only if it is stopped or still (``agent/silence.py``); one that moves is spared
  (``silence_excused``) and allowed 3x the timeout;
* ``kill`` (``--no-confirm-silence``): the coordinator kills a worker at its first second of
  silence, as nonstop did before.

Each mode runs with no fault (every ``hang_detected`` is then a false kill: a healthy rank killed
and replaced) and with ``hang:rank=1,step=12`` (SIGSTOP: one true hang, whose detection time must
not grow). Per run, from the event log and the job's result:

* ``false_kills``: ``hang_detected`` events other than the injected hang's first;
* ``excused``: ``silence_excused`` events (a healthy, starved rank spared);
* ``failures``: recoveries the job went through; ``detect_s``: the injected hang's detection time
  (the fault's wall time to the kill's verdict);
* ``equal``: final weights bitwise equal to the first no-fault run's (every recovery lost nothing).

Summaries are median [min, max] over ``--runs`` rounds. Results go to
``benchmarks/results/silence.json``::

    .venv/bin/python benchmarks/bench_silence.py            # 40 steps, 3 rounds (~10 min)
    .venv/bin/python benchmarks/bench_silence.py --quick    # 24 steps, 1 round, no-fault only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.config import DetectorConfig  # noqa: E402
from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402

MODES = ("confirm", "kill")
HANG = "hang:rank=1,step=12"


@contextmanager
def burners(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _run(args: argparse.Namespace, run_dir: Path, mode: str, fault: str | None) -> dict[str, Any]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    config = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=run_dir / "result.json",
        steps=args.steps,
        model="tiny",
        batch=4,
        nproc_per_node=1,
        nnodes=3,
        spares=1,
        job_dir=run_dir,
        faults=(fault,) if fault else (),
        coordinator="127.0.0.1:0",
        lease_ttl_s=3.0,
        detector=DetectorConfig(confirm_silence=mode == "confirm"),
        max_restarts=20,
    )
    t0 = time.monotonic()
    with burners(args.burners):
        result = run_local_nodes(config, redirect_output=True)
    out: dict[str, Any] = {"mode": mode, "fault": fault, "ok": result.state is JobState.DONE}
    out["wall_s"] = round(time.monotonic() - t0, 1)
    events = read_events(run_dir / "events.jsonl")
    hangs = [e for e in events if e["event"] == "hang_detected"]
    # the injected hang: the first failure of a process the fault fired in (its detect_s is
    # measured from the fault's own wall time; a process nothing was injected into has none)
    injected = [f for f in result.failures if fault and f.get("kind") == "hang" and f.get("detect_s")]
    out.update(
        false_kills=len(hangs) - min(1, len(injected)),
        excused=sum(1 for e in events if e["event"] == "silence_excused"),
        failures=len(result.failures),
        hang_reasons=[f"rank {e.get('rank')}: {e['reason'][:100]}" for e in hangs],
        failure_list=[
            [f.get("kind"), f.get("rank"), str(f.get("detail"))[:100], f.get("detect_s")]
            for f in result.failures
        ],
        excused_detail=[
            f"rank {e.get('rank')}: {e.get('detail')}" for e in events if e["event"] == "silence_excused"
        ],
    )
    out["detect_s"] = injected[0]["detect_s"] if injected else None
    result_file = run_dir / "result.json"
    if out["ok"] and result_file.exists():
        out["final_hash"] = json.loads(result_file.read_text())["final_hash"]
    else:
        out["ok"] = False
        out["error"] = result.error
    return out


KEYS = ("false_kills", "excused", "failures", "detect_s", "wall_s")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="CPU-spinning processes beside")
    p.add_argument("--runs", type=int, default=3, help="rounds of every mode and fault")
    p.add_argument("--quick", action="store_true", help="24 steps, 1 round, no-fault runs only")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "silence.json")
    args = p.parse_args(argv)
    faults: tuple[str | None, ...] = (None, HANG)
    if args.quick:
        args.steps, args.runs, faults = 24, 1, (None,)
    info = machine_info()
    work = Path(tempfile.mkdtemp(prefix="nonstop-bench-silence-"))
    runs: list[dict[str, Any]] = []
    ref_hash: str | None = None
    try:
        for i in range(args.runs):
            for fault in faults:
                for mode in MODES:
                    r = _run(args, work / f"{mode}-{fault is not None}-{i}", mode, fault)
                    r["round"] = i
                    if ref_hash is None and r["ok"] and fault is None:
                        ref_hash = r["final_hash"]
                    r["equal"] = r["ok"] and r.get("final_hash") == ref_hash
                    runs.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k != "final_hash"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {}
    for fault in faults:
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode and r["fault"] == fault]
            ok = [r for r in mine if r["ok"]]
            entry: dict[str, Any] = {k: summarize([r[k] for r in ok if r.get(k) is not None]) for k in KEYS}
            entry["runs"], entry["ok"] = len(mine), len(ok)
            entry["false_kills_total"] = sum(r["false_kills"] for r in mine)
            entry["equal"] = sum(1 for r in mine if r["equal"])
            summary[f"{mode}, {'hang' if fault else 'no fault'}"] = entry
    report = {
        "benchmark": "silence",
        "settings": {"steps": args.steps, "burners": args.burners, "runs": args.runs, "hang": HANG},
        "machine": info,
        "stamp": run_stamp(),
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, s in summary.items():
        print(
            f"{name:>18}: false kills {s['false_kills_total']} in {s['runs']} runs, excused "
            f"{fmt(s['excused'], digits=0)}, failures {fmt(s['failures'], digits=0)}, "
            f"detect {fmt(s['detect_s'])} s, equal {s['equal']}/{s['runs']}"
        )
    return 0 if all(r["ok"] and r["equal"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
