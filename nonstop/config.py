"""Small typed configs and the one place where environment variables are read.

Each component owns a frozen keyword-only dataclass; the CLI composes them.
Validation happens in ``__post_init__`` so a bad value fails at start, not at
step 10,000.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.policy.cadence import DEFAULT_BUDGET, MAX_AGE_S
from nonstop.policy.decisions import DetectorConfig  # the detection policy's own config
from nonstop.policy.straggler import StragglerConfig  # issue 21: fail-slow detection and action
from nonstop.policy.survivors import SurvivorMode  # the elastic policy's own closed set

__all__ = [
    "DetectorConfig",
    "JobConfig",
    "ProbeConfig",
    "ShrinkBatch",
    "SnapshotCopies",
    "SnapshotMode",
    "SurvivorMode",
    "SwapTransfer",
    "WorkerEnv",
    "ENV",
    "SNAPSHOT_COPIES",
    "SNAPSHOT_MODES",
    "SWAP_TRANSFERS",
    "channel_tls_from_env",
    "etcd_tls_paths_from_env",
    "job_config_from_json",
    "job_config_to_json",
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


class SnapshotMode(enum.StrEnum):
    """``--snapshot``: how each step's state is captured."""

    OVERLAPPED = "overlapped"  # copied out while the next step runs
    SYNC = "sync"  # copied out before the next step starts
    OFF = "off"  # not captured


class SnapshotCopies(enum.StrEnum):
    """``--snapshot-copies``: where the state a node's ranks hold alike lives in its memory tier."""

    NODE = "node"  # one copy per node (snapshot/nodecopy.py)
    RANK = "rank"  # every rank its own whole copy


class SwapTransfer(enum.StrEnum):
    """``--swap-transfer``: how a live migration's swap brings the boundary step to the joiner
    (policy/migration.py: swap_as_delta)."""

    AUTO = "auto"  # a delta when the catch-up measured deltas faster
    DELTA = "delta"
    WHOLE = "whole"


class ShrinkBatch(enum.StrEnum):
    """``--shrink-batch``: what a shrunk job trains on (policy/elastic.py: play_shards)."""

    KEEP = "keep"  # the global batch: the lost ranks' shards played by the others (bitwise)
    DROP = "drop"  # the lost ranks' shares dropped until the job grows back (torchft's)


# each closed set's values, in order: the flags' choices (and so their help and errors)
SNAPSHOT_MODES = tuple(m.value for m in SnapshotMode)
SNAPSHOT_COPIES = tuple(m.value for m in SnapshotCopies)
SWAP_TRANSFERS = tuple(m.value for m in SwapTransfer)
SURVIVOR_MODES = tuple(m.value for m in SurvivorMode)  # policy/survivors.py
SHRINK_BATCHES = tuple(m.value for m in ShrinkBatch)

_E = TypeVar("_E", bound=enum.StrEnum)


def member(kind: type[_E], value: object, flag: str) -> _E:
    """``value`` (a member or its string, as a flag, a TOML file or JSON gives it) as a member of
    ``kind``; UsageError (one line naming ``flag`` and the values it takes) when it is none."""
    try:
        return kind(str(value))
    except ValueError:
        raise UsageError(f"{flag} must be one of {', '.join(kind)} (got {value!r})") from None


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """``period_s``: seconds between two rounds of probes (0: no probes at all); ``command``:
    the ``--health-cmd`` (None: none), run at most ``timeout_s`` seconds. A bad value raises
    :class:`~nonstop.errors.UsageError` with one line."""

    period_s: float = 10.0
    command: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s >= 0):
            raise UsageError(f"--probe-period must be >= 0 seconds (got {self.period_s}); 0 turns probes off")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise UsageError(f"--health-timeout must be > 0 seconds (got {self.timeout_s})")
        if self.command is not None:
            try:
                argv = shlex.split(self.command)
            except ValueError as e:
                raise UsageError(f"--health-cmd {self.command!r}: {e}") from None
            if not argv:
                raise UsageError("--health-cmd is empty: give the command to run (e.g. /usr/local/bin/check)")
            if self.period_s == 0:
                raise UsageError("--health-cmd needs --probe-period > 0 (0 turns probes off)")

    @property
    def enabled(self) -> bool:
        return self.period_s > 0


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """Everything ``nonstop run`` needs to start a single-node job."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    spares: int = 0
    job_dir: Path = field(default_factory=lambda: Path(".nonstop") / "job")
    host: str = "127.0.0.1"
    port: int = 0
    max_restarts: int = 10
    rebuild_timeout_s: float = 30.0
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    faults: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    snapshot: SnapshotMode = SnapshotMode.OVERLAPPED
    # steps between in-memory snapshots (1: every step). K > 1 trades the snapshot's cost per step
    # (1/K of it) for up to K - 1 steps redone after a failure; swaps' boundaries and the last
    # step are always snapshotted. `nonstop simulate --snapshot-every` and its advisor weigh it.
    snapshot_every: int = 1
    # > 0: the fraction of the training time the snapshots' stall may cost; the coordinator
    # measures it and snapshots every K-th step, K >= snapshot_every the smallest within it
    # (policy/cadence.py); failures are rescued meanwhile. 0: every snapshot_every-th step.
    snapshot_budget: float = DEFAULT_BUDGET
    # with a budget: the widest interval's steps take at most this long, so the committed step
    # (what persists, peer replicas and a failure no rescue saves go back to) is never older
    snapshot_max_age_s: float = MAX_AGE_S
    # K > 1 (or a budget): how long a recovery's plan waits for the survivors' rescue reports (the state after
    # their last completed step, written on the failure: policy/rescue.py); 0: no rescues
    rescue_wait_s: float = 2.0
    # where the state a node's ranks hold alike (a DDP job's, an HSDP job's replica groups') lives
    # in its memory tier: "node" (one copy per node, snapshot/nodecopy.py) or "rank" (every rank
    # its own whole copy)
    snapshot_copies: SnapshotCopies = SnapshotCopies.NODE
    persist_url: str | None = None  # None: <job_dir>/checkpoints
    persist_every: int = 100  # steps between lazy persists; 0: only on demand, SIGTERM and exit
    keep: int = 3
    resume: str | None = None  # durable URL to restart the whole job from
    lossy: bool = False
    lossy_bits: int = 8
    persist_timeout_s: float = 120.0
    # -- many nodes ------------------------------------------------------------------
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None  # HOST:PORT; node 0 listens there, the others connect
    domain: str | None = None  # failure domain of this node (rack, zone); default: the node itself
    data_host: str | None = None  # data plane address; default: the one that reaches the coordinator
    lease_ttl_s: float = 1.0  # a node silent this long is lost (and fences itself)
    replicas: int = 1  # peer copies of each rank's snapshot (0: none); needs nnodes > 1
    replica_bandwidth_mb_s: float | None = None  # cap per node for replication traffic
    secret_file: Path | None = None  # nodes other than 0: where the job secret is
    quarantine_failures: int = 3  # a node failing this often ...
    quarantine_window_s: float = 600.0  # ... within this window is quarantined
    join_timeout_s: float = 300.0  # how long node 0 waits for every node to join
    preempt_grace_s: float = 30.0  # SIGTERM to a node's agent: a preemption notice with this grace
    preempt_url: str | None = None  # poll this HTTP endpoint for a notice ({node}: the node's name)
    preempt_headers: tuple[str, ...] = ()  # "Name: value" headers of that request
    preempt_poll_s: float = 2.0
    shards_per_rank: int = 1  # data shards (micro-batches) a rank plays per step at full size
    swap_transfer: SwapTransfer = SwapTransfer.AUTO  # how a migration's swap fetches the boundary
    mesh: str | None = None  # replicate=R,shard=S,tp=T (nonstop/mesh.py); None: data-parallel DDP
    keep_groups: bool = True  # a new generation keeps the mesh groups nothing changed (train/meshgroups.py)
    # -- elasticity (policy/elastic.py) ---------------------------------------------------
    min_world_size: int = 0  # shrink down to this many ranks when no spare is left (0: never shrink)
    elastic_wait_s: float = 0.0  # wait this long for a spare before shrinking
    # a failure spares could replace: auto | wait (replace first) | continue (shrink first, then
    # grow with the spares): policy/survivors.py
    survivors: SurvivorMode = SurvivorMode.AUTO
    # a shrunk job: keep the global batch (the lost ranks' shards played by the others; bitwise)
    # or drop the lost ranks' shares of it until it grows back (torchft's; full speed per rank)
    shrink_batch: ShrinkBatch = ShrinkBatch.KEEP
    # -- control store -----------------------------------------------------------------
    store: str = "embedded://"  # or etcd://HOST:PORT[,...] (etcds://: TLS): the coordinator may restart
    reconnect_s: float = 30.0  # store mode: how long agents and workers wait for a new coordinator
    etcd_ca: Path | None = None  # etcds://: the CA that signed etcd's certificate
    etcd_cert: Path | None = None  # etcds://: this job's client certificate and key (--client-cert-auth)
    etcd_key: Path | None = None
    # -- security ----------------------------------------------------------------------------
    tls: bool = False  # TLS on the control channel and the data plane (control/tls.py)
    # -- operating -----------------------------------------------------------------------------
    metrics_port: int | None = None  # Prometheus /metrics and /status on the control host (0: any free port)
    shm_dir: Path | None = None  # this node's snapshot memory (--shm-dir); None: /dev/shm
    # -- health (issue 21) -------------------------------------------------------------------
    # fail-slow detection and the proactive migration of a straggler (policy/straggler.py)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    # every node agent's health probes: --probe-period, --health-cmd (agent/probes.py)
    probes: ProbeConfig = field(default_factory=ProbeConfig)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def node_copy_groups(self) -> int:
        """The copy groups a node keeps one copy each of (snapshot/nodecopy.py): a DDP job's
        ranks are one group; an HSDP job's are its shard coordinates when a node holds ranks of
        several replica groups (:meth:`MeshSpec.copy_groups_on_node`); 0: none (every rank
        keeps its own whole copy: --snapshot-copies rank, or no two ranks of a node alike)."""
        if self.snapshot_copies is not SnapshotCopies.NODE:
            return 0
        if self.mesh is None:
            return 1
        return MeshSpec.parse(self.mesh).copy_groups_on_node(self.nproc_per_node)

    @property
    def coordinator_addr(self) -> tuple[str, int]:
        if self.coordinator is None:
            return (self.host, self.port)
        host, _, port = self.coordinator.rpartition(":")
        return (host, int(port))

    @property
    def checkpoint_url(self) -> str:
        return (
            self.persist_url if self.persist_url is not None else str(self.job_dir.resolve() / "checkpoints")
        )

    def __post_init__(self) -> None:
        self._enums()
        if self.persist_every < 0:
            raise UsageError(
                f"--persist-every must be >= 0 (got {self.persist_every}); 0 persists only on demand"
            )
        if self.lossy_bits not in (4, 8):
            raise UsageError(f"--lossy-bits must be 4 or 8 (got {self.lossy_bits})")
        if self.keep < 1:
            raise UsageError(f"--keep must be >= 1 (got {self.keep})")
        if self.snapshot_every < 1:
            raise UsageError(
                f"--snapshot-every must be >= 1 step (got {self.snapshot_every}); 1 snapshots every step"
            )
        if not 0.0 <= self.snapshot_budget < 1.0:
            raise UsageError(
                f"--snapshot-budget must be a fraction in [0, 1) of the training time, e.g. 0.002 "
                f"(got {self.snapshot_budget}); 0 keeps --snapshot-every fixed"
            )
        if not (math.isfinite(self.snapshot_max_age_s) and self.snapshot_max_age_s > 0):
            raise UsageError(
                f"--snapshot-max-age must be > 0 seconds (got {self.snapshot_max_age_s}), e.g. 300: "
                f"with --snapshot-budget the interval's steps never take longer"
            )
        if not 0.0 <= self.rescue_wait_s <= 60.0:
            raise UsageError(f"--rescue-wait must be between 0 and 60 seconds (got {self.rescue_wait_s})")
        if self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be >= 1 (got {self.nproc_per_node})")
        if self.spares < 0:
            raise UsageError(f"--spares must be >= 0 (got {self.spares})")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"--port must be in 0..65535 (got {self.port}); 0 picks a free port")
        if self.shm_dir is not None and not (self.shm_dir.is_dir() and os.access(self.shm_dir, os.W_OK)):
            raise UsageError(f"--shm-dir {str(self.shm_dir)!r} is not a writable directory")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise UsageError(
                f"--metrics-port must be in 0..65535 (got {self.metrics_port}); 0 picks a free port"
            )
        if self.max_restarts < 0:
            raise UsageError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise UsageError(
                f"--node-rank must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes} "
                f"(got {self.node_rank})"
            )
        if self.nnodes > 1 and self.coordinator is None:
            raise UsageError("a job of several nodes needs --coordinator HOST:PORT (node 0 listens there)")
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise UsageError(f"--coordinator must be HOST:PORT (got {self.coordinator!r})")
        if self.lease_ttl_s <= 0.05:
            raise UsageError(f"--lease-ttl must be > 0.05 seconds (got {self.lease_ttl_s})")
        if self.replicas < 0 or (self.nnodes > 1 and self.replicas > self.nnodes - 1):
            raise UsageError(
                f"--replicas must be in 0..{max(0, self.nnodes - 1)} (a replica lives on another node; "
                f"got {self.replicas})"
            )
        if self.replica_bandwidth_mb_s is not None and self.replica_bandwidth_mb_s <= 0:
            raise UsageError("--replica-bandwidth must be > 0 MB/s (omit it for no cap)")
        if self.quarantine_failures < 1 or self.quarantine_window_s <= 0:
            raise UsageError("--quarantine-failures must be >= 1 and --quarantine-window > 0")
        if self.store != "embedded://":
            scheme, sep, rest = self.store.partition("://")
            if scheme not in ("etcd", "etcds") or not sep or not rest:
                raise UsageError(
                    "--store must be embedded://, etcd://HOST:PORT[,HOST:PORT...] or etcds://... (TLS) "
                    f"(got {self.store!r})"
                )
            if self.coordinator is None or self.coordinator_addr[1] == 0:
                raise UsageError(
                    "--store etcd://... needs --coordinator HOST:PORT with a fixed port: a restarted "
                    "coordinator listens where the nodes reconnect"
                )
            if self.secret_file is None:
                raise UsageError(
                    "--store etcd://... needs --secret-file on every node: the job secret is also the "
                    "etcd password (scripts/etcd.sh start DIR PORT SECRET_FILE)"
                )
        if self.reconnect_s <= 0:
            raise UsageError(f"--reconnect must be > 0 seconds (got {self.reconnect_s})")
        self._check_security()
        if self.preempt_url is not None and not self.preempt_url.startswith(("http://", "https://")):
            raise UsageError(f"--preempt-url must be an http:// or https:// URL (got {self.preempt_url!r})")
        for h in self.preempt_headers:
            if ":" not in h or not h.partition(":")[0].strip():
                raise UsageError(f"--preempt-header must be 'Name: value' (got {h!r})")
        if self.preempt_poll_s <= 0:
            raise UsageError(f"--preempt-poll must be > 0 seconds (got {self.preempt_poll_s})")
        if not 0 <= self.min_world_size <= self.world_size:
            raise UsageError(
                f"--min-world-size must be in 0..{self.world_size} (the job's world size; 0 never "
                f"shrinks; got {self.min_world_size})"
            )
        if self.elastic_wait_s < 0:
            raise UsageError(f"--elastic-wait must be >= 0 seconds (got {self.elastic_wait_s})")
        if isinstance(self.shards_per_rank, bool) or not 1 <= self.shards_per_rank <= 4096:
            raise UsageError(f"--shards-per-rank must be in 1..4096 (got {self.shards_per_rank})")
        if self.mesh is not None:
            spec = MeshSpec.parse(self.mesh)
            spec.check(world_size=self.world_size, nproc_per_node=self.nproc_per_node)
            if self.shards_per_rank != 1:
                raise UsageError(
                    "--shards-per-rank is not supported with --mesh: a sharded job's data shards are "
                    "its data-parallel ranks (replicate x shard)"
                )
            if self.min_world_size and self.min_world_size < self.world_size:
                spec.check_elastic(min_world_size=self.min_world_size)
        if self.survivors is SurvivorMode.CONTINUE:
            if self.min_world >= self.world_size:
                raise UsageError(
                    "--survivors continue needs an elastic job: set --min-world-size below the world "
                    "size (the script must read its batches through session.shard_steps)"
                )
            if self.mesh is not None and MeshSpec.parse(self.mesh).reshards:
                raise UsageError(
                    f"--survivors continue needs replica groups to go on without (--mesh {self.mesh} "
                    "has none: a shrink reshards every rank); use --mesh replicate=R with R >= 2"
                )
        if self.shrink_batch is ShrinkBatch.DROP and self.min_world >= self.world_size:
            raise UsageError(
                "--shrink-batch drop says what a shrunk job trains on: set --min-world-size below the "
                "world size too (the script must read its batches through session.shard_steps)"
            )

    def _enums(self) -> None:
        """Each closed set's field as its member (a caller, a TOML file or JSON may give the
        string); UsageError, one line, for a value outside it."""
        closed: tuple[tuple[str, type[enum.StrEnum], str], ...] = (
            ("snapshot", SnapshotMode, "--snapshot"),
            ("snapshot_copies", SnapshotCopies, "--snapshot-copies"),
            ("survivors", SurvivorMode, "--survivors"),
            ("shrink_batch", ShrinkBatch, "--shrink-batch"),
            ("swap_transfer", SwapTransfer, "--swap-transfer"),
        )
        for name, kind, flag in closed:
            object.__setattr__(self, name, member(kind, getattr(self, name), flag))

    def _check_security(self) -> None:
        from nonstop.control.tls import EtcdTLS, check_openssl

        tls_files = (self.etcd_ca, self.etcd_cert, self.etcd_key)
        if self.store.startswith("etcds://"):
            if self.etcd_ca is None:
                raise UsageError(
                    "--store etcds://... needs --etcd-ca FILE, the CA that signed etcd's certificate"
                )
            EtcdTLS(self.etcd_ca, self.etcd_cert, self.etcd_key).check()
        elif any(f is not None for f in tls_files):
            raise UsageError(
                "--etcd-ca/--etcd-cert/--etcd-key are for TLS to etcd: use --store etcds://HOST:PORT"
            )
        if self.tls:
            check_openssl()

    @property
    def min_world(self) -> int:
        """The smallest world size the job may shrink to (its full size: never shrinks)."""
        return self.min_world_size or self.world_size

    @property
    def uses_store(self) -> bool:
        """True when the job's state lives in an external control store (etcd)."""
        return self.store != "embedded://"


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


def security_env(config: JobConfig) -> dict[str, str]:
    """The environment a job's processes inherit for its TLS settings (``ENV.TLS``, ``ENV.ETCD_*``)."""
    env = {ENV.TLS: "1"} if config.tls else {}
    c = config
    files = ((ENV.ETCD_CA, c.etcd_ca), (ENV.ETCD_CERT, c.etcd_cert), (ENV.ETCD_KEY, c.etcd_key))
    for name, path in files:
        if path is not None:
            env[name] = str(path.resolve())
    return env


@contextlib.contextmanager
def security_environ(config: JobConfig) -> Iterator[None]:
    """:func:`security_env` in ``os.environ`` while the block runs (the job's processes and
    threads inherit it), then the environment as it was."""
    env = security_env(config)
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


def job_config_to_json(config: JobConfig) -> str:
    """``config`` as JSON (for a process that must rebuild it: the restartable coordinator)."""
    doc: dict[str, object] = {}
    for f in fields(config):
        v = getattr(config, f.name)
        if isinstance(v, (DetectorConfig, StragglerConfig, ProbeConfig)):
            v = {g.name: getattr(v, g.name) for g in fields(v)}
        elif isinstance(v, Path):
            v = str(v)
        doc[f.name] = v
    return json.dumps(doc)


def job_config_from_json(text: str) -> JobConfig:
    """The inverse of :func:`job_config_to_json` (validated like any JobConfig)."""
    doc = json.loads(text)
    doc["detector"] = DetectorConfig(**doc["detector"])
    if "straggler" in doc:  # issue 21; absent from a record written before it
        doc["straggler"] = StragglerConfig(**doc["straggler"])
    if "probes" in doc:  # issue 21; absent from a record written before it
        doc["probes"] = ProbeConfig(**doc["probes"])
    doc["job_dir"] = Path(doc["job_dir"])
    for name in ("secret_file", "etcd_ca", "etcd_cert", "etcd_key", "shm_dir"):
        if doc.get(name) is not None:
            doc[name] = Path(doc[name])
    for name in ("script_args", "faults"):
        doc[name] = tuple(doc[name])
    doc["extra_env"] = tuple((str(k), str(v)) for k, v in doc["extra_env"])
    return JobConfig(**doc)
