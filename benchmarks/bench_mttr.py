"""MTTR of a killed worker: nonstop (hot spare / no spare) versus torchrun + ``torch.save`` checkpoints.

What is measured. A data-parallel job of ``--nproc`` ranks (3 by default, gloo, CPU) trains the
demo's decoder-only transformer (``nonstop.demo.model``, preset ``--model``, ``medium`` = ~26M
parameters by default) on the demo's generated data (``--batch`` x seq per rank, default 8, AdamW). Rank 1 is
SIGKILLed when it starts step ``K`` (``--fault-step``). Three contenders run the same workload,
alternating run by run (A B C A B C ...; one warm-up round is not counted):

* ``nonstop_hot``:  ``nonstop.launch.launcher.run_job`` with one hot spare
  (``nonstop.demo.train``; the fault is nonstop's own ``kill:rank=1,step=K``);
* ``nonstop_cold``: the same with no spare (a cold replacement process is started);
* ``torchrun_ckpt``: the baseline most users have: ``benchmarks/baseline_torchrun_train.py``
  (plain DDP, rank 0 ``torch.save``s model + optimizer every ``--ckpt-every`` steps) under
  ``torchrun --max-restarts 1 --monitor-interval 0.1``: the elastic agent stops every worker,
  starts them all again and each loads the last checkpoint from disk.

Figures per run, all measured from the fault (the timestamp the dying worker takes just before
it kills itself):

* ``detect_s``: until the failure is declared (nonstop: the coordinator sees the exit;
  torchrun: the agent's first log line about it, timestamped here as it arrives);
* ``training_again_s``: until every rank is in a new process group with the state restored
  (nonstop: end of REBUILD; torchrun: every new process has initialised its process group,
  loaded the checkpoint and wrapped the model in DDP);
* ``mttr_s``: until every rank (the replacement included) has completed its first step after
  the recovery (nonstop: end of RESUME); it includes that step's ordinary compute, which
  dominates when steps take seconds: ``training_again_s`` isolates the recovery itself;
* ``lost_steps``: completed steps that are redone (torchrun: ``K`` - last checkpoint step);
* ``back_at_fault_step_s``: until step ``K`` is completed by every rank (torchrun: measured;
  nonstop: ``mttr_s`` + ``lost_steps`` x the median step time, an estimate);
* the stages of each recovery (nonstop's DETECT..RESUME; torchrun's detect, restart = stop +
  re-rendezvous + spawn, import, build (model, optimizer, data), process group, checkpoint
  load, DDP wrap, first step).

Summaries are median, min and max over the counted runs; ratios are per round (baseline run i /
nonstop run i), then median, min and max. The default ``K`` = 15 with a checkpoint every 10 steps
loses 5 steps: a failure lands on average half-way between two checkpoints.

Notes. ``OMP_NUM_THREADS`` (``--omp-threads``, default cpu_count // nproc) and
``GLOO_SOCKET_IFNAME=lo`` are set the same for every contender. torchrun runs with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with its default shared store the restarted workers
of torch 2.13 can read the previous attempt's gloo addresses and fail to connect
(pytorch/pytorch#135712). The checkpoint is read back from the page cache (it was just
written), which favours the baseline.

Run it. A full run is 3 x (runs + 1) = 18 jobs; on a shared 2-core VM (medium: ~4 s per step)
one job with 17 steps took 90-105 s, so the default full run takes about 30-35 minutes::

    .venv/bin/python benchmarks/bench_mttr.py                  # -> benchmarks/results/mttr.json
    .venv/bin/python benchmarks/bench_mttr.py --quick          # tiny model, 1 run, < 1 minute
    .venv/bin/python benchmarks/bench_mttr.py --model small --runs 5 --nproc 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: import nonstop from this checkout
    sys.path.insert(0, str(REPO))

from benchcommon import fmt, machine_info, ratio_summary, read_jsonl, summarize  # noqa: E402

from nonstop.coordinator.loop import JobState  # noqa: E402
from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.launch.launcher import run_job  # noqa: E402

BASELINE_SCRIPT = REPO / "benchmarks" / "baseline_torchrun_train.py"
DCP_SCRIPT = REPO / "benchmarks" / "baseline_torchrun_dcp_train.py"  # --mesh: sharded state needs DCP
DEFAULT_OUT = REPO / "benchmarks" / "results" / "mttr.json"
SHARDED_OUT = REPO / "benchmarks" / "results" / "mttr-sharded.json"
QUICK_OUT = REPO / "benchmarks" / "results" / "mttr-quick.json"

CONTENDERS: dict[str, str] = {
    "nonstop_hot": "nonstop (hot spare)",
    "nonstop_cold": "nonstop (no spare)",
    "torchrun_ckpt": "torchrun + torch.save",
}
BASELINE = "torchrun_ckpt"
# The agent's first log lines once it has seen a worker die (SIGTERM to the survivors, the
# failed exit code, the restart decision): whichever arrives first declares the failure.
AGENT_DECLARED = re.compile(r"closing signal|failed \(exitcode|Worker group (FAILED|UNHEALTHY)")


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    nproc: int
    steps: int
    fault_step: int
    fault_rank: int
    ckpt_every: int
    runs: int
    warmup: int
    omp_threads: int
    timeout_s: float
    quick: bool
    batch: int = 8
    mesh: str | None = None  # sharded (nonstop.demo.train_sharded): the baseline is torchrun + DCP


# -- contender 1 and 2: nonstop ---------------------------------------------------------------------
def run_nonstop(opts: Options, *, spares: int, run_dir: Path) -> dict[str, Any]:
    """One nonstop job with a kill of rank ``fault_rank`` at step ``fault_step``."""
    result_file = run_dir / "result.json"
    cfg = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=result_file,
        steps=opts.steps,
        model=opts.model,
        batch=opts.batch,
        nproc_per_node=opts.nproc,
        spares=spares,
        job_dir=run_dir / "job",
        faults=(f"kill:rank={opts.fault_rank},step={opts.fault_step}",),
        extra_env=(("OMP_NUM_THREADS", str(opts.omp_threads)), ("GLOO_SOCKET_IFNAME", "lo")),
        mesh=opts.mesh,
    )
    stop = threading.Event()
    timer = threading.Timer(opts.timeout_s, stop.set)
    timer.daemon = True
    t0 = time.monotonic()
    timer.start()
    try:
        result = run_job(cfg, redirect_output=True, stop=stop)
    finally:
        timer.cancel()
    wall = time.monotonic() - t0
    rec: dict[str, Any] = {"ok": False, "wall_s": wall, "state": str(result.state), "error": result.error}
    out = json.loads(result_file.read_text()) if result_file.exists() else {}
    kills = [f for f in result.failures if f["kind"] == "kill" and f["rank"] == opts.fault_rank]
    if result.state is not JobState.DONE or not kills or not out:
        rec["error"] = result.error or f"job ended {result.state}, kill records: {len(kills)}"
        rec["failures"] = result.failures
        return rec
    f = kills[0]
    rec.update(
        ok=True,
        detect_s=f["detect_s"],
        training_again_s=f["training_again_s"],
        mttr_s=f["mttr_s"],
        lost_steps=f["lost_steps"],
        stages=dict(f["stages"]),
        replacement=f["replacement"],
        restore_step=f["restore_step"],
        replans=f["replans"],
        generation=f["generation"],
        failures_recorded=len(result.failures),
        num_params=out.get("num_params"),
        final_loss=out.get("final_loss"),
        train_seconds_rank0=out.get("seconds"),
    )
    # Anything but one clean recovery is worth a look (a second failure during the recovery).
    rec["anomaly"] = (
        None
        if len(result.failures) == 1 and f["replans"] == 0
        else f"{len(result.failures)} failure records, replans={f['replans']}: "
        + "; ".join(f"{x['kind']} rank {x['rank']} ({x['detail']})" for x in result.failures)
    )
    # Rough step time: rank 0's training seconds without the recovery, per step.
    if out.get("seconds"):
        rec["approx_step_s"] = max(0.0, (out["seconds"] - f["mttr_s"]) / max(1, opts.steps))
    return rec


# -- contender 3: torchrun + torch.save -------------------------------------------------------------
def _kill_leftover_workers(events: list[dict[str, Any]]) -> None:
    """SIGKILL baseline workers (their own sessions, as torchrun starts them) still alive."""
    for pid in {int(e["pid"]) for e in events if "pid" in e}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if BASELINE_SCRIPT.name.encode() in cmdline or DCP_SCRIPT.name.encode() in cmdline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _stop_torchrun(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_baseline(opts: Options, *, run_dir: Path) -> dict[str, Any]:
    """One torchrun job; the same kill, recovered by restarting every worker from the checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    events_path = run_dir / "events.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(opts.nproc),
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        "--log-dir",  # else torchrun leaves a /tmp/torchelastic_* dir behind
        str(run_dir / "torchelastic"),
        str(DCP_SCRIPT if opts.mesh else BASELINE_SCRIPT),
        *(("--mesh", opts.mesh) if opts.mesh else ()),
        "--model",
        opts.model,
        "--batch",
        str(opts.batch),
        "--steps",
        str(opts.steps),
        "--ckpt-every",
        str(opts.ckpt_every),
        "--fault-rank",
        str(opts.fault_rank),
        "--fault-step",
        str(opts.fault_step),
        "--run-dir",
        str(run_dir),
        "--events",
        str(events_path),
    ]
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(opts.omp_threads),
        GLOO_SOCKET_IFNAME="lo",
        LOGLEVEL="INFO",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )

    def reader() -> None:
        assert proc.stdout is not None
        with (run_dir / "torchrun.log").open("w") as log:
            for raw in proc.stdout:
                ts, text = time.time(), raw.decode(errors="replace").rstrip("\n")
                lines.append((ts, text))
                log.write(f"{ts:.6f} {text}\n")

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=opts.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = _stop_torchrun(proc)
    finally:
        if proc.poll() is None:  # interrupted: do not leave the job behind
            _stop_torchrun(proc)
        th.join(timeout=5)
        _kill_leftover_workers(read_jsonl(events_path))
    wall = time.monotonic() - t0
    rec: dict[str, Any] = {"ok": False, "wall_s": wall, "returncode": rc, "timed_out": timed_out}
    rec.update(analyze_baseline(read_jsonl(events_path), lines, opts))
    if rc != 0 and rec.get("ok"):
        rec["ok"] = False
        rec["error"] = f"torchrun exited with {rc}"
    return rec


def analyze_baseline(
    events: list[dict[str, Any]], agent_lines: list[tuple[float, str]], opts: Options
) -> dict[str, Any]:
    """Figures of one baseline run from the workers' events and the agent's timestamped log."""
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        return {"error": "no fault event (the job failed before step K?)"}
    fault = faults[0]["ts"]
    after = [e for e in events if e.get("attempt", 0) >= 1]
    ranks = range(opts.nproc)

    def all_ranks(event: str, pred: Callable[[dict[str, Any]], bool] = lambda e: True) -> float | None:
        """When the last rank of the restarted workers emitted its first ``event``."""
        firsts: list[float] = []
        for r in ranks:
            ts = [float(e["ts"]) for e in after if e["rank"] == r and e["event"] == event and pred(e)]
            if not ts:
                return None
            firsts.append(min(ts))
        return max(firsts)

    declared = next((ts for ts, text in agent_lines if ts >= fault and AGENT_DECLARED.search(text)), None)
    started = all_ranks("start")
    imported = all_ranks("imported")
    built = all_ranks("built")
    pg = all_ranks("pg_ready")
    loaded = all_ranks("ckpt_loaded")
    ddp = all_ranks("ddp_ready")
    first_step = all_ranks("step")
    back_at_k = all_ranks("step", lambda e: e["step"] == opts.fault_step)
    if (
        declared is None
        or started is None
        or imported is None
        or built is None
        or pg is None
        or loaded is None
        or ddp is None
        or first_step is None
    ):
        marks = [declared, started, imported, built, pg, loaded, ddp, first_step]
        return {"error": "the restarted job did not get through its first step", "marks": marks}
    restored = sorted({int(e["step"]) for e in after if e["event"] == "ckpt_loaded"})
    steady = [
        float(e["step_s"])
        for e in events
        if e["event"] == "step" and e.get("attempt", 0) == 0 and e["step"] > 0
    ]
    # torch.save's time, or DCP async_save's stall of the loop (what the training waits for)
    saves = [float(e.get("save_s", e.get("block_s", 0.0))) for e in events if e["event"] == "ckpt_saved"]
    return {
        "ok": True,
        "detect_s": declared - fault,
        "processes_restarted_s": started - fault,
        "ckpt_loaded_s": loaded - fault,
        "training_again_s": ddp - fault,
        "mttr_s": first_step - fault,
        "back_at_fault_step_s": None if back_at_k is None else back_at_k - fault,
        "lost_steps": opts.fault_step - restored[0],
        "restore_step": restored[0] if len(restored) == 1 else restored,
        "stages": {
            "detect": declared - fault,
            "restart": started - declared,  # stop the survivors, re-rendezvous, spawn
            "import": imported - started,
            "build": built - imported,  # model, optimizer (its first use imports torch._dynamo), data
            "process_group": pg - built,
            "load": loaded - pg,
            "ddp": ddp - loaded,
            "first_step": first_step - ddp,
        },
        "step_s_median": statistics.median(steady) if steady else None,
        "ckpt_save_s_median": statistics.median(saves) if saves else None,
    }


# -- the benchmark ----------------------------------------------------------------------------------
def run_one(name: str, opts: Options, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if name == "nonstop_hot":
            return run_nonstop(opts, spares=1, run_dir=run_dir)
        if name == "nonstop_cold":
            return run_nonstop(opts, spares=0, run_dir=run_dir)
        return run_baseline(opts, run_dir=run_dir)
    except Exception as e:  # one broken run must not lose the others
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def summarize_contender(runs: list[dict[str, Any]], step_s: float | None) -> dict[str, Any]:
    ok = [r for r in runs if r.get("ok")]
    keys = ("detect_s", "training_again_s", "mttr_s", "lost_steps")
    out: dict[str, Any] = {k: summarize([r[k] for r in ok]) for k in keys}
    if ok and all("processes_restarted_s" in r for r in ok):
        for k in ("processes_restarted_s", "ckpt_loaded_s"):
            out[k] = summarize([r[k] for r in ok])
    back = []
    for r in ok:
        if r.get("back_at_fault_step_s") is not None:
            back.append(r["back_at_fault_step_s"])
        elif step_s is not None and "processes_restarted_s" not in r:
            r["back_at_fault_step_s"] = r["mttr_s"] + r["lost_steps"] * step_s
            r["back_at_fault_step_estimated"] = True
            back.append(r["back_at_fault_step_s"])
    out["back_at_fault_step_s"] = summarize(back)
    stage_names = list(ok[0]["stages"]) if ok else []
    out["stages"] = {s: summarize([r["stages"][s] for r in ok]) for s in stage_names}
    out["runs_ok"] = len(ok)
    out["runs_failed"] = len(runs) - len(ok)
    out["anomalies"] = [r["anomaly"] for r in ok if r.get("anomaly")]
    return out


def print_table(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"\nMTTR, {w['nproc']} ranks, model {w['model']} ({w['num_params'] or '?'} params), kill rank "
        f"{w['fault_rank']} at step {w['fault_step']} of {w['steps']}, checkpoint every {w['ckpt_every']} "
        f"steps, median step {w['step_s_median'] or float('nan'):.2f}s; seconds, median [min-max] over "
        f"{w['runs']} run(s)"
    )
    head = f"{'contender':<24}{'detect':>20}{'training again':>22}{'MTTR':>22}{'lost':>8}{'back at K':>22}"
    print(head)
    print("-" * len(head))
    for name in CONTENDERS:
        s = report["contenders"][name]["summary"]
        who = report["contenders"][name]["label"]
        print(
            f"{who:<24}{fmt(s['detect_s'], digits=3):>20}{fmt(s['training_again_s']):>22}"
            f"{fmt(s['mttr_s']):>22}{fmt(s['lost_steps'], digits=0):>8}{fmt(s['back_at_fault_step_s']):>22}"
        )
    for name in CONTENDERS:
        s = report["contenders"][name]["summary"]
        stages = "  ".join(f"{k} {v['median']:.3f}" for k, v in s["stages"].items() if v)
        print(f"  {name} stages (median s): {stages}")
        if s["runs_failed"] or s["anomalies"]:
            print(f"  {name}: {s['runs_failed']} failed run(s); anomalies: {s['anomalies'] or 'none'}")
    for key, r in report["ratios"].items():
        if r is not None:
            print(f"MTTR ratio {key}: {r['median']:.1f}x [{r['min']:.1f}-{r['max']:.1f}]")
    for key, r in report["ratios_other"].items():
        if r is not None:
            print(f"ratio {key}: {r['median']:.1f}x [{r['min']:.1f}-{r['max']:.1f}]")
    print(f"benchmark wall time {report['wall_s']:.0f}s -> {report['out']}")


def label(name: str, opts: Options) -> str:
    if name == BASELINE and opts.mesh:
        return "torchrun + DCP async"
    return CONTENDERS[name] + (f" {opts.mesh}" if opts.mesh and name != BASELINE else "")


def run_benchmark(opts: Options, work: Path, out: Path) -> dict[str, Any]:
    t_start = time.monotonic()
    machine = machine_info()
    order = list(CONTENDERS)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    warm: dict[str, list[dict[str, Any]]] = {n: [] for n in order}
    total = opts.warmup + opts.runs
    for i in range(total):
        counted = i >= opts.warmup
        for name in order:
            rec = run_one(name, opts, work / f"round{i}" / name)
            rec["round"] = i
            (runs if counted else warm)[name].append(rec)
            tag = "" if counted else " (warm-up)"
            if rec.get("ok"):
                print(
                    f"round {i}{tag} {name}: MTTR {rec['mttr_s']:.3f}s, detect {rec['detect_s']:.3f}s, "
                    f"lost {rec['lost_steps']}, wall {rec.get('wall_s', 0):.0f}s",
                    flush=True,
                )
            else:
                print(f"round {i}{tag} {name}: FAILED: {rec.get('error')}", flush=True)

    base_ok = [r for r in runs[BASELINE] + warm[BASELINE] if r.get("ok") and r.get("step_s_median")]
    step_s = statistics.median(r["step_s_median"] for r in base_ok) if base_ok else None
    ns_ok = [r for r in runs["nonstop_hot"] + runs["nonstop_cold"] if r.get("ok")]
    num_params = next((r["num_params"] for r in ns_ok if r.get("num_params")), None)
    saves = [r["ckpt_save_s_median"] for r in base_ok if r.get("ckpt_save_s_median") is not None]
    machine["loadavg_at_end"] = list(os.getloadavg())
    # (also fills in nonstop's estimated back_at_fault_step_s, used by the ratios below)
    summaries = {n: summarize_contender(runs[n], step_s) for n in order}
    report: dict[str, Any] = {
        "benchmark": "mttr",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *sys.argv],
        "machine": machine,
        "workload": {
            **asdict(opts),
            "num_params": num_params,
            "batch_per_rank": opts.batch,
            "step_s_median": step_s,
            "step_s_note": "median optimizer-step time of the baseline's ranks before the fault "
            "(steps > 0); nonstop's per-run approx_step_s also includes its per-step snapshot",
            "ckpt_save_s_median": statistics.median(saves) if saves else None,
            "env": {"OMP_NUM_THREADS": opts.omp_threads, "GLOO_SOCKET_IFNAME": "lo"},
        },
        "contenders": {n: {"label": label(n, opts), "summary": summaries[n], "runs": runs[n]} for n in order},
        "warmup": warm,
        "ratios": {
            "torchrun_ckpt/nonstop_hot": ratio_summary(runs[BASELINE], runs["nonstop_hot"]),
            "torchrun_ckpt/nonstop_cold": ratio_summary(runs[BASELINE], runs["nonstop_cold"]),
            "nonstop_cold/nonstop_hot": ratio_summary(runs["nonstop_cold"], runs["nonstop_hot"]),
        },
        # The same per-round ratios for the other two times (MTTR includes one step of ordinary
        # work; "back at K" adds the steps the baseline redoes).
        "ratios_other": {
            f"{key}:{a}/{b}": ratio_summary(runs[a], runs[b], key)
            for key in ("training_again_s", "back_at_fault_step_s")
            for a, b in ((BASELINE, "nonstop_hot"), (BASELINE, "nonstop_cold"))
        },
        "wall_s": time.monotonic() - t_start,
        "out": str(out),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def parse_args(argv: list[str] | None) -> tuple[Options, Path, Path | None, bool]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="demo model preset (default medium; --quick: tiny)")
    ap.add_argument("--nproc", type=int, default=3, help="data-parallel ranks (3-4 intended)")
    ap.add_argument("--fault-step", type=int, default=None, help="K: rank 1 dies at step K (default 15)")
    ap.add_argument("--ckpt-every", type=int, default=None, help="baseline checkpoint period (default 10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per job (default K + 5)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step (both contenders)")
    ap.add_argument("--runs", type=int, default=None, help="counted runs per contender (default 5)")
    ap.add_argument("--warmup", type=int, default=None, help="uncounted rounds first (default 1)")
    ap.add_argument("--omp-threads", type=int, default=None, help="OMP_NUM_THREADS for every worker")
    ap.add_argument("--timeout", type=float, default=None, help="per-job limit, seconds (default 900)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 3 ranks, 1 run, few steps")
    ap.add_argument("--out", type=Path, default=None, help=f"JSON report (default {DEFAULT_OUT})")
    ap.add_argument(
        "--work-dir", type=Path, default=None, help="job dirs and checkpoints (default: a tmp dir)"
    )
    ap.add_argument("--keep-work", action="store_true", help="keep the work dir (logs, events)")
    ap.add_argument(
        "--mesh",
        default=None,
        help="sharded: both contenders lay the model out on this mesh (nonstop.demo.train_sharded: "
        "FSDP2 / HSDP / TP); the baseline is torchrun + DCP async_save (default: DDP, torch.save)",
    )
    a = ap.parse_args(argv)
    q = a.quick
    fault_step = a.fault_step if a.fault_step is not None else (5 if q else 15)
    ckpt_every = a.ckpt_every if a.ckpt_every is not None else (3 if q else 10)
    steps = a.steps if a.steps is not None else fault_step + (2 if q else 5)
    nproc = a.nproc
    opts = Options(
        model=a.model or ("tiny" if q else "medium"),
        nproc=nproc,
        steps=steps,
        fault_step=fault_step,
        fault_rank=1,
        ckpt_every=ckpt_every,
        runs=a.runs if a.runs is not None else (1 if q else 5),
        warmup=a.warmup if a.warmup is not None else (0 if q else 1),
        omp_threads=a.omp_threads or max(1, (os.cpu_count() or 1) // nproc),
        timeout_s=a.timeout if a.timeout is not None else (120.0 if q else 900.0),
        quick=q,
        batch=a.batch,
        mesh=a.mesh,
    )
    if opts.nproc < 2 or opts.runs < 1 or opts.warmup < 0 or opts.ckpt_every < 1:
        ap.error("need --nproc >= 2, --runs >= 1, --warmup >= 0, --ckpt-every >= 1")
    if not 0 < opts.fault_step < opts.steps:
        ap.error(f"--fault-step must be in 1..steps-1 (steps {opts.steps})")
    if opts.fault_step < opts.ckpt_every:
        ap.error("--fault-step must come after the first checkpoint (>= --ckpt-every)")
    if opts.mesh is not None:
        from nonstop.mesh import MeshSpec

        if MeshSpec.parse(opts.mesh).world_size != opts.nproc:
            ap.error(f"--mesh {opts.mesh} must have --nproc ({opts.nproc}) ranks")
    out = a.out or (QUICK_OUT if q else SHARDED_OUT if opts.mesh else DEFAULT_OUT)
    return opts, out, a.work_dir, a.keep_work


def main(argv: list[str] | None = None) -> int:
    opts, out, work_dir, keep = parse_args(argv)
    work = work_dir or Path(tempfile.mkdtemp(prefix="bench-mttr-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_mttr: {asdict(opts)}; work dir {work}", flush=True)
    try:
        report = run_benchmark(opts, work, out.resolve())
    finally:
        if not keep and work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print_table(report)
    failed = sum(c["summary"]["runs_failed"] for c in report["contenders"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
