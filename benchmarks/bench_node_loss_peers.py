"""Node loss, side by side: nonstop versus torchft versus torchrun + DCP, same model, same kill.

What is measured. A data-parallel job of 4 ranks (2 nodes x 2 ranks, every "node" a set of
processes on this machine) trains the demo transformer (``nonstop.demo.model``, preset
``--model``, ``small`` by default) on the demo's data (``nonstop.demo.data``; batch 8 x seq per
rank, AdamW, lr 3e-3: ``nonstop.demo.train``'s workload), gloo on CPU, ``GLOO_SOCKET_IFNAME=lo``
and the same ``OMP_NUM_THREADS`` (cpu_count // 2) for every contender. When a worker of the last
node starts step ``--fault-step``, the whole node is lost: every process of it (its agent, if the
contender has one, and its workers) is SIGKILLed. The contenders, alternating run by run
(nonstop, torchft, torchrun+DCP, nonstop, ...; ``--warmup`` rounds first, not counted):

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

Summaries are median, min and max over the counted runs (``bench_mttr.summarize``). Results go
to ``benchmarks/results/node_loss_peers.json``. A round (one run of each contender, small model,
60 steps) took ~2 minutes on a loaded 2-core VM, so the default full run (1 warm-up + 3 counted
rounds) takes ~8-10 minutes::

    .venv/bin/python benchmarks/bench_node_loss_peers.py            # small model, 1 warm-up + 3 runs each
    .venv/bin/python benchmarks/bench_node_loss_peers.py --quick    # tiny model, 1 run each (smoke)
    .venv/bin/python benchmarks/bench_node_loss_peers.py --contenders nonstop,torchft --runs 5

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
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_mttr import AGENT_DECLARED, fmt, machine_info, ratio_summary, read_jsonl, run_stamp, summarize  # noqa: E402
from bench_node_loss import one_run  # noqa: E402

from nonstop.runtime.gc import processes_of_job  # noqa: E402
from nonstop.runtime.launcher import default_shm_dir  # noqa: E402

TORCHFT_SCRIPT = BENCH / "baseline_torchft_train.py"
DCP_SCRIPT = BENCH / "baseline_torchrun_dcp_train.py"
DEFAULT_OUT = BENCH / "results" / "node_loss_peers.json"
NODE_TAG_ENV = "BENCH_NODE_TAG"  # (as baseline_torchrun_dcp_train.NODE_TAG_ENV: every process of a node)
RUN_TOKEN_ENV = "BENCH_PEERS_RUN"  # every process a run starts: what the clean-up looks for
LIGHTHOUSE_FLAGS = "--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --heartbeat_timeout_ms 1000"
NNODES, NPROC = 2, 2
# torchft's groups train past --steps until this many steps in a row had every group taking part:
# a replacement slower to join than the job is long is still measured.
TORCHFT_MIN_FULL_STEPS = 3
WORLD = NNODES * NPROC

CONTENDERS: dict[str, str] = {
    "nonstop": "nonstop (hot spares)",
    "torchft": "torchft (Lighthouse 1 s)",
    "torchrun_dcp": "torchrun + DCP",
}
FIGURES = ("survivors_resume_s", "replacement_participates_s", "full_participation_s")


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str
    runs: int
    warmup: int
    steps: int
    fault_step: int
    ckpt_every: int
    step_delay: float
    lease_ttl: float
    omp_threads: int
    timeout_s: float
    rdzv_keepalive: tuple[int, int]
    torchft_sync_quorum: bool
    contenders: tuple[str, ...]
    quick: bool
    keep_work: bool = False


# -- processes ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f}s")


def tagged_pids(name: str, value: str) -> list[int]:
    """Processes of this user whose environment holds ``name=value`` (this one excluded)."""
    needle = f"{name}={value}\0".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in Path(entry.path, "environ").read_bytes():
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def kill_run(token: str) -> int:
    """SIGKILL whatever a run started and left alive; returns how many processes that was."""
    pids = tagged_pids(RUN_TOKEN_ENV, token)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def wait_gone(pids: Sequence[int], timeout: float) -> bool:
    """True once none of ``pids`` is alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


class Procs:
    """The processes of one run: started with the run's token, logs in the run dir, all reaped."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.token = uuid.uuid4().hex[:12]
        self.env = {**env, RUN_TOKEN_ENV: self.token}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.threads: list[threading.Thread] = []

    def start(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        *,
        lines: list[tuple[float, str]] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd``; its output goes to ``<name>.log`` (each line timestamped into ``lines``
        when given, through a reader thread)."""
        full_env = {**self.env, **(env or {})}
        log = (self.run_dir / f"{name}.log").open("wb")
        self.logs.append(log)
        out: int | IO[bytes] = subprocess.PIPE if lines is not None else log
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        if lines is not None:

            def reader() -> None:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    ts = time.time()
                    lines.append((ts, raw.decode(errors="replace").rstrip("\n")))
                    log.write(f"{ts:.6f} ".encode() + raw)
                    log.flush()

            th = threading.Thread(target=reader, daemon=True)
            th.start()
            self.threads.append(th)
        return proc

    def close(self) -> int:
        """Kill what is left (by the run's token), reap, close the logs; how many were left."""
        left = kill_run(self.token)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            p.wait()
        for th in self.threads:
            th.join(timeout=5)
        for log in self.logs:
            log.close()
        return left


def wait_exit(procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(0.05)
    return False


def wait_first_death(
    watched: Sequence[subprocess.Popen[bytes]], others: Sequence[subprocess.Popen[bytes]], deadline: float
) -> float | None:
    """Wall time at which one of ``watched`` has exited (2 ms polling); None on timeout or if one of
    ``others`` exits first (the job broke before the fault)."""
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in watched):
            return time.time()
        if any(p.poll() is not None for p in others):
            return None
        time.sleep(0.002)
    return None


def base_env(opts: Options) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(opts.omp_threads),
        GLOO_SOCKET_IFNAME="lo",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def workload_args(opts: Options) -> list[str]:
    return ["--model", opts.model, "--steps", str(opts.steps), "--step-delay", str(opts.step_delay)]


def firsts(
    events: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool], ranks: Sequence[int]
) -> float | None:
    """When the last of ``ranks`` emitted its first event matching ``pred`` (None: one never did)."""
    out = []
    for r in ranks:
        ts = [float(e["ts"]) for e in events if e["rank"] == r and pred(e)]
        if not ts:
            return None
        out.append(min(ts))
    return max(out)


def since(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


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


def run_nonstop(opts: Options, run_dir: Path) -> dict[str, Any]:
    args = argparse.Namespace(
        steps=opts.steps,
        model=opts.model,
        fault_step=opts.fault_step,
        lease_ttl=opts.lease_ttl,
        step_delay=opts.step_delay,
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


# -- contender 2: torchft ----------------------------------------------------------------------------
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


# -- contender 3: torchrun + DCP ---------------------------------------------------------------------
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


# -- the benchmark -----------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Options, Path], dict[str, Any]]] = {
    "nonstop": run_nonstop,
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
    print(
        f"\nNode loss, {NNODES} nodes x {NPROC} ranks, model {c['model']}, node {NNODES - 1} SIGKILLed at "
        f"step {c['fault_step']} of {c['steps']}; seconds from the kill, median [min-max] over "
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
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset, in run order")
    ap.add_argument("--timeout", type=float, default=None, help="per-job limit, seconds (default 600)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 1 run each, no warm-up")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--keep-work", action="store_true", help="keep the work dir (logs, events) for a look")
    a = ap.parse_args(argv)
    q = a.quick
    names = tuple(n for n in a.contenders.split(",") if n)
    if not names or any(n not in CONTENDERS for n in names):
        ap.error(f"--contenders: a subset of {','.join(CONTENDERS)}")
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
