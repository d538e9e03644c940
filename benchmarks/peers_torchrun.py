"""torchrun + DCP, a contender of ``bench_node_loss_peers.py``: two torchrun agents (c10d
rendezvous hosted by node 0's), ``torch.distributed.checkpoint.async_save`` every ``--ckpt-every``
steps; the lost node's agent is replaced the moment it dies, node 0's agent restarts its workers,
and every rank loads the newest complete checkpoint (resharded by DCP where the job is sharded)."""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_mttr import AGENT_DECLARED
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

DCP_SCRIPT = BENCH / "baseline_torchrun_dcp_train.py"


def run_torchrun_dcp(opts: Options, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    events_path = run_dir / "events.jsonl"
    env = base_env(opts)
    # As bench_mttr: with the shared store, restarted workers of torch 2.13 can read the previous
    # attempt's gloo addresses (pytorch/pytorch#135712).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["LOGLEVEL"] = "INFO"
    procs = Procs(run_dir, env)
    port = free_port()
    interval, attempts = opts.rdzv_keepalive
    rec: dict[str, Any] = {"ok": False}
    t_start = time.monotonic()
    deadline = t_start + opts.timeout_s
    lines0: list[tuple[float, str]] = []

    def agent(
        tag: str, fault_step: int, lines: list[tuple[float, str]] | None = None
    ) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(NNODES),
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            procs.token,
            "--rdzv-conf",
            f"keep_alive_interval={interval},keep_alive_max_attempt={attempts}",
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.1",
            "--log-dir",  # else torchrun leaves a /tmp/torchelastic_* dir behind
            str(run_dir / f"torchelastic-{tag}"),
            str(DCP_SCRIPT),
            *workload_args(opts),
            "--ckpt-every",
            str(opts.ckpt_every),
            "--fault-step",
            str(fault_step),
            "--run-dir",
            str(run_dir),
            "--events",
            str(events_path),
        ]
        return procs.start(f"agent-{tag}", cmd, {NODE_TAG_ENV: f"{procs.token}-{tag}"}, lines=lines)

    try:
        a0 = agent("n0", -1, lines0)
        wait_listening(port, a0, 60)  # node 0's agent hosts the rendezvous store
        a1 = agent("n1", opts.fault_step)
        died = wait_first_death([a1], [a0], deadline)
        if died is None:
            rec["error"] = "node 1's agent did not die (timeout, or the job broke first)"
            return rec
        a1r = agent("n1r", -1)
        launched = time.time()
        dead_pids = [
            int(e["pid"])
            for e in read_jsonl(events_path)
            if e["event"] == "start" and e.get("node", "").endswith("-n1")
        ]
        rec["node_dead_confirmed"] = wait_gone(dead_pids, 5) and a1.wait() == -signal.SIGKILL
        finished = wait_exit([a0, a1r], deadline)
        rec["timed_out"] = not finished
        rec["returncodes"] = [a0.poll(), a1r.poll()]
        rec.update(analyze_torchrun(read_jsonl(events_path), lines0, opts, launched))
        if rec.get("ok") and (not finished or any(rc != 0 for rc in rec["returncodes"])):
            rec["ok"] = False
            rec["error"] = f"agents did not both exit 0: {rec['returncodes']}"
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in procs.procs:  # torchrun stops its workers on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        wait_exit(procs.procs, time.monotonic() + 10)
        rec["left_behind"] = procs.close()
        rec["wall_s"] = time.monotonic() - t_start
    return rec


def analyze_torchrun(
    events: list[dict[str, Any]], agent_lines: list[tuple[float, str]], opts: Options, launched: float
) -> dict[str, Any]:
    faults = [e for e in events if e["event"] == "fault"]
    if not faults:
        return {"ok": False, "error": "no fault event"}
    fault = float(faults[0]["ts"])
    # Processes started after the fault: none of their events (but "start", whose /proc-based time
    # is only as good as the whole-second boot time) comes before it.
    old_pids = {e["pid"] for e in events if e["event"] != "start" and float(e["ts"]) <= fault}
    new = [e for e in events if e["pid"] not in old_pids and e["event"] != "start"]
    new_pids = {e["pid"] for e in new}
    ranks = range(WORLD)
    node0 = sorted({e["rank"] for e in new if str(e.get("node", "")).endswith("-n0")})
    repl_ranks = sorted({e["rank"] for e in new if str(e.get("node", "")).endswith("-n1r")})

    def ev(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e["event"] == name

    marks = {
        name: firsts(new, ev(name), ranks)
        for name in ("imported", "built", "pg_ready", "ckpt_loaded", "ddp_ready", "step")
    }
    declared = next((ts for ts, text in agent_lines if ts >= fault and AGENT_DECLARED.search(text)), None)
    rdzv = next((ts for ts, text in agent_lines if ts >= fault and "Rendezvous complete" in text), None)
    restored = sorted({int(e["step"]) for e in new if e["event"] == "ckpt_loaded"})
    back = firsts(new, lambda e: e["event"] == "step" and e["step"] == opts.fault_step, ranks)
    steady = [
        float(e["step_s"])
        for e in events
        if e["event"] == "step" and float(e["ts"]) <= fault and e["pid"] not in new_pids and e["step"] > 0
    ]
    blocks = [float(e["block_s"]) for e in events if e["event"] == "ckpt_saved"]
    # The newest checkpoint rank 0 (DCP's coordinator, which writes .metadata last) had completed
    # when the node died: the one a restart can find (a save still in flight is lost with the node).
    done_before = [
        int(e["step"])
        for e in events
        if e["event"] == "ckpt_done" and e["rank"] == 0 and not e.get("error") and float(e["ts"]) <= fault
    ]
    full = marks["step"]
    out: dict[str, Any] = {
        "ok": full is not None and len(restored) == 1 and len(node0) == NPROC and len(repl_ranks) == NPROC,
        "fault_step": int(faults[0]["step"]),
        "replacement_launched_s": launched - fault,
        "detect_s": since(declared, fault),
        "survivors_resume_s": since(firsts(new, ev("step"), node0), fault) if node0 else None,
        "replacement_participates_s": since(firsts(new, ev("step"), repl_ranks), fault)
        if repl_ranks
        else None,
        "full_participation_s": since(full, fault),
        "training_again_s": since(marks["ddp_ready"], fault),
        "back_at_fault_step_s": since(back, fault),
        "lost_steps": opts.fault_step - restored[0] if len(restored) == 1 else None,
        "restore_step": restored,
        "newest_ckpt_done_before_fault": max(done_before, default=0),
        "stages_from_fault": {
            "detect": since(declared, fault),
            "rendezvous": since(rdzv, fault),  # node 0's agent and the replacement's, a new round
            **{k: since(v, fault) for k, v in marks.items()},
        },
        "step_s_median": statistics.median(steady) if steady else None,
        "ckpt_block_s_median": statistics.median(blocks) if blocks else None,
    }
    if not out["ok"]:
        out["error"] = (
            f"the restarted job did not get every rank through a step (marks {marks}, restored {restored})"
        )
    return out
