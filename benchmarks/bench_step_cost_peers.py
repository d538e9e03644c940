"""What fault tolerance costs every step, side by side: plain DDP, torchft, nonstop.

No failure is injected: this measures the price each system charges a job that never fails, the
figure the simulator charges every strategy per step (``nonstop/sim/calibrate.py``). Four
contenders run the same job (the demo's decoder-only transformer, ``--model``, AdamW, the demo's
generated data, ``--batch`` sequences per rank, ``--nproc`` data-parallel ranks on gloo,
``OMP_NUM_THREADS`` = cpu_count // nproc), alternating round by round (one warm-up round first,
not counted):

* ``ddp``: plain ``torch.nn.parallel.DistributedDataParallel``, no checkpoint
  (``baseline_torchrun_train.py`` started as torchrun would: one process per rank, env://);
* ``torchft``: torchft 0.2 as its documentation trains DDP (``baseline_torchft_train.py
  --wrappers``): one replica group per rank, a Lighthouse (the node-loss benchmark's flags), the
  quorum started in ``zero_grad``, DDP's buckets averaged by ``Manager.allreduce`` in the comm hook,
  the commit vote in ``step``;
* ``nonstop_off``: ``nonstop run --snapshot off`` (nonstop's worker without its per-step snapshot);
* ``nonstop``: ``nonstop run`` with its defaults (an overlapped snapshot every step).

The figure is the pace of rank 0's loop: the median interval between consecutive steps after
``--skip`` warm-up steps (torchft and DDP: between the ``step`` events a rank writes when a step
is done; nonstop: between the starts of ``train_step``, which the demo records). Per round, each
contender's median is divided by ``ddp``'s of the same round (the overhead ratio) and subtracted
from it (the overhead in seconds); the report gives median/min/max over rounds.

Run it::

    .venv/bin/python benchmarks/bench_step_cost_peers.py            # -> results/step_cost_peers.json
    .venv/bin/python benchmarks/bench_step_cost_peers.py --quick    # tiny model, 1 round (smoke)

Needs the ``bench`` extra (torchft): ``pip install -e '.[bench]'``.
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_step_overhead import one_job  # noqa: E402
from benchcommon import machine_info, read_jsonl, run_stamp  # noqa: E402
from peers_procs import Procs, free_port  # noqa: E402
from peers_torchft import LIGHTHOUSE_FLAGS, start_lighthouse  # noqa: E402

CONTENDERS = ("ddp", "torchft", "nonstop_off", "nonstop")
BASE = "ddp"
DEFAULT_OUT = BENCH / "results" / "step_cost_peers.json"
DDP_SCRIPT = BENCH / "baseline_torchrun_train.py"
TORCHFT_SCRIPT = BENCH / "baseline_torchft_train.py"


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(args.omp_threads), GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _workload(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch)]


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            rc = p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{what}: a worker did not finish within {timeout:.0f} s") from None
        if rc != 0:
            raise RuntimeError(f"{what}: a worker exited with {rc} (logs in the run dir)")


def _rank0_intervals(events_path: Path) -> list[float]:
    ts = sorted(float(e["ts"]) for e in read_jsonl(events_path) if e["event"] == "step" and e["rank"] == 0)
    return [b - a for a, b in itertools.pairwise(ts)]


def run_ddp(args: argparse.Namespace, run_dir: Path) -> list[float]:
    procs = Procs(run_dir, _env(args))
    events = run_dir / "events.jsonl"
    port = free_port()
    try:
        workers = [
            procs.start(
                f"ddp-r{r}",
                [
                    *(sys.executable, "-u", str(DDP_SCRIPT), *_workload(args)),
                    *("--ckpt-every", "1000000000", "--run-dir", str(run_dir), "--events", str(events)),
                ],
                {
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(args.nproc),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
            )
            for r in range(args.nproc)
        ]
        _wait_all(workers, args.timeout_s, "ddp")
    finally:
        procs.close()
    return _rank0_intervals(events)


def run_torchft(args: argparse.Namespace, run_dir: Path) -> list[float]:
    procs = Procs(run_dir, _env(args))
    events = run_dir / "events.jsonl"
    try:
        start_lighthouse(procs)
        workers = [
            procs.start(
                f"torchft-g{g}",
                [
                    *(sys.executable, "-u", str(TORCHFT_SCRIPT), *_workload(args), "--wrappers"),
                    *("--min-full-steps", str(args.steps)),
                    *("--replica-group", str(g), "--num-groups", str(args.nproc)),
                    *("--run-dir", str(run_dir), "--events", str(events)),
                ],
                {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"},
            )
            for g in range(args.nproc)
        ]
        _wait_all(workers, args.timeout_s, "torchft")
    finally:
        procs.close()
    # A group that joins while the other already trains takes part from its next quorum on: count
    # from the first step every group took part in (the run goes on until --steps of those in a row).
    evs = [e for e in read_jsonl(events) if e["event"] == "step" and e["rank"] == 0]
    first = next((i for i, e in enumerate(evs) if e.get("participants") == args.nproc), None)
    if first is None or any(e.get("participants") != args.nproc for e in evs[first:]):
        bad = [(e.get("step"), e.get("participants")) for e in evs]
        raise RuntimeError(f"torchft: not every replica group took part in the counted steps: {bad}")
    ts = [float(e["ts"]) for e in evs[first:]]
    return [b - a for a, b in itertools.pairwise(ts)]


def one_round(args: argparse.Namespace, work: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in args.contenders:
        run_dir = work / f"{name}-{time.monotonic_ns()}"
        run_dir.mkdir(parents=True)
        if name.startswith("nonstop"):  # bench_step_overhead's job: nonstop run, rank 0's loop pace
            out[name] = one_job("off" if name == "nonstop_off" else "overlapped", args, run_dir)
        else:
            intervals = run_ddp(args, run_dir) if name == "ddp" else run_torchft(args, run_dir)
            counted = intervals[args.skip :]
            if not counted:
                raise RuntimeError(f"{name}: no step interval after the {args.skip} skipped")
            out[name] = {"median_interval_s": statistics.median(counted), "intervals_s": counted}
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def summarize(rounds: list[dict[str, dict[str, Any]]], contenders: tuple[str, ...]) -> dict[str, Any]:
    """Per contender: the median interval over rounds, and per round its ratio to and excess over
    ``ddp``'s interval of the same round (median/min/max over rounds)."""

    def mmm(vals: list[float]) -> dict[str, float]:
        return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}

    out: dict[str, Any] = {}
    for name in contenders:
        entry: dict[str, Any] = {"median_interval_s": mmm([r[name]["median_interval_s"] for r in rounds])}
        if name != BASE and BASE in contenders:
            entry["interval_vs_ddp"] = mmm(
                [r[name]["median_interval_s"] / r[BASE]["median_interval_s"] for r in rounds]
            )
            entry["extra_s_vs_ddp"] = mmm(
                [r[name]["median_interval_s"] - r[BASE]["median_interval_s"] for r in rounds]
            )
        out[name] = entry
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (torchft: replica groups)")
    ap.add_argument("--model", default="medium")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=4, help="first step intervals not counted (warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="counted rounds after one warm-up round")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per contender run")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round: a smoke run")
    args = ap.parse_args(argv)
    args.contenders = tuple(c.strip() for c in args.contenders.split(",") if c.strip())
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown or not args.contenders:
        ap.error(f"--contenders takes some of {', '.join(CONTENDERS)}; got {args.contenders}")
    if args.nproc < 2:
        ap.error("--nproc must be >= 2 (fault tolerance across ranks)")
    if args.quick:
        args.model, args.steps, args.runs, args.skip = "tiny", 8, 1, 2
    args.omp_threads = max(1, (os.cpu_count() or 1) // args.nproc)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds: list[dict[str, dict[str, Any]]] = []
    (REPO / ".nonstop").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-stepcost-", dir=REPO / ".nonstop") as tmp:
        for i in range(args.runs + 1):
            r = one_round(args, Path(tmp) / f"round{i}")
            print(
                f"[bench] round {i}{' (warm-up)' if i == 0 else ''}: "
                + ", ".join(f"{n} {v['median_interval_s'] * 1e3:.1f} ms" for n, v in r.items()),
                flush=True,
            )
            if i > 0:
                rounds.append(r)
    report = {
        "benchmark": "step_cost_peers",
        "what": "per-step pace of a job that never fails: plain DDP, torchft 0.2, nonstop (rank 0's loop)",
        "workload": {
            k: getattr(args, k) for k in ("nproc", "model", "batch", "steps", "skip", "runs", "omp_threads")
        },
        "torchft": {
            "lighthouse": LIGHTHOUSE_FLAGS,
            "training": "torchft DistributedDataParallel + Optimizer",
        },
        "machine": machine_info(),
        **run_stamp(),
        "rounds": rounds,
        "summary": summarize(rounds, args.contenders),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'contender':<12} {'median step ms':>15} {'vs ddp':>8} {'extra ms':>9}")
    for name, e in report["summary"].items():
        ratio = e.get("interval_vs_ddp", {}).get("median")
        extra = e.get("extra_s_vs_ddp", {}).get("median")
        print(
            f"{name:<12} {e['median_interval_s']['median'] * 1e3:>15.1f} "
            f"{'' if ratio is None else f'{ratio:.3f}':>8} {'' if extra is None else f'{extra * 1e3:.1f}':>9}"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
