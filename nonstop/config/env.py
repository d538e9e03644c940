"""The one place where environment variables are named and read: :class:`ENV` (what the launcher
hands to every worker), :class:`WorkerEnv` (what a worker learns from them) and the security
settings every process of a job inherits from its launcher (:func:`security_env`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nonstop.config.control import ControlConfig
from nonstop.errors import UsageError

__all__ = [
    "ENV",
    "WorkerEnv",
    "channel_tls_from_env",
    "etcd_tls_paths_from_env",
    "security_env",
    "security_environ",
]


class ENV:
    """Names of the environment variables the launcher hands to every worker."""

    JOB_ID = "NONSTOP_JOB_ID"
    JOB_DIR = "NONSTOP_JOB_DIR"
    CONTROL = "NONSTOP_CONTROL_ADDR"
    SECRET_FILE = "NONSTOP_SECRET_FILE"
    ROLE = "NONSTOP_ROLE"
    SPAWN_ID = "NONSTOP_SPAWN_ID"
    SHM_DIR = "NONSTOP_SHM_DIR"
    FAULTS = "NONSTOP_FAULTS"
    HEARTBEAT_INTERVAL = "NONSTOP_HEARTBEAT_INTERVAL_S"
    REBUILD_TIMEOUT = "NONSTOP_REBUILD_TIMEOUT_S"
    SNAPSHOT = "NONSTOP_SNAPSHOT"
    NODE = "NONSTOP_NODE"
    AGENT_PID = "NONSTOP_AGENT_PID"
    SLOTS = "NONSTOP_SNAPSHOT_SLOTS"
    SNAPSHOT_EVERY = "NONSTOP_SNAPSHOT_EVERY"  # --snapshot-every: steps between in-memory snapshots
    SNAPSHOT_BUDGET = "NONSTOP_SNAPSHOT_BUDGET"  # --snapshot-budget: > 0, the interval is tuned to it
    SECRET = "NONSTOP_SECRET"  # alternative to a secret file for node agents
    RECONNECT = "NONSTOP_RECONNECT_S"  # how long a worker retries a lost coordinator (0: exit at once)
    MESH = "NONSTOP_MESH"  # the job's device mesh (--mesh), for Session.run(build=...)
    ELASTIC = "NONSTOP_ELASTIC"  # "1": the world size may change (exact gradient mean)
    NODE_COPY = "NONSTOP_NODE_COPY"  # N > 0: a node keeps its ranks' alike state once per copy group
    KEEP_GROUPS = "NONSTOP_KEEP_GROUPS"  # "0": build every mesh group again each generation
    # Security settings every process of a job inherits from its launcher (security_env): a
    # channel's listener and clients (control/channel.py, listener.py) and the etcd client
    # (control/store.py open_store) read them where no caller passes them explicitly.
    TLS = "NONSTOP_TLS"  # "1": channels use TLS (--tls); "0": never; unset: a client follows its listener
    ETCD_CA = "NONSTOP_ETCD_CA"  # --etcd-ca, --etcd-cert, --etcd-key (etcds://)
    ETCD_CERT = "NONSTOP_ETCD_CERT"
    ETCD_KEY = "NONSTOP_ETCD_KEY"


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What a worker process learns from its environment (set by the agent)."""

    job_id: str
    job_dir: Path
    control_addr: tuple[str, int]
    secret: bytes
    role: str
    spawn_id: int
    shm_dir: Path
    faults_json: str
    heartbeat_interval_s: float = 0.1
    rebuild_timeout_s: float = 30.0
    snapshot: str = "overlapped"
    snapshot_every: int = 1  # the job's --snapshot-every
    snapshot_budget: float = 0.0  # the job's --snapshot-budget (> 0: the coordinator tunes the interval)
    node: str = "0"
    agent_pid: int | None = None
    num_slots: int = 2
    reconnect_s: float = 0.0  # > 0: a lost coordinator is waited for (it restarts), not fatal
    mesh: str | None = None  # the job's --mesh
    elastic: bool = False  # --min-world-size below the world size: the gradient mean is exact
    keep_groups: bool = True  # the job's keep_groups
    node_copy: bool = False  # --snapshot-copies node: a DDP (or HSDP) job's alike state once per node

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if environ is None else environ)
        missing = [v for v in (ENV.JOB_ID, ENV.CONTROL, ENV.SECRET_FILE) if v not in env]
        if missing:
            raise UsageError(
                f"not running under a nonstop agent ({', '.join(missing)} unset): "
                "start the script with `nonstop run SCRIPT`"
            )
        host, _, port = env[ENV.CONTROL].rpartition(":")
        secret = Path(env[ENV.SECRET_FILE]).read_bytes().strip()
        return cls(
            job_id=env[ENV.JOB_ID],
            job_dir=Path(env.get(ENV.JOB_DIR, ".")),
            control_addr=(host, int(port)),
            secret=secret,
            role=env.get(ENV.ROLE, "worker"),
            spawn_id=int(env.get(ENV.SPAWN_ID, "0")),
            shm_dir=Path(env.get(ENV.SHM_DIR, "/dev/shm")),
            faults_json=env.get(ENV.FAULTS, "[]"),
            heartbeat_interval_s=float(env.get(ENV.HEARTBEAT_INTERVAL, "0.1")),
            rebuild_timeout_s=float(env.get(ENV.REBUILD_TIMEOUT, "30")),
            snapshot=env.get(ENV.SNAPSHOT, "overlapped"),
            snapshot_every=_snapshot_every(env.get(ENV.SNAPSHOT_EVERY, "1")),
            snapshot_budget=float(env.get(ENV.SNAPSHOT_BUDGET, "0")),
            node=env.get(ENV.NODE, "0"),
            agent_pid=int(env[ENV.AGENT_PID]) if ENV.AGENT_PID in env else None,
            num_slots=int(env.get(ENV.SLOTS, "2")),
            reconnect_s=float(env.get(ENV.RECONNECT, "0")),
            mesh=env.get(ENV.MESH) or None,
            elastic=env.get(ENV.ELASTIC) == "1",
            keep_groups=env.get(ENV.KEEP_GROUPS, "1") != "0",
            node_copy=env.get(ENV.NODE_COPY, "0") not in ("", "0"),
        )


def _snapshot_every(raw: str) -> int:
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        raise UsageError(f"{ENV.SNAPSHOT_EVERY}={raw!r}: must be a whole number of steps >= 1")
    return k


def security_env(control: ControlConfig) -> dict[str, str]:
    """The environment a job's processes inherit for its TLS settings (``ENV.TLS``, ``ENV.ETCD_*``)."""
    env = {ENV.TLS: "1"} if control.tls else {}
    c = control
    files = ((ENV.ETCD_CA, c.etcd_ca), (ENV.ETCD_CERT, c.etcd_cert), (ENV.ETCD_KEY, c.etcd_key))
    for name, path in files:
        if path is not None:
            env[name] = str(path.resolve())
    return env


@contextlib.contextmanager
def security_environ(control: ControlConfig) -> Iterator[None]:
    """:func:`security_env` in ``os.environ`` while the block runs (the job's processes and
    threads inherit it), then the environment as it was."""
    env = security_env(control)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def channel_tls_from_env() -> bool | None:
    """This process's channel TLS setting (``ENV.TLS``): True, False, or None (unset: follow)."""
    value = os.environ.get(ENV.TLS, "")
    return None if value == "" else value == "1"


def etcd_tls_paths_from_env() -> tuple[Path, Path | None, Path | None] | None:
    """``ENV.ETCD_CA``/``CERT``/``KEY`` (None without a CA)."""
    ca = os.environ.get(ENV.ETCD_CA)
    if not ca:
        return None
    cert, key = os.environ.get(ENV.ETCD_CERT), os.environ.get(ENV.ETCD_KEY)
    return Path(ca), Path(cert) if cert else None, Path(key) if key else None
