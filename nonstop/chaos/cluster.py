"""The machinery a chaos soak runs its jobs on, all on this machine: a real etcd (``scripts/etcd.sh``)
holding the jobs' state, network namespaces for the nodes other than node 0 (where root), and one
job's nodes as separate ``nonstop run --node-rank K`` processes that the driver can kill, cut off
and start again.

Node 0 is a subprocess too (its launcher starts the coordinator as its own process: store mode), so
the driver holds nothing of the job: every process and segment it checks for at the end is the
job's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import nonstop
from nonstop.config import JobConfig
from nonstop.errors import JobFailedError
from nonstop.launch.jobfiles import JOB_INFO
from nonstop.launch.local_nodes import node_command

__all__ = ["Episode", "Etcd", "Netns", "free_port"]

ETCD_SH = Path(nonstop.__file__).resolve().parent.parent / "scripts" / "etcd.sh"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Netns:
    """Nodes ``1..n-1`` each in a network namespace joined to a bridge in the root namespace
    (where node 0 and etcd live); a node's link can be cut and restored (a partition)."""

    nnodes: int
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    up: bool = False

    @property
    def subnet(self) -> str:  # one per soak (by its pid), so that two soaks at once do not clash
        return f"10.233.{int(self.tag) % 250 + 1}"

    @property
    def bridge(self) -> str:
        return f"csbr{self.tag}"

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def ns(self, node: int) -> str:
        return f"nonstop-chaos-{self.tag}-{node}"

    def host_side(self, node: int) -> str:
        return f"csh{node}-{self.tag}"

    def inner(self, node: int) -> str:
        return f"csi{node}-{self.tag}"

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None: they can)."""
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        return None

    def setup(self) -> None:
        self.up = True  # teardown removes whatever part was made
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.addr(0)}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for k in range(1, self.nnodes):
            _ip("netns", "add", self.ns(k))
            _ip("link", "add", self.host_side(k), "type", "veth", "peer", "name", self.inner(k))
            _ip("link", "set", self.inner(k), "netns", self.ns(k))
            _ip("link", "set", self.host_side(k), "master", self.bridge, "up")
            _ip("-n", self.ns(k), "addr", "add", f"{self.addr(k)}/24", "dev", self.inner(k))
            _ip("-n", self.ns(k), "link", "set", self.inner(k), "up")
            _ip("-n", self.ns(k), "link", "set", "lo", "up")

    def cut(self, node: int) -> None:
        _ip("link", "set", self.host_side(node), "down")

    def heal(self, node: int) -> None:
        _ip("link", "set", self.host_side(node), "up")

    def wrap(self, node: int, cmd: list[str]) -> list[str]:
        if node == 0:
            return cmd
        return ["ip", "netns", "exec", self.ns(node), "env", f"GLOO_SOCKET_IFNAME={self.inner(node)}", *cmd]

    def teardown(self) -> None:
        if not self.up:
            return
        for k in range(1, self.nnodes):
            subprocess.run(["ip", "netns", "del", self.ns(k)], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", self.host_side(k)], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        self.up = False


@dataclass
class Etcd:
    """A real single-member etcd started by ``scripts/etcd.sh`` on ``host`` (auth on, its root
    password derived from the secret in ``secret_file``)."""

    state: Path
    host: str = "127.0.0.1"
    port: int = 0
    secret_file: Path = Path()
    pid: int = 0

    @staticmethod
    def unavailable() -> str | None:
        if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
            return "etcd/etcdctl are not installed (scripts/etcd.sh install)"
        if not ETCD_SH.exists():
            return f"{ETCD_SH} is missing (a source checkout has it)"
        return None

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    def start(self) -> None:
        """Start a fresh etcd (any data of an earlier soak in ``state`` is deleted first)."""
        shutil.rmtree(self.state, ignore_errors=True)
        self.state.mkdir(parents=True)
        if not self.secret_file.name:
            self.secret_file = self.state / "secret"
            self.secret_file.write_text(secrets.token_hex(16) + "\n")
            self.secret_file.chmod(0o600)
        self.port = self.port or free_port(self.host)
        args = [str(self.state / "etcd"), str(self.port), str(self.secret_file), str(free_port(self.host))]
        proc = subprocess.run(
            [str(ETCD_SH), "start", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "ETCD_HOST": self.host},
        )
        if proc.returncode != 0:
            raise JobFailedError(f"scripts/etcd.sh start failed: {proc.stderr.strip()}")
        self.pid = int(proc.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGCONT) if _alive(self.pid) else None
            subprocess.run([str(ETCD_SH), "stop", str(self.state / "etcd")], check=False, timeout=30)
            self.pid = 0


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (R, S, D, T, Z, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


class Episode:
    """One job of the soak: its nodes as ``nonstop run --node-rank K`` processes."""

    def __init__(
        self,
        config: JobConfig,
        *,
        coordinator: str,
        node0_args: list[str],
        all_args: list[str],
        netns: Netns | None,
    ) -> None:
        self.config = config
        self.job_dir = config.job_dir
        self.coordinator = coordinator
        self.node0_args, self.all_args = node0_args, all_args
        self.netns = netns
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.all_procs: list[subprocess.Popen[bytes]] = []
        self.starts: dict[int, int] = {}

    def command(self, node: int) -> list[str]:
        cmd = node_command(self.config, node, self.coordinator)
        script = 2 if self.config.script.startswith("-m ") else 1  # `-m MODULE` or `SCRIPT`
        at = len(cmd) - len(self.config.script_args) - script
        extra = self.all_args + (self.node0_args if node == 0 else [])
        cmd[at:at] = extra
        return self.netns.wrap(node, cmd) if self.netns is not None else cmd

    def start_node(self, node: int) -> subprocess.Popen[bytes]:
        logs = self.job_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        n = self.starts.get(node, 0)
        self.starts[node] = n + 1
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.netns is not None and node == 0:
            env["GLOO_SOCKET_IFNAME"] = self.netns.bridge
        with (logs / f"node-{node}{f'-{n}' if n else ''}.log").open("ab") as log:
            proc = subprocess.Popen(
                self.command(node), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self.procs[node] = proc
        self.all_procs.append(proc)
        return proc

    def start(self, timeout: float) -> None:
        self.job_dir.mkdir(parents=True, exist_ok=True)
        info = self.job_dir / JOB_INFO
        info.unlink(missing_ok=True)
        self.start_node(0)
        deadline = time.monotonic() + timeout
        while not info.exists():
            if self.procs[0].poll() is not None:
                raise JobFailedError(f"node 0 exited ({self.procs[0].returncode}) before it started the job")
            if time.monotonic() > deadline:
                raise JobFailedError(f"node 0 did not start its coordinator within {timeout:g}s")
            time.sleep(0.05)
        for k in range(1, self.config.nnodes):
            self.start_node(k)

    def coordinator_pid(self) -> int | None:
        try:
            return int(json.loads((self.job_dir / JOB_INFO).read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def kill_node(self, node: int) -> int:
        """SIGKILL node ``node``'s agent process; its workers and spares die with it
        (``PR_SET_PDEATHSIG``). Returns the agent's pid."""
        proc = self.procs[node]  # `ip netns exec` and `env` exec: the same pid
        pid = proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return pid

    def node_running(self, node: int) -> bool:
        return self.procs[node].poll() is None

    def wait_end(self, timeout: float) -> int | None:
        """Node 0's exit status once the job ended, None if it did not within ``timeout``."""
        try:
            return self.procs[0].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_all(self, timeout: float) -> list[int]:
        """Wait for every node process; return the pids still running after ``timeout``."""
        deadline = time.monotonic() + timeout
        left = []
        for p in self.all_procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                left.append(p.pid)
        return left

    def stop(self) -> None:
        """Stop every node process still running (SIGTERM, then SIGKILL)."""
        for p in self.all_procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.all_procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
