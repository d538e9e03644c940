"""torchft, a contender of ``bench_node_loss_peers.py``: one replica group per node under one
Lighthouse; a replacement group is launched the moment the lost node's processes die, and heals
from a survivor (the benchmark's docstring has the details and the fairness notes)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchcommon import read_jsonl
from peers_procs import (
    BENCH,
    NNODES,
    NODE_TAG_ENV,
    NPROC,
    WORLD,
    Options,
    Procs,
    base_env,
    firsts,
    free_port,
    since,
    wait_exit,
    wait_first_death,
    wait_gone,
    wait_listening,
    workload_args,
)

TORCHFT_SCRIPT = BENCH / "baseline_torchft_train.py"
LIGHTHOUSE_FLAGS = "--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000"
# torchft's groups train past --steps until this many steps in a row had every group taking part:
# a replacement slower to join than the job is long is still measured.
TORCHFT_MIN_FULL_STEPS = 3


def torchft_node(
    procs: Procs, opts: Options, *, group: int, tag: str, fault_step: int, events: Path
) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    out = []
    for r in range(NPROC):
        cmd = [
            sys.executable,
            "-u",
            str(TORCHFT_SCRIPT),
            *workload_args(opts),
            "--replica-group",
            str(group),
            "--num-groups",
            str(NNODES),
            "--fault-step",
            str(fault_step),
            "--min-full-steps",
            str(TORCHFT_MIN_FULL_STEPS),
            "--run-dir",
            str(procs.run_dir),
            "--events",
            str(events),
        ]
        if opts.torchft_sync_quorum:
            cmd.append("--sync-quorum")
        env = {
            NODE_TAG_ENV: f"{procs.token}-{tag}",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": str(NPROC),
        }
        out.append(procs.start(f"{tag}-r{r}", cmd, env))
    return out


def start_lighthouse(procs: Procs) -> subprocess.Popen[bytes]:
    """torchft's Lighthouse (:data:`LIGHTHOUSE_FLAGS`) on a free local port, listening; the
    processes ``procs`` starts next find it through ``TORCHFT_LIGHTHOUSE``."""
    port = free_port()
    lighthouse = procs.start(
        "lighthouse",
        [
            str(Path(sys.executable).parent / "torchft_lighthouse"),
            *LIGHTHOUSE_FLAGS.split(),
            "--bind",
            f"127.0.0.1:{port}",
        ],
    )
    wait_listening(port, lighthouse, 30)
    procs.env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
    return lighthouse


def run_torchft(opts: Options, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    events_path = run_dir / "events.jsonl"
    procs = Procs(run_dir, base_env(opts))
    rec: dict[str, Any] = {"ok": False}
    t_start = time.monotonic()
    deadline = t_start + opts.timeout_s
    lighthouse: subprocess.Popen[bytes] | None = None
    try:
        lighthouse = start_lighthouse(procs)
        nodes = {
            g: torchft_node(
                procs,
                opts,
                group=g,
                tag=f"n{g}",
                fault_step=opts.fault_step if g == NNODES - 1 else -1,
                events=events_path,
            )
            for g in range(NNODES)
        }
        lost = nodes[NNODES - 1]
        survivors = [p for g in range(NNODES - 1) for p in nodes[g]]
        died = wait_first_death(lost, [*survivors, lighthouse], deadline)
        if died is None:
            rec["error"] = "the lost node did not die (timeout, or the job broke first)"
            return rec
        repl = torchft_node(
            procs, opts, group=NNODES - 1, tag=f"n{NNODES - 1}r", fault_step=-1, events=events_path
        )
        launched = time.time()
        rec["node_dead_confirmed"] = wait_gone([p.pid for p in lost], 5)
        rec["lost_node_returncodes"] = [p.wait() for p in lost]
        finished = wait_exit([*survivors, *repl], deadline)
        rec["timed_out"] = not finished
        rec["returncodes"] = [p.poll() for p in [*survivors, *repl]]
        rec.update(analyze_torchft(read_jsonl(events_path), opts, launched))
        if rec.get("ok") and (not finished or any(rc != 0 for rc in rec["returncodes"])):
            rec["ok"] = False
            rec["error"] = f"workers did not all exit 0: {rec['returncodes']}"
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        if lighthouse is not None and lighthouse.poll() is None:
            lighthouse.terminate()
            wait_exit([lighthouse], time.monotonic() + 5)
        rec["left_behind"] = procs.close()
        rec["wall_s"] = time.monotonic() - t_start
    return rec


def analyze_torchft(events: list[dict[str, Any]], opts: Options, launched: float) -> dict[str, Any]:
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        return {"ok": False, "error": "no fault event"}
    fault = float(faults[0]["ts"])
    lost_group = NNODES - 1
    lost_ranks = [lost_group * NPROC + r for r in range(NPROC)]
    surv_ranks = [r for r in range(WORLD) if r not in lost_ranks]
    after = [e for e in events if float(e["ts"]) > fault]
    new = [e for e in after if str(e.get("node", "")).endswith(f"-n{lost_group}r")]
    old = [e for e in after if not str(e.get("node", "")).endswith(f"-n{lost_group}r")]
    steps_after = [e for e in after if e["event"] == "step"]

    def committed(e: dict[str, Any]) -> bool:
        return e["event"] == "step" and bool(e["committed"])

    def full(e: dict[str, Any]) -> bool:
        return committed(e) and bool(e["participating"]) and int(e["participants"]) == NNODES

    fault_step = int(faults[0]["step"])
    # A step the lost node had already voted for may still commit just after the kill: resuming
    # is committing the step the lost node never got to, or a later one.
    surv = firsts(old, lambda e: committed(e) and int(e["step"]) >= fault_step, surv_ranks)
    repl_first = firsts(new, lambda e: e["event"] == "step", lost_ranks)
    repl = firsts(new, full, lost_ranks)
    all_full = firsts(old, full, surv_ranks)
    full_at = None if all_full is None or repl is None else max(all_full, repl)
    before = [e for e in events if committed(e) and float(e["ts"]) <= fault]
    # Lost steps: steps a rank commits again after the fault (survivors never roll back and the
    # replacement heals to the newest step, but count them rather than assume it).
    done = {r: {int(e["step"]) for e in before if e["rank"] == r} for r in range(WORLD)}
    redone = [len(done[r] & {int(e["step"]) for e in after if committed(e) and e["rank"] == r}) for r in done]
    steady = [float(e["step_s"]) for e in before if int(e["step"]) > 0]
    stages = {
        "launch": launched - fault,
        "imported": firsts(new, lambda e: e["event"] == "imported", lost_ranks),
        "built": firsts(new, lambda e: e["event"] == "built", lost_ranks),
        "manager_ready": firsts(new, lambda e: e["event"] == "manager_ready", lost_ranks),
        "first_step_healing": repl_first,
        "first_step_participating": repl,
    }
    out: dict[str, Any] = {
        "ok": surv is not None and full_at is not None,
        "fault_step": fault_step,
        "replacement_launched_s": launched - fault,
        "survivors_resume_s": since(surv, fault),
        "replacement_first_step_s": since(repl_first, fault),
        "replacement_participates_s": since(repl, fault),
        "full_participation_s": since(full_at, fault),
        "lost_steps": max(redone),
        "redone_steps_per_rank": redone,
        "survivors_uncommitted_steps_after_fault": sum(
            1 for e in steps_after if e["rank"] in surv_ranks and not e["committed"]
        ),
        "stages_from_fault": {k: (v if k == "launch" else since(v, fault)) for k, v in stages.items()},
        "step_s_median": statistics.median(steady) if steady else None,
        "quorum_sizes_after_fault": sorted({int(e["participants"]) for e in steps_after}),
    }
    if not out["ok"]:
        out["error"] = (
            "survivors never committed again"
            if surv is None
            else "the replacement never took part in a committed step (raise --steps?)"
        )
    return out
