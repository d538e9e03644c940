"""Node loss, side by side: nonstop versus torchft versus torchrun + DCP, same model, same kill.

What is measured. A data-parallel (or, with ``--mesh``, sharded) job of 4 ranks (2 nodes x 2 ranks,
every "node" a set of processes on this machine) trains the demo transformer
(``nonstop.demo.model``, preset ``--model``, ``small`` by default) on the demo's data
(``nonstop.demo.data``; batch 8 x seq per rank, AdamW, lr 3e-3: ``nonstop.demo.train``'s workload),
gloo on CPU, ``GLOO_SOCKET_IFNAME=lo`` and the same ``OMP_NUM_THREADS`` (cpu_count // 2) for every
contender. When a worker of the last node starts step ``--fault-step``, the whole node is lost:
every process of it (its agent, if the contender has one, and its workers) is SIGKILLed. The
contenders, alternating run by run (nonstop, torchft, torchrun+DCP, nonstop, ...; ``--warmup``
rounds first, not counted):

* ``nonstop``: ``bench_node_loss.one_run`` with the 2x2 layout: one node agent per node, as many
  hot spares per node as it has ranks, ``--replicas 1``; node 0's spares take node 1's ranks
  with the state replicated into node 0's memory. Nothing is relaunched.
* ``torchft`` (``baseline_torchft_train.py``, torchft from PyPI): one replica group per node (2
  groups x 2 ranks; inside a group gradients are averaged with plain gloo, across groups with
  ``Manager.allreduce`` per gradient, ``Manager.should_commit`` gates the optimizer step), one
  ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000
  --heartbeat_timeout_ms 1000``. The benchmark launches a replacement group (2 new processes)
  the moment it sees the node's processes die (its best case: no scheduler, no node to find);
  the replacement heals from a survivor over torchft's HTTP transport. ``use_async_quorum=False``
  by default (``--torchft-async-quorum``: torchft's default): the replacement loads the state
  before its first forward and takes part in that first step, its best case; groups train past
  ``--steps`` until 3 steps in a row had both groups in (``--min-full-steps``).
* ``torchrun_dcp`` (``baseline_torchrun_dcp_train.py``): two torchrun agents (``--nnodes 2
  --nproc-per-node 2``, c10d rendezvous on 127.0.0.1, hosted by node 0's agent,
  ``--max-restarts 3 --monitor-interval 0.1``, rendezvous keep-alive ``--rdzv-keepalive``,
  default 1 s x 2 instead of torch's 5 s x 3, which would hold the new round ~15 s for the dead
  node), DDP, ``torch.distributed.checkpoint.async_save`` every ``--ckpt-every`` steps; a
  worker whose collective failed exits at once (``os._exit``) instead of spending ~1.5 s in
  torch.distributed's native teardown. Node 1's agent and workers are killed; the benchmark
  starts a replacement agent the moment it sees node 1's agent die; node 0's agent restarts its
  workers and every rank loads the newest complete DCP checkpoint.

Figures per run, in seconds from the fault (the timestamp the dying worker takes just before
the SIGKILL):

* ``survivors_resume_s``: until every surviving rank (node 0's) has completed a step again
  (torchft: committed a step the lost node had not already voted for, i.e. step >= the fault
  step). nonstop and torchrun restart every rank together, so for them it is the moment of the
  next two figures (nonstop: the end of RESUME, every rank has completed a step);
* ``replacement_participates_s``: until every rank that replaces node 1's (nonstop: the spares
  that took them; torchft: the replacement group, in a committed step its gradients counted in,
  not a healing-only step; torchrun: the new node's workers) has completed a step;
* ``full_participation_s``: until all 4 ranks have completed a step together after the kill
  (nonstop: ``mttr_s``; torchft: a committed step with both groups taking part; torchrun: every
  restarted rank's first step) -- the headline, with the ratios contender / nonstop per round
  (run i / run i, then median, min, max) and of the medians;
* ``lost_steps``: committed steps redone (torchft: steps a rank commits again after the fault;
  torchrun: fault step - the checkpoint loaded, which is the newest save *completed* before the
  kill: one in flight dies with the node);
* ``detect_s`` where the contender declares the failure (nonstop: its coordinator; torchrun: the
  surviving agent's first log line about it; torchft has no such event: the survivors' allreduce
  fails and the Lighthouse drops the group after its heartbeat timeout),
  ``replacement_launched_s`` (the benchmark's reaction, torchft and torchrun) and each
  contender's stages (``stages`` / ``stages_from_fault``).

Summaries are median, min and max over the counted runs (``benchcommon.summarize``). Results go
to ``benchmarks/results/node_loss_peers.json``. A round (one run of each contender, small model,
60 steps) took ~2 minutes on a loaded 2-core VM, so the default full run (1 warm-up + 3 counted
rounds) takes ~8-10 minutes::

    .venv/bin/python benchmarks/bench_node_loss_peers.py            # small model, 1 warm-up + 3 runs each
    .venv/bin/python benchmarks/bench_node_loss_peers.py --quick    # tiny model, 1 run each (smoke)
    .venv/bin/python benchmarks/bench_node_loss_peers.py --contenders nonstop,torchft --runs 5
    .venv/bin/python benchmarks/bench_node_loss_peers.py --mesh replicate=2,shard=2 \
        --out benchmarks/results/node_loss_peers-hsdp.json

Sharded (``--mesh``): both nonstop (``nonstop.demo.train_sharded``) and torchrun + DCP lay the
model out on that mesh of the 4 ranks; with ``replicate=2,shard=2`` (HSDP) each node is one
replica group of 2 FSDP shards, so the lost node is a whole replica: nonstop's spares on node 0
take its ranks from the peer replicas node 0 holds, and torchrun's restarted ranks reshard-load
the newest DCP checkpoint. torchft is left out (its replicate-only recovery restarts a whole
group; it is not wired for a sharded model here). ``--contenders nonstop,nonstop_cold`` (sharded
only) sets nonstop beside itself with spares that wait cold (the demo's ``--no-prewarm``: no
``nonstop.init(build=...)``), what the warm-up of ``nonstop/train/prewarm.py`` saves.

The contenders' code: ``peers_procs.py`` (options, layout, the processes of a run),
``peers_torchft.py``, ``peers_torchrun.py``; nonstop's is here and in ``bench_node_loss.py``.

Fairness notes. nonstop recovers onto hot spares already running (that is its design; nothing
is started after the kill); torchft and torchrun get a replacement started by the benchmark the
instant the node dies (~0.05 s), which no real scheduler does: their figures are lower bounds.
All "nodes" share this machine's cores: processes started after the kill (torchft's 2, torchrun's
4: it restarts every worker) import torch while the rest run, which a real node with its own CPUs
would not suffer; the stages show how much of each recovery is start-up. torchft's survivors
never stop training, so ``survivors_resume_s`` is its figure to set beside nonstop's. The lost
node's shared memory (nonstop's snapshots and replicas on node 1) outlives its SIGKILLed agent on
one machine; the benchmark removes that job's segments after each nonstop run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_node_loss import one_run  # noqa: E402
from benchcommon import fmt, machine_info, ratio_summary, read_jsonl, run_stamp, summarize  # noqa: E402
from peers_procs import NNODES, NPROC, Options, wait_gone  # noqa: E402
from peers_torchft import LIGHTHOUSE_FLAGS, run_torchft  # noqa: E402
from peers_torchrun import run_torchrun_dcp  # noqa: E402

from nonstop.agent.gc import processes_of_job  # noqa: E402
from nonstop.launch.launcher import default_shm_dir  # noqa: E402

DEFAULT_OUT = BENCH / "results" / "node_loss_peers.json"
CONTENDERS: dict[str, str] = {
    "nonstop": "nonstop (hot spares)",
    "nonstop_cold": "nonstop, spares not warmed",
    "torchft": "torchft (Lighthouse 1 s)",
    "torchrun_dcp": "torchrun + DCP",
}
FIGURES = ("survivors_resume_s", "replacement_participates_s", "full_participation_s")


# -- contender 1: nonstop ------------------------------------------------------------------------------
def clean_nonstop_job(run_dir: Path) -> tuple[int, int]:
    """Remove what the job left on this machine: the lost node's agent was SIGKILLed with its
    shared-memory segments still there (on a real node they go with the machine). Returns
    (processes killed, segments removed); only this job's (its id from the event log)."""
    try:
        job_id = next(
            str(e["job_id"]) for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "job_start"
        )
    except StopIteration:
        return 0, 0
    pids = processes_of_job(job_id)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    wait_gone(pids, 5)
    prefixes = (f"nonstop-{job_id}.", f"nonstop-{job_id}-")
    segs = [p for p in default_shm_dir().glob(f"nonstop-{job_id}*") if p.name.startswith(prefixes)]
    for p in segs:
        p.unlink(missing_ok=True)
    return len(pids), len(segs)


def run_nonstop(opts: Options, run_dir: Path, *, prewarm: bool = True) -> dict[str, Any]:
    args = argparse.Namespace(
        steps=opts.steps,
        model=opts.model,
        fault_step=opts.fault_step,
        lease_ttl=opts.lease_ttl,
        step_delay=opts.step_delay,
        mesh=opts.mesh,
        script_extra=() if prewarm else ("--no-prewarm",),
    )
    t0 = time.monotonic()
    try:
        rec = one_run(args, NNODES, NPROC, run_dir)
    finally:
        left = clean_nonstop_job(run_dir)
    rec["wall_s"] = time.monotonic() - t0
    rec["left_behind"], rec["shm_segments_removed"] = left
    if not rec.get("ok") or "mttr_s" not in rec:
        rec["ok"] = False
        rec["error"] = rec.get("error") or "no failure recorded (did the node fault fire?)"
        return rec
    # nonstop resumes every rank in one new generation: the survivors and the spares that took
    # the lost node's ranks complete their first step in the same RESUME stage.
    for k in FIGURES:
        rec[k] = rec["mttr_s"]
    rec["step_s_median"] = rec.get("median_step_s")
    return rec


# -- the benchmark -----------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Options, Path], dict[str, Any]]] = {
    "nonstop": run_nonstop,
    # A sharded job's spares as before nonstop.init(build=...): cold DTensor caches (train/prewarm.py)
    "nonstop_cold": functools.partial(run_nonstop, prewarm=False),
    "torchft": run_torchft,
    "torchrun_dcp": run_torchrun_dcp,
}


def run_one(name: str, opts: Options, run_dir: Path) -> dict[str, Any]:
    try:
        return RUNNERS[name](opts, run_dir)
    except Exception as e:  # one broken run must not lose the others
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    keys = (*FIGURES, "detect_s", "training_again_s", "lost_steps", "replacement_launched_s", "step_s_median")
    out: dict[str, Any] = {
        k: summarize([r[k] for r in ok if r.get(k) is not None]) for k in keys if any(k in r for r in ok)
    }
    stage_key = "stages_from_fault" if ok and "stages_from_fault" in ok[0] else "stages"
    if ok and stage_key in ok[0]:
        out[stage_key] = {
            s: summarize([r[stage_key][s] for r in ok if r[stage_key].get(s) is not None])
            for s in ok[0][stage_key]
        }
    out["runs_ok"] = len(ok)
    out["runs_failed"] = len(runs) - len(ok)
    return out


def ratios(runs: dict[str, list[dict[str, Any]]], summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """contender / nonstop per figure: per round (run i / run i, then median, min, max) and of the medians."""
    out: dict[str, Any] = {}
    if "nonstop" not in runs:
        return out
    for name in runs:
        if name == "nonstop":
            continue
        for key in FIGURES:
            a, b = summaries[name].get(key), summaries["nonstop"].get(key)
            out[f"{key}:{name}/nonstop"] = {
                "per_round": ratio_summary(runs[name], runs["nonstop"], key),
                "of_medians": a["median"] / b["median"] if a and b and b["median"] else None,
            }
    return out


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    layout = f" as {c['mesh']}" if c.get("mesh") else ""
    print(
        f"\nNode loss, {NNODES} nodes x {NPROC} ranks{layout}, model {c['model']}, node {NNODES - 1} "
        f"SIGKILLed at step {c['fault_step']} of {c['steps']}; seconds from the kill, median [min-max] over "
        f"{c['runs']} run(s)"
    )
    head = (
        f"{'contender':<26}{'survivors resume':>24}{'replacement in':>24}{'full participation':>24}"
        f"{'lost':>6}"
    )
    print(head)
    print("-" * len(head))
    for name, entry in report["contenders"].items():
        s = entry["summary"]
        print(
            f"{entry['label']:<26}{fmt(s.get('survivors_resume_s')):>24}"
            f"{fmt(s.get('replacement_participates_s')):>24}{fmt(s.get('full_participation_s')):>24}"
            f"{fmt(s.get('lost_steps'), digits=0):>6}"
        )
        if s["runs_failed"]:
            errs = [r.get("error") for r in entry["runs"] if not r.get("ok")]
            print(f"  {name}: {s['runs_failed']} failed run(s): {errs}")
    for key, r in report["ratios"].items():
        if key.startswith("full_participation_s") and r["per_round"]:
            p = r["per_round"]
            print(
                f"full participation {key.split(':')[1]}: {p['median']:.1f}x per round "
                f"[{p['min']:.1f}-{p['max']:.1f}], {r['of_medians']:.1f}x of the medians"
            )
    print(f"benchmark wall time {report['wall_s']:.0f}s -> {report['out']}")


def run_benchmark(opts: Options, work: Path, out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    machine = machine_info()
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in opts.contenders}
    warm: dict[str, list[dict[str, Any]]] = {n: [] for n in opts.contenders}
    for i in range(opts.warmup + opts.runs):
        counted = i >= opts.warmup
        for name in opts.contenders:
            rec = run_one(name, opts, work / f"round{i}" / name)
            rec["round"] = i
            (runs if counted else warm)[name].append(rec)
            if not opts.keep_work:
                shutil.rmtree(work / f"round{i}" / name, ignore_errors=True)
            tag = "" if counted else " (warm-up)"
            if rec.get("ok"):
                print(
                    f"round {i}{tag} {name}: survivors {rec['survivors_resume_s']:.2f}s, replacement "
                    f"{rec['replacement_participates_s']:.2f}s, full {rec['full_participation_s']:.2f}s, "
                    f"lost {rec['lost_steps']}, wall {rec.get('wall_s', 0):.0f}s",
                    flush=True,
                )
            else:
                print(f"round {i}{tag} {name}: FAILED: {rec.get('error')}", flush=True)
    machine["loadavg_at_end"] = list(os.getloadavg())
    summaries = {n: summarize_runs(runs[n]) for n in opts.contenders}
    report: dict[str, Any] = {
        "benchmark": "node_loss_peers",
        **run_stamp(),
        "command": [Path(sys.executable).name, *sys.argv],
        "machine": machine,
        "config": {
            **asdict(opts),
            "layout": f"{NNODES}x{NPROC}",
            "batch_per_rank": 8,
            "torchft": _version("torchft"),
            "lighthouse": LIGHTHOUSE_FLAGS,
            "env": {"OMP_NUM_THREADS": opts.omp_threads, "GLOO_SOCKET_IFNAME": "lo"},
        },
        "notes": [
            "nonstop recovers onto hot spares already running; torchft and torchrun get a replacement "
            "launched by the benchmark the instant the node dies (their best case: lower bounds).",
            "nonstop resumes all ranks in one generation: its three figures are all mttr_s (end of RESUME).",
            "torchft: use_async_quorum=False unless torchft_sync_quorum is false: the replacement heals "
            "before its first forward; replacement_participates_s counts the first committed step its "
            "gradients counted in (replacement_first_step_s: its first step of any kind).",
            "torchrun: every rank is restarted and reloads the newest DCP checkpoint completed before the "
            "kill; lost_steps = fault step - that step. Rendezvous keep-alive rdzv_keepalive (torch's "
            "default 5 s x 3); failed workers os._exit at once (skipping ~1.5 s of native teardown).",
            "All nodes share this machine's cores: processes started after the kill import torch while "
            "the others run (torchrun restarts all 4 workers, torchft starts 2).",
        ],
        "contenders": {
            n: {"label": CONTENDERS[n], "summary": summaries[n], "runs": runs[n]} for n in opts.contenders
        },
        "warmup": warm,
        "ratios": ratios(runs, summaries),
        "wall_s": time.monotonic() - t0,
        "out": str(out),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _version(dist_name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv: Sequence[str] | None) -> tuple[Options, Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="demo model preset (default small; --quick: tiny)")
    ap.add_argument("--runs", type=int, default=None, help="counted runs per contender (default 3)")
    ap.add_argument("--warmup", type=int, default=None, help="uncounted rounds first (default 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default 60)")
    ap.add_argument("--fault-step", type=int, default=None, help="node 1 is lost at this step (default 14)")
    ap.add_argument(
        "--ckpt-every", type=int, default=None, help="torchrun+DCP checkpoint period (default 10)"
    )
    ap.add_argument("--step-delay", type=float, default=None, help="extra seconds per step, every contender")
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="nonstop's node lease (as bench_node_loss)")
    ap.add_argument(
        "--rdzv-keepalive",
        default="1,2",
        help="torchrun c10d keep_alive_interval,keep_alive_max_attempt (seconds, count; torch's default 5,3)",
    )
    ap.add_argument(
        "--torchft-async-quorum",
        action="store_true",
        help="torchft's default use_async_quorum=True: a replacement's first step only heals (it takes "
        "part from its second); the default here, use_async_quorum=False, is torchft's best case",
    )
    ap.add_argument("--contenders", default=None, help="comma-separated subset, in run order (default all)")
    ap.add_argument(
        "--mesh",
        default=None,
        help=f"sharded: every contender lays the model out on this mesh of {NNODES * NPROC} ranks, e.g. "
        "replicate=2,shard=2 (HSDP, a replica group per node: the lost node is a whole replica); "
        "nonstop runs nonstop.demo.train_sharded, torchrun + DCP the same layout (default: DDP); "
        "torchft is left out",
    )
    ap.add_argument("--timeout", type=float, default=None, help="per-job limit, seconds (default 600)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 1 run each, no warm-up")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--keep-work", action="store_true", help="keep the work dir (logs, events) for a look")
    a = ap.parse_args(argv)
    q = a.quick
    default = [n for n in CONTENDERS if not (a.mesh and n == "torchft") and n != "nonstop_cold"]
    names = tuple(n for n in (a.contenders or ",".join(default)).split(",") if n)
    if not names or any(n not in CONTENDERS for n in names):
        ap.error(f"--contenders: a subset of {','.join(CONTENDERS)}")
    if a.mesh is not None:
        from nonstop.errors import UsageError
        from nonstop.mesh import MeshSpec

        try:
            world = MeshSpec.parse(a.mesh).world_size
        except UsageError as e:
            ap.error(str(e))
        if world != NNODES * NPROC:
            ap.error(f"--mesh {a.mesh} has {world} ranks; this layout has {NNODES * NPROC}")
        if "torchft" in names:
            ap.error("--mesh: torchft is no contender for a sharded job here (leave it out of --contenders)")
    elif "nonstop_cold" in names:
        ap.error("--contenders nonstop_cold: a sharded job's spares warm up (--mesh); a DDP job's do not")
    interval, attempts = (int(x) for x in a.rdzv_keepalive.split(","))
    opts = Options(
        model=a.model or ("tiny" if q else "small"),
        runs=a.runs if a.runs is not None else (1 if q else 3),
        warmup=a.warmup if a.warmup is not None else (0 if q else 1),
        steps=a.steps if a.steps is not None else (80 if q else 60),
        fault_step=a.fault_step if a.fault_step is not None else (8 if q else 14),
        ckpt_every=a.ckpt_every if a.ckpt_every is not None else (4 if q else 10),
        step_delay=a.step_delay if a.step_delay is not None else (0.05 if q else 0.0),
        lease_ttl=a.lease_ttl,
        omp_threads=max(1, (os.cpu_count() or 1) // NPROC),
        timeout_s=a.timeout if a.timeout is not None else (180.0 if q else 600.0),
        rdzv_keepalive=(interval, attempts),
        torchft_sync_quorum=not a.torchft_async_quorum,
        contenders=names,
        quick=q,
        keep_work=a.keep_work,
        mesh=a.mesh,
    )
    if opts.runs < 1 or opts.warmup < 0 or not 0 < opts.fault_step < opts.steps:
        ap.error("need --runs >= 1, --warmup >= 0 and 0 < --fault-step < --steps")
    if "torchrun_dcp" in names and opts.fault_step < opts.ckpt_every:
        ap.error("--fault-step must come after the first DCP checkpoint (>= --ckpt-every)")
    return opts, a.out.resolve()


def main(argv: Sequence[str] | None = None) -> int:
    opts, out = parse_args(argv)
    # nonstop's node agents take OMP_NUM_THREADS from the environment when it is set: the same for all.
    os.environ["OMP_NUM_THREADS"] = str(opts.omp_threads)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    work = Path(tempfile.mkdtemp(prefix="bench-node-peers-"))
    print(f"bench_node_loss_peers: {asdict(opts)}; work dir {work}", flush=True)
    try:
        report = run_benchmark(opts, work, out)
    finally:
        if not opts.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    print_table(report)
    failed = sum(c["summary"]["runs_failed"] for c in report["contenders"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
