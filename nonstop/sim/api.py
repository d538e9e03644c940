"""The simulator's contract: the job, failure events, what a strategy answers, and the result.

Units: seconds of wall time, bytes, GPUs. Every loss is booked in **GPU-seconds** against a
(cause, stage) pair, so ETTR = 1 - lost GPU-seconds / (job GPUs x wall seconds), and the
breakdowns by cause and by stage add up to the total by construction.

Stages are the runtime's recovery stages (:class:`nonstop.policy.reconfiguration.Stage`: detect, plan,
launch, restore, rebuild, resume) plus the simulator's own: ``replan`` (a recovery cut short by
another failure), ``lost_work`` (committed progress redone), ``overhead`` (checkpoint blocking or
per-step snapshot stall, charged to the cause ``steady``), ``shrunk`` (the throughput an elastic
job gives up while it trains with fewer ranks, charged to the failure that shrank it),
``fail_slow`` (the throughput a synchronous job gives up while one of its ranks is slow, charged
to the cause ``fail-slow``) and ``proactive_migration`` (the pause of a live migration done ahead
of trouble: away from a detected straggler, or off a node whose degraded signal came before its
failure). GPUs idle while the rest of the job trains on (a torchft replica group healing) are
booked under the stage they are in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from nonstop.errors import UsageError
from nonstop.policy.decisions import Tier
from nonstop.policy.reconfiguration import Stage
from nonstop.sim.actions import RecoveryAction

__all__ = [
    "DAY_S",
    "FAIL_SLOW",
    "STAGES",
    "STEADY",
    "Charge",
    "default_spare_nodes",
    "FailureEvents",
    "JobSpec",
    "Recovery",
    "Proactive",
    "Resizing",
    "RunContext",
    "SlowEvents",
    "SlowResponse",
    "SimResult",
    "Strategy",
    "Trained",
    "require",
]

DAY_S = 86_400.0
STEADY = "steady"  # the cause of overheads paid whether or not anything fails
FAIL_SLOW = "fail-slow"  # the cause of the throughput lost to slow ranks and their migrations
STAGES: tuple[str, ...] = (
    *(s.value for s in Stage if not s.is_terminal),
    "replan",
    "lost_work",
    "overhead",
    "shrunk",
    "fail_slow",
    "proactive_migration",
)


def require(ok: bool, message: str) -> None:
    """Raise :class:`UsageError` with a one-line ``message`` (what to do) unless ``ok``."""
    if not ok:
        raise UsageError(message)


def default_spare_nodes(num_nodes: int) -> int:
    """The default spare-node pool of every strategy: 1% of the job's nodes, at least one."""
    return max(1, math.ceil(0.01 * num_nodes))


def _finite_pos(name: str, value: float, *, zero_ok: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    require(ok, f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One synchronous training job.

    num_gpus: GPUs training (spares are extra). gpus_per_node: GPUs per node (a failure takes a
    node's ranks down together). days: wall time simulated. nodes_per_domain: consecutive nodes
    that share a failure domain (a rack), used for replica placement. state_bytes_per_gpu: training
    state (model + optimizer) each GPU snapshots. step_s: median optimizer-step time.
    """

    num_gpus: int
    gpus_per_node: int = 8
    days: float = 1.0
    nodes_per_domain: int = 2
    state_bytes_per_gpu: float = 4e9
    step_s: float = 5.0

    def __post_init__(self) -> None:
        require(self.gpus_per_node >= 1, f"--gpus-per-node must be >= 1; got {self.gpus_per_node}")
        require(
            self.num_gpus >= self.gpus_per_node and self.num_gpus % self.gpus_per_node == 0,
            f"--gpus must be a positive multiple of --gpus-per-node ({self.gpus_per_node}); "
            f"got {self.num_gpus}",
        )
        _finite_pos("--days", self.days)
        require(self.nodes_per_domain >= 1, "--nodes-per-domain must be >= 1")
        _finite_pos("--state-gb", self.state_bytes_per_gpu)
        _finite_pos("--step-s", self.step_s)

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.gpus_per_node

    @property
    def horizon_s(self) -> float:
        return self.days * DAY_S


@dataclass(frozen=True)
class SlowEvents:
    """Fail-slow events in time order, as parallel arrays: from ``time`` on, one GPU of node
    ``node`` computes ``factor`` x slower than its peers for ``duration_s`` seconds (unless its
    node is replaced first, or its rank is moved away)."""

    time: npt.NDArray[np.float64]
    node: npt.NDArray[np.int64]
    factor: npt.NDArray[np.float64]
    duration_s: npt.NDArray[np.float64]

    def __post_init__(self) -> None:
        n = len(self.time)
        assert len(self.node) == n and len(self.factor) == n and len(self.duration_s) == n
        assert n == 0 or bool(np.all(np.diff(self.time) >= 0)), "events must be sorted by time"

    def __len__(self) -> int:
        return len(self.time)


@dataclass(frozen=True)
class FailureEvents:
    """Failures in time order, as parallel arrays (one row per event).

    ``node``: position of the failed node in the job (0..num_nodes-1). ``cause``: index into
    ``causes`` (a cause carries its :class:`FailureKind` and whether it is planned). ``lemon``:
    the event comes from a lemon node's excess rate; the engine drops it once that node's machine
    has been replaced (thinning). ``lead_s`` (None: no signal ever): seconds before the failure
    that its node showed a detectable degraded signal (0: none for this one). ``slow``: the
    run's fail-slow events (None: not modelled).
    """

    time: npt.NDArray[np.float64]
    node: npt.NDArray[np.int64]
    cause: npt.NDArray[np.int64]
    lemon: npt.NDArray[np.bool_]
    causes: tuple[Any, ...]  # tuple[failures.Cause, ...]; Any keeps this module import-free
    lead_s: npt.NDArray[np.float64] | None = None
    slow: SlowEvents | None = None

    def __post_init__(self) -> None:
        n = len(self.time)
        assert len(self.node) == n and len(self.cause) == n and len(self.lemon) == n
        assert self.lead_s is None or len(self.lead_s) == n
        assert n == 0 or bool(np.all(np.diff(self.time) >= 0)), "events must be sorted by time"

    def __len__(self) -> int:
        return len(self.time)


@dataclass(frozen=True, kw_only=True)
class Charge:
    """GPU-seconds lost to one stage: ``gpus`` idle for ``seconds``."""

    stage: str
    seconds: float
    gpus: int


@dataclass(kw_only=True)
class Recovery:
    """A strategy's answer to one failure.

    ``pause``: stages during which the **whole job** stops, in order, starting at the failure
    time (a later failure inside them cuts them short: the elapsed part becomes ``replan``).
    ``lost_work_s``: progress (seconds of whole-job training) rolled back and redone.
    ``partial``: GPUs idle while the rest of the job trains on, back to back from the end of the
    pause plus ``partial_delay_s`` (clipped at the horizon).
    The other fields describe the decision, for the breakdowns.
    """

    pause: list[tuple[str, float]] = field(default_factory=list)
    lost_work_s: float = 0.0
    partial: list[Charge] = field(default_factory=list)
    partial_delay_s: float = 0.0
    action: RecoveryAction | None = None
    tier: Tier | None = None
    replacement: str = "none"  # spare / cold / pool / shrink (none now, a pool node later) / none
    resize: str | None = None  # elastic: the ElasticAction taken (wait / shrink / fail), or "grow"

    @property
    def pause_s(self) -> float:
        return sum(s for _, s in self.pause)


@dataclass(kw_only=True)
class RunContext:
    """What a strategy sees of the run: the job and the random generator of this run."""

    job: JobSpec
    rng: np.random.Generator


@runtime_checkable
class Strategy(Protocol):
    """A recovery strategy: how training is protected and what each failure costs.

    The engine calls, in time order and never concurrently: :meth:`begin` once; then for each
    interval the job trains, :meth:`advance`; for each failure, :meth:`on_failure`. A strategy keeps
    its own progress bookkeeping (what is committed where). Implementations must be
    deterministic given the context's generator.
    """

    name: str

    def begin(self, ctx: RunContext) -> None:
        """Reset per-run state."""

    def advance(self, dt: float) -> float:
        """The job trained for ``dt`` wall seconds; return the seconds of it lost to steady
        overhead (checkpoint blocking, snapshot stall)."""

    def on_failure(self, *, now: float, node: int, cause: Any, recovering: bool) -> Recovery:
        """A failure of node ``node`` at ``now`` with ``cause`` (a :class:`failures.Cause`).
        ``recovering``: the job was inside a recovery pause when it happened."""

    def describe(self) -> dict[str, Any]:
        """Parameters and where each default came from (for the JSON output)."""


@dataclass(frozen=True, kw_only=True)
class Trained:
    """What one interval of training (at one world size) gave up, in seconds of whole-job time.

    ``overhead_s``: steady overhead (checkpoint blocking, snapshot stall), booked to ``steady``.
    ``shrunk_s``: the throughput given up because the job trains with fewer data-parallel ranks
    than it started with, booked to the cause ``cause`` (the failure that shrank it) under the stage
    ``shrunk``. ``shrunk``: the job was below its full size during the interval.
    """

    overhead_s: float
    shrunk_s: float = 0.0
    cause: str = STEADY
    shrunk: bool = False


@dataclass(frozen=True, kw_only=True)
class SlowResponse:
    """What a strategy does about a fail-slow rank that started at ``now``.

    ``detect_after_s``: when (after ``now``) its detector flags the rank (None: never: the
    strategy has none, or the slowdown is below its threshold). ``migrate``: it then moves the
    rank live: the slowdown ends ``prepare_s`` after the detection (the joiner prepares while the
    job trains on, slowly) and the whole job pauses ``pause_s`` (the swap). ``reason``: why, for
    the breakdowns."""

    detect_after_s: float | None = None
    migrate: bool = False
    prepare_s: float = 0.0
    pause_s: float = 0.0
    reason: str = ""


@runtime_checkable
class Proactive(Protocol):
    """What a strategy that acts before things break adds to :class:`Strategy`.

    The engine calls :meth:`on_slow` when a fail-slow event starts, and :meth:`on_warning` for a
    failure whose node gave a degraded signal ``lead_s`` before it (called at the failure's time,
    before :meth:`Strategy.on_failure`): True means the node was drained in time, so the engine
    hands the failure to ``on_failure`` as a planned event (a live migration, nothing lost) and
    books its pause as ``proactive_migration``."""

    def on_slow(self, *, now: float, node: int, factor: float, duration_s: float) -> SlowResponse:
        """A rank of node ``node`` computes ``factor`` x slower from ``now`` on."""

    def on_warning(self, *, now: float, node: int, cause: Any, lead_s: float) -> bool:
        """Node ``node`` fails at ``now`` with ``cause``; it looked degraded ``lead_s`` before."""


@runtime_checkable
class Resizing(Protocol):
    """What a strategy whose job can change size (elastic shrink and grow) adds to :class:`Strategy`.

    The engine, for such a strategy, calls :meth:`train` instead of ``Strategy.advance`` for every
    interval the job trains, and fires the strategy's own events (a grow back to full size) in
    time order with the failures: an event due while the job is paused fires when the pause ends;
    its :class:`Recovery` is booked like a failure's (a failure inside its pause cuts it short), but
    it is not a failure. Between two events or failures the job's size, hence its rate, is fixed.
    """

    def train(self, dt: float) -> Trained:
        """The job trained for ``dt`` wall seconds at its current size: what that gave up."""

    def next_event(self) -> float | None:
        """When the strategy's next own event is due (None: none is)."""

    def on_event(self, *, now: float) -> tuple[str, Recovery]:
        """Fire the event :meth:`next_event` announced, at ``now`` (>= that time): the cause its
        cost is booked to, and what it costs."""


@dataclass(kw_only=True)
class SimResult:
    """One simulated run."""

    strategy: str
    job: JobSpec
    seed: int
    ettr: float
    lost_gpu_s: dict[str, dict[str, float]]  # cause -> stage -> GPU-seconds
    failures: int
    failures_by_cause: dict[str, int]
    actions: dict[str, int]
    tiers: dict[str, int]
    replacements: dict[str, int]
    spare_gpus: int
    wall_s: float  # simulator run time
    params: dict[str, Any]
    shrunk_s: float = 0.0  # wall seconds the job trained below its full size (elastic)
    shrunk_work_s: float = 0.0  # ... and the progress made meanwhile, in seconds of the full-size job
    resizes: dict[str, int] = field(default_factory=dict)  # elastic: wait / shrink / fail / grow
    slowdowns: int = 0  # fail-slow events that started within the run
    proactive: dict[str, int] = field(default_factory=dict)  # live moves ahead of trouble, by reason

    @property
    def lost_by_stage(self) -> dict[str, float]:
        out = {s: 0.0 for s in STAGES}
        for by_stage in self.lost_gpu_s.values():
            for stage, v in by_stage.items():
                out[stage] = out.get(stage, 0.0) + v
        return out

    @property
    def lost_by_cause(self) -> dict[str, float]:
        return {c: sum(v.values()) for c, v in self.lost_gpu_s.items()}

    @property
    def shrunk_throughput(self) -> float | None:
        """Progress per wall second while shrunk, in seconds of the full-size job (1.0: the full
        job with no overhead; the snapshot stall is in it); None if the job never trained shrunk."""
        return self.shrunk_work_s / self.shrunk_s if self.shrunk_s > 0 else None

    @property
    def goodput_gpus(self) -> float:
        """Useful GPU-seconds per wall second (ETTR x job GPUs)."""
        return self.ettr * self.job.num_gpus

    @property
    def goodput_per_provisioned_gpu(self) -> float:
        """Goodput over every GPU paid for, spares included."""
        return self.goodput_gpus / (self.job.num_gpus + self.spare_gpus)

    def lost_gpu_hours_per_day(self) -> float:
        return sum(self.lost_by_cause.values()) / 3600.0 / self.job.days
