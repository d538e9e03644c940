"""A node's snapshot memory for a DDP job: one copy per node (``--snapshot-copies node``) against
one copy per rank (``rank``), at 1, 2 and 4 ranks on the node.

What is measured. A real data-parallel job (``nonstop run``, ``--nproc`` ranks on gloo) trains the
demo transformer (``--model``, default ``small``) with a snapshot every step, its slots in a memory
directory of its own (``--shm-dir``). A sampler thread adds up the bytes the job's segments hold
there (allocated pages, ``st_blocks``) every 20 ms; the figure is the largest sum while the job
runs. Beside it: the loop's pace on rank 0 (median interval between step starts after ``--skip``
warm-up steps), so that a cheaper memory tier that cost step time would show. Both contenders run
alternately, round by round; one warm-up round is not counted. The final weights of both are
compared (the demo's weights hash): they must be equal.

Recovery (``--mttr-nproc``): the job on one node with a hot spare, rank 1 SIGKILLed at step
``--steps // 2`` (nonstop's ``kill`` fault): the failure's MTTR, its restore stage (every rank
reading its snapshot: with one copy per node, its own part and the node's shared write) and the
time to training again, against one copy per rank; the weights must still be equal.

HSDP (``--hsdp``, on by default): ``replicate=2,shard=2`` on one node of 4 ranks, whose replica
groups' ranks hold the same shards (copy groups: each shard once per node), peak memory against
one copy per rank; every rank's shards must be equal between the two.

Replication (``--replicate-nproc``): the same job on 2 local nodes (``--replicas 1``: each node's
ranks replicated to the other), ``--step-delay`` pacing its steps as in the tests; the figures
are each replication round's bytes before encoding (``raw_bytes``) and on the wire
(``wire_bytes``, delta-encoded and compressed), median over the job's rounds, per node.

Run it::

    .venv/bin/python benchmarks/bench_node_copy.py            # -> results/node_copy.json
    .venv/bin/python benchmarks/bench_node_copy.py --quick    # tiny model, 1 round: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.benchcommon import machine_info, run_stamp, summarize  # noqa: E402
from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.launch.launcher import run_job  # noqa: E402
from nonstop.launch.local_nodes import run_local_nodes  # noqa: E402

COPIES = ("rank", "node")
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "node_copy.json"


def _why(job_dir: Path) -> str:
    """The job's failures and recoveries, from its event log (for a job that failed)."""
    keep = ("failure", "generation", "recovery_failed", "job_failed", "node_lost", "hang", "fault_injected")
    try:
        lines = (job_dir / "events.jsonl").read_text().splitlines()
    except OSError:
        return "(no event log)"
    return "\n".join(ln for ln in lines if any(f'"event": "{k}' in ln for k in keep))[-4000:]


def held(directory: Path) -> int:
    total = 0
    for p in directory.iterdir():
        try:
            total += os.stat(p).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class Sampler(threading.Thread):
    """The largest number of bytes ``directory``'s files held while it ran."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory, self.peak, self._done = directory, 0, threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, held(self.directory))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def _config(kind: str, copies: str, nproc: int, args: argparse.Namespace, work: Path, **over: Any) -> Any:
    """The demo job every measurement runs (its own job dir under ``work``), with ``over``."""
    job_dir = work / f"{kind}-{copies}-{nproc}-{time.monotonic_ns()}"
    fields: dict[str, Any] = dict(
        result=job_dir / "result.json",
        steps=args.steps,
        model=args.model,
        batch=args.batch,
        nproc_per_node=nproc,
        job_dir=job_dir,
        snapshot_copies=copies,
        persist_every=0,
        persist_url=str(job_dir / "ckpt"),
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
    )
    return demo_job_config(**(fields | over))


def _sampled(cfg: Any, what: str) -> tuple[Path, int]:
    """Run the single-node job ``cfg`` with its slots in a directory of its own, sampled; its
    job dir and the peak bytes its segments held (RuntimeError naming ``what`` if it failed)."""
    job_dir = Path(cfg.job_dir)
    shm = job_dir / "shm"
    shm.mkdir(parents=True)
    sampler = Sampler(shm)
    sampler.start()
    try:
        res = run_job(replace(cfg, snapshot=replace(cfg.snapshot, shm_dir=shm)), redirect_output=True)
    finally:
        peak = sampler.stop()
    if res.state is not JobState.DONE or not (job_dir / "result.json").exists():
        raise RuntimeError(f"{what} failed: {res.error}\n{_why(job_dir)}")
    return job_dir, peak


def one_job(copies: str, nproc: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    job_dir, peak = _sampled(_config("job", copies, nproc, args, work), f"{copies} job with {nproc} ranks")
    out = json.loads((job_dir / "result.json").read_text())
    intervals = out["step_intervals_s"][args.skip :]
    shutil.rmtree(job_dir, ignore_errors=True)
    return {
        "shm_peak_bytes": peak,
        "median_interval_s": statistics.median(intervals),
        "weights": out["final_hash"],
    }


def hsdp_job(copies: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """HSDP ``replicate=2,shard=2`` on one node of 4 ranks: ranks 0 and 2 hold shard 0, ranks 1
    and 3 shard 1 (copy groups 0 and 1). Peak snapshot memory; every rank's shards' hash."""
    cfg = _config("hsdp", copies, 4, args, work, mesh="replicate=2,shard=2")
    job_dir, peak = _sampled(cfg, f"{copies} HSDP job")
    hashes = [json.loads((job_dir / f"result.rank{r}.json").read_text())["local_hash"] for r in range(4)]
    shutil.rmtree(job_dir, ignore_errors=True)
    return {"shm_peak_bytes": peak, "weights": hashes}


def mttr_job(copies: str, nproc: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    faults = (f"kill:rank=1,step={args.steps // 2}",)
    cfg = _config("mttr", copies, nproc, args, work, spares=1, faults=faults)
    job_dir, result_file = Path(cfg.job_dir), Path(cfg.job_dir) / "result.json"
    res = run_job(cfg, redirect_output=True)
    if res.state is not JobState.DONE or not result_file.exists() or len(res.failures) != 1:
        raise RuntimeError(f"{copies} recovery job with {nproc} ranks failed: {res.error}\n{_why(job_dir)}")
    (f,) = res.failures
    out = json.loads(result_file.read_text())
    shutil.rmtree(job_dir, ignore_errors=True)
    return {
        "mttr_s": f["mttr_s"],
        "restore_s": f["stages"]["restore"],
        "training_again_s": f["training_again_s"],
        "lost_steps": f["lost_steps"],
        "weights": out["final_hash"],
    }


def replication_job(copies: str, nproc: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cfg = _config(
        "rep", copies, nproc, args, work, steps=args.steps * 2, script_extra=("--step-delay", "0.1"),
        nnodes=2, coordinator="127.0.0.1:0", replicas=1, lease_ttl_s=3.0,
    )  # fmt: skip
    job_dir, result_file = Path(cfg.job_dir), Path(cfg.job_dir) / "result.json"
    res = run_local_nodes(cfg, redirect_output=True)
    if res.state is not JobState.DONE or not result_file.exists():
        raise RuntimeError(
            f"{copies} replication job with {nproc} ranks per node failed: {res.error}\n{_why(job_dir)}"
        )
    rounds = [json.loads(line) for line in (job_dir / "events.jsonl").read_text().splitlines()]
    done = [e for e in rounds if e.get("event") == "replicated" and e.get("raw_bytes")]
    out = json.loads(result_file.read_text())
    shutil.rmtree(job_dir, ignore_errors=True)
    return {
        "rounds": len(done),
        # a round replicates every node's ranks: per node is the round's total over 2 nodes
        # (None: no round completed, e.g. every one superseded on a saturated machine)
        "raw_bytes_per_node": statistics.median(e["raw_bytes"] / 2 for e in done) if done else None,
        "wire_bytes_per_node": statistics.median(e["wire_bytes"] / 2 for e in done) if done else None,
        "weights": out["final_hash"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skip", type=int, default=4, help="first step intervals not counted (warm-up)")
    ap.add_argument("--runs", type=int, default=3, help="counted rounds after one warm-up round")
    ap.add_argument("--mttr-nproc", type=int, nargs="*", default=[4], help="ranks of the recovery jobs")
    ap.add_argument("--replicate-nproc", type=int, nargs="*", default=[2, 4], help="ranks per node, 2 nodes")
    ap.add_argument(
        "--hsdp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also HSDP 2x2 on one node of 4 ranks",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round, 1 and 2 ranks: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.runs, args.skip, args.nproc = "tiny", 8, 1, 2, [1, 2]
        args.replicate_nproc, args.mttr_nproc = [2], [2]
    (REPO_ROOT / ".nonstop").mkdir(exist_ok=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-nodecopy-", dir=REPO_ROOT / ".nonstop") as tmp:
        for i in range(args.runs + 1):
            r: dict[str, Any] = {}
            for nproc in args.nproc:
                for copies in COPIES:
                    got = one_job(copies, nproc, args, Path(tmp))
                    r[f"{copies}-{nproc}"] = got
                    print(
                        f"[bench] round {i} {copies} x{nproc}: "
                        f"shm peak {got['shm_peak_bytes'] / 2**20:.1f} MiB, "
                        f"step {got['median_interval_s'] * 1e3:.1f} ms",
                        flush=True,
                    )
                same = r[f"rank-{nproc}"]["weights"] == r[f"node-{nproc}"]["weights"]
                r[f"equal-{nproc}"] = same
                if not same:
                    raise RuntimeError(f"{nproc} ranks: final weights differ between rank and node copies")
            if args.hsdp:
                for copies in COPIES:
                    got = hsdp_job(copies, args, Path(tmp))
                    r[f"hsdp-{copies}"] = got
                    print(
                        f"[bench] round {i} HSDP 2x2 {copies}: "
                        f"shm peak {got['shm_peak_bytes'] / 2**20:.1f} MiB",
                        flush=True,
                    )
                if r["hsdp-rank"]["weights"] != r["hsdp-node"]["weights"]:
                    raise RuntimeError("HSDP: final shards differ between rank and node copies")
            for nproc in args.mttr_nproc:
                for copies in COPIES:
                    got = mttr_job(copies, nproc, args, Path(tmp))
                    r[f"mttr-{copies}-{nproc}"] = got
                    print(
                        f"[bench] round {i} recovery {copies} x{nproc}: MTTR {got['mttr_s']:.3f} s, "
                        f"restore {got['restore_s'] * 1e3:.0f} ms, lost {got['lost_steps']}",
                        flush=True,
                    )
                if r[f"mttr-rank-{nproc}"]["weights"] != r[f"mttr-node-{nproc}"]["weights"]:
                    raise RuntimeError(
                        f"recovery x{nproc}: final weights differ between rank and node copies"
                    )
            for nproc in args.replicate_nproc:
                for copies in COPIES:
                    got = replication_job(copies, nproc, args, Path(tmp))
                    r[f"rep-{copies}-{nproc}"] = got
                    if got["raw_bytes_per_node"] is None:
                        print(
                            f"[bench] round {i} replication {copies} x{nproc}: no round completed", flush=True
                        )
                        continue
                    print(
                        f"[bench] round {i} replication {copies} x{nproc} per node: "
                        f"raw {got['raw_bytes_per_node'] / 2**20:.2f} MiB, "
                        f"wire {got['wire_bytes_per_node'] / 2**20:.2f} MiB per node and round",
                        flush=True,
                    )
                if r[f"rep-rank-{nproc}"]["weights"] != r[f"rep-node-{nproc}"]["weights"]:
                    raise RuntimeError(
                        f"replication x{nproc}: final weights differ between rank and node copies"
                    )
            if i > 0:
                rounds.append(r)
    summary: dict[str, Any] = {}
    for nproc in args.nproc:
        row: dict[str, Any] = {}
        for copies in COPIES:
            row[copies] = {
                "shm_peak_mib": summarize([r[f"{copies}-{nproc}"]["shm_peak_bytes"] / 2**20 for r in rounds]),
                "step_ms": summarize([r[f"{copies}-{nproc}"]["median_interval_s"] * 1e3 for r in rounds]),
            }
        row["node_over_rank_memory"] = summarize(
            [r[f"node-{nproc}"]["shm_peak_bytes"] / r[f"rank-{nproc}"]["shm_peak_bytes"] for r in rounds]
        )
        row["node_over_rank_step"] = summarize(
            [
                r[f"node-{nproc}"]["median_interval_s"] / r[f"rank-{nproc}"]["median_interval_s"]
                for r in rounds
            ]
        )
        summary[str(nproc)] = row
    replication: dict[str, Any] = {}
    for nproc in args.replicate_nproc:
        row = {}
        # rounds where both jobs completed a replication round (a saturated machine may leave none)
        both = [
            r
            for r in rounds
            if all((r.get(f"rep-{c}-{nproc}") or {}).get("raw_bytes_per_node") for c in COPIES)
        ]
        for copies in COPIES:
            row[copies] = {
                what: summarize([r[f"rep-{copies}-{nproc}"][f"{what}_bytes_per_node"] / 2**20 for r in both])
                for what in ("raw", "wire")
            }
        for what in ("raw", "wire"):
            row[f"node_over_rank_{what}"] = summarize(
                [
                    r[f"rep-node-{nproc}"][f"{what}_bytes_per_node"]
                    / r[f"rep-rank-{nproc}"][f"{what}_bytes_per_node"]
                    for r in both
                ]
            )
        replication[str(nproc)] = row
    recovery: dict[str, Any] = {}
    for nproc in args.mttr_nproc:
        row = {
            copies: {
                what: summarize([r[f"mttr-{copies}-{nproc}"][what] for r in rounds])
                for what in ("mttr_s", "restore_s", "training_again_s", "lost_steps")
            }
            for copies in COPIES
        }
        row["node_over_rank_mttr"] = summarize(
            [r[f"mttr-node-{nproc}"]["mttr_s"] / r[f"mttr-rank-{nproc}"]["mttr_s"] for r in rounds]
        )
        recovery[str(nproc)] = row
    hsdp: dict[str, Any] = {}
    if args.hsdp:
        hsdp = {
            c: {"shm_peak_mib": summarize([r[f"hsdp-{c}"]["shm_peak_bytes"] / 2**20 for r in rounds])}
            for c in COPIES
        }
        hsdp["node_over_rank_memory"] = summarize(
            [r["hsdp-node"]["shm_peak_bytes"] / r["hsdp-rank"]["shm_peak_bytes"] for r in rounds]
        )
    one = summary.get("1", {}).get("rank", {}).get("shm_peak_mib")
    report = {
        "benchmark": "node_copy",
        "what": "peak snapshot memory of a node (its job's segments, allocated bytes) and step pace, "
        "one copy per node vs per rank; final weights equal",
        "workload": {k: getattr(args, k) for k in ("nproc", "model", "batch", "steps", "skip", "runs")},
        "machine": machine_info(),
        **run_stamp(),
        "rounds": rounds,
        "summary": summary,
        "replication_mib_per_node_and_round": replication,
        "recovery": recovery,
        "hsdp_2x2_one_node": hsdp,
        "one_rank_mib": one,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'ranks':>5} {'rank MiB':>10} {'node MiB':>10} {'node/rank':>10} {'step node/rank':>15}")
    for nproc, row in summary.items():
        print(
            f"{nproc:>5} {row['rank']['shm_peak_mib']['median']:>10.1f}"
            f" {row['node']['shm_peak_mib']['median']:>10.1f}"
            f" {row['node_over_rank_memory']['median']:>10.3f} {row['node_over_rank_step']['median']:>15.3f}"
        )
    for nproc, row in recovery.items():
        print(
            f"recovery, {nproc} ranks: MTTR {row['rank']['mttr_s']['median']:.3f} -> "
            f"{row['node']['mttr_s']['median']:.3f} s, "
            f"restore {row['rank']['restore_s']['median'] * 1e3:.0f} -> "
            f"{row['node']['restore_s']['median'] * 1e3:.0f} ms"
        )
    for nproc, row in replication.items():
        if row["rank"]["raw"] is None:
            continue
        print(
            f"replication, {nproc} ranks per node: raw {row['rank']['raw']['median']:.2f} -> "
            f"{row['node']['raw']['median']:.2f} MiB, wire {row['rank']['wire']['median']:.2f} -> "
            f"{row['node']['wire']['median']:.2f} MiB per node and round"
        )
    if hsdp:
        print(
            f"HSDP 2x2, one node of 4 ranks: {hsdp['rank']['shm_peak_mib']['median']:.1f} -> "
            f"{hsdp['node']['shm_peak_mib']['median']:.1f} MiB "
            f"({hsdp['node_over_rank_memory']['median']:.3f})"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
