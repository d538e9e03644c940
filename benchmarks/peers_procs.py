"""What every contender of ``bench_node_loss_peers.py`` shares: its options, the 2 x 2 layout, and
the processes of one run (started with a run token in their environment, so that whatever a run
leaves behind is found and killed; logs in the run dir; reaped).

Not a benchmark itself: imported by ``bench_node_loss_peers.py`` and its contender modules
(``peers_torchft.py``, ``peers_torchrun.py``), with ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
NODE_TAG_ENV = "BENCH_NODE_TAG"  # (as baseline_torchrun_dcp_train.NODE_TAG_ENV: every process of a node)
RUN_TOKEN_ENV = "BENCH_PEERS_RUN"  # every process a run starts: what the clean-up looks for
NNODES, NPROC = 2, 2
WORLD = NNODES * NPROC


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
    # sharded (``replicate=2,shard=2``: HSDP, a replica group per node): nonstop runs
    # nonstop.demo.train_sharded, torchrun + DCP the same layout; torchft has no such contender here
    mesh: str | None = None


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
    """The workload's flags, the same for every contender's script (``--mesh``: the sharded one)."""
    mesh = ("--mesh", opts.mesh) if opts.mesh else ()
    return ["--model", opts.model, "--steps", str(opts.steps), "--step-delay", str(opts.step_delay), *mesh]


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
