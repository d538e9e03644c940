"""Failure processes: rates, causes, and the event streams the engine replays.

A **cause** is what broke (a faulty GPU, a software bug, ...). Each cause carries the runtime's
:class:`~nonstop.policy.decisions.FailureKind` (how the control plane sees it: a process exit, a
hang, a lost node) and whether it is **planned** (maintenance with notice). The strategy then
classifies it with :func:`nonstop.sim.actions.recovery_action` (restart in place, replace the
node, quarantine it, migrate).

Sources of the numbers (see docs/simulator.md):

* Llama 3 (Dubey et al., "The Llama 3 Herd of Models", arXiv:2407.21783, Table 5): 466
  interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (2,048 nodes of 8): 47
  planned, 419 unexpected, broken down by root cause as in :data:`LLAMA3_CAUSES`.
* Meta's research clusters (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning
  Research Clusters", HPCA 2025, arXiv:2410.21680): 6.50 and 2.34 failures per 1,000 node-days
  for its two clusters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nonstop.policy.decisions import FailureKind
from nonstop.sim.api import DAY_S, FailureEvents, JobSpec, require
from nonstop.sim.traces import NodeTrace

__all__ = [
    "LLAMA3_CAUSES",
    "LLAMA3_DAYS",
    "LLAMA3_NODES",
    "LLAMA3_PLANNED",
    "PRESETS",
    "SPOT_PREEMPTION",
    "Cause",
    "FailureModel",
    "TraceFailures",
    "preset",
]


@dataclass(frozen=True, kw_only=True)
class Cause:
    """A root cause: its share ``weight`` of failures, how the runtime sees it, and why."""

    name: str
    weight: float
    kind: FailureKind
    planned: bool = False
    why: str = ""

    def __post_init__(self) -> None:
        require(self.weight >= 0 and math.isfinite(self.weight), f"cause {self.name!r}: weight must be >= 0")


_N = FailureKind.NODE_LOST
# Llama 3 paper, Table 5 (419 unexpected interruptions, 54 days, 16,384 GPUs). The kind is our
# reading of what the control plane observes; "node" = the node is drained and replaced.
LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause(name="faulty GPU", weight=148, kind=_N, why="GPU hardware fault (incl. NVLink): drain the node"),
    Cause(name="GPU HBM3 memory", weight=72, kind=_N, why="uncorrectable ECC needs a GPU reset: drain"),
    Cause(name="software bug", weight=54, kind=FailureKind.ERROR, why="a rank raises; the node is fine"),
    Cause(name="network switch/cable", weight=35, kind=_N, why="the node is unreachable"),
    Cause(name="host maintenance", weight=32, kind=_N, why="unplanned: the host is taken without notice"),
    Cause(name="GPU SRAM memory", weight=19, kind=_N, why="GPU hardware: drain"),
    Cause(name="GPU system processor", weight=17, kind=_N, why="GSP error needs a GPU reset: drain"),
    Cause(name="NIC", weight=7, kind=_N, why="the node is unreachable"),
    Cause(name="NCCL watchdog timeout", weight=7, kind=FailureKind.HANG, why="a rank stops progressing"),
    Cause(name="silent data corruption", weight=6, kind=_N, why="the GPU computes wrong values: drain"),
    Cause(name="GPU thermal interface/sensor", weight=6, kind=_N, why="GPU hardware: drain"),
    Cause(name="SSD", weight=3, kind=_N, why="host hardware"),
    Cause(name="power supply", weight=3, kind=_N, why="host hardware"),
    Cause(name="server chassis", weight=2, kind=_N, why="host hardware"),
    Cause(name="IO expansion board", weight=2, kind=_N, why="host hardware"),
    Cause(name="dependency", weight=2, kind=FailureKind.ERROR, why="an external service failed a rank"),
    Cause(name="CPU", weight=2, kind=_N, why="host hardware"),
    Cause(name="system memory", weight=2, kind=_N, why="host hardware"),
)
LLAMA3_PLANNED = 47  # planned interruptions in the same 54 days (automated maintenance)
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 16_384 // 8
PLANNED_MAINTENANCE = Cause(
    name="planned maintenance", weight=1, kind=_N, planned=True, why="maintenance with notice: migrate"
)
SPOT_PREEMPTION = Cause(name="spot preemption", weight=1, kind=_N, why="the cloud reclaims the instance")


@dataclass(frozen=True, kw_only=True)
class FailureModel:
    """Independent per-node failure processes.

    rate_per_node_day: unexpected failures per node per day. shape: Weibull shape of each node's
    inter-failure times (1.0: Poisson; < 1: infant mortality; the scale is set so the mean rate is
    ``rate_per_node_day``); each node's process renews after each failure and is in equilibrium at
    time 0 (nodes of random age), so the expected count is rate x nodes x time for any shape, and the
    shape only changes how failures bunch on a node (k < 1: a node that failed soon fails again).
    planned_per_node_day:
    planned events (maintenance with notice), Poisson. causes: the mix of unexpected causes.
    lemon_fraction / lemon_factor: that fraction of nodes fails ``lemon_factor`` times more often
    (Meta's "lemon nodes"); the excess stops once the node's machine is replaced or quarantined.
    """

    name: str = "custom"
    rate_per_node_day: float
    shape: float = 1.0
    planned_per_node_day: float = 0.0
    causes: tuple[Cause, ...] = LLAMA3_CAUSES
    lemon_fraction: float = 0.0
    lemon_factor: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.rate_per_node_day) and self.rate_per_node_day >= 0,
            f"failure rate must be >= 0 per node-day; got {self.rate_per_node_day}",
        )
        require(
            math.isfinite(self.shape) and 0.1 <= self.shape <= 10,
            f"--weibull-shape must be in [0.1, 10]; got {self.shape}",
        )
        require(self.planned_per_node_day >= 0, "planned rate must be >= 0 per node-day")
        require(len(self.causes) > 0 and sum(c.weight for c in self.causes) > 0, "give at least one cause")
        require(
            0 <= self.lemon_fraction <= 1, f"--lemon-fraction must be in [0, 1]; got {self.lemon_fraction}"
        )
        require(self.lemon_factor >= 1, f"--lemon-factor must be >= 1; got {self.lemon_factor}")

    def with_rate(self, rate_per_node_day: float) -> FailureModel:
        return FailureModel(
            name=self.name,
            rate_per_node_day=rate_per_node_day,
            shape=self.shape,
            planned_per_node_day=self.planned_per_node_day,
            causes=self.causes,
            lemon_fraction=self.lemon_fraction,
            lemon_factor=self.lemon_factor,
            source=self.source,
        )

    @property
    def all_causes(self) -> tuple[Cause, ...]:
        """Unexpected causes, then planned maintenance (index ``len(causes)``)."""
        return (*self.causes, PLANNED_MAINTENANCE)

    def job_rate_per_s(self, num_nodes: int) -> float:
        """Expected unexpected failures per second for the whole job (lemons included)."""
        excess = self.lemon_fraction * (self.lemon_factor - 1.0)
        return num_nodes * self.rate_per_node_day * (1.0 + excess) / DAY_S

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents:
        """Draw every failure of the run (vectorised; memory linear in nodes and events)."""
        n, horizon = job.num_nodes, job.horizon_s
        rate_s = self.rate_per_node_day / DAY_S
        t_main, n_main = _renewal(n, rate_s, self.shape, horizon, rng)
        weights = np.array([c.weight for c in self.causes], dtype=np.float64)
        c_main = rng.choice(len(self.causes), size=len(t_main), p=weights / weights.sum())
        # planned maintenance: Poisson, its own cause index
        t_pl, n_pl = _renewal(n, self.planned_per_node_day / DAY_S, 1.0, horizon, rng)
        c_pl = np.full(len(t_pl), len(self.causes), dtype=np.int64)
        # lemon nodes: an extra Poisson stream on a fixed subset of positions
        num_lemons = round(self.lemon_fraction * n)
        if num_lemons and self.lemon_factor > 1:
            lemons = rng.choice(n, size=num_lemons, replace=False)
            t_lm, idx = _renewal(num_lemons, rate_s * (self.lemon_factor - 1), 1.0, horizon, rng)
            n_lm = lemons[idx]
            c_lm = rng.choice(len(self.causes), size=len(t_lm), p=weights / weights.sum())
        else:
            t_lm, n_lm, c_lm = np.empty(0), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        time = np.concatenate([t_main, t_pl, t_lm])
        order = np.argsort(time, kind="stable")
        lemon = np.concatenate(
            [np.zeros(len(t_main) + len(t_pl), dtype=np.bool_), np.ones(len(t_lm), dtype=np.bool_)]
        )
        return FailureEvents(
            time=time[order],
            node=np.concatenate([n_main, n_pl, n_lm]).astype(np.int64)[order],
            cause=np.concatenate([c_main, c_pl, c_lm]).astype(np.int64)[order],
            lemon=lemon[order],
            causes=self.all_causes,
        )


def _renewal(
    num: int, rate_s: float, shape: float, horizon: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Event times and node indices of ``num`` independent renewal processes on [0, horizon)."""
    if num == 0 or rate_s <= 0:
        return np.empty(0), np.empty(0, dtype=np.int64)
    if shape == 1.0:  # superposed Poisson processes: one Poisson count, uniform times
        count = rng.poisson(num * rate_s * horizon)
        times = rng.uniform(0.0, horizon, size=count)
        return times, rng.integers(0, num, size=count)
    scale = 1.0 / (rate_s * math.gamma(1.0 + 1.0 / shape))
    times_out: list[np.ndarray] = []
    nodes_out: list[np.ndarray] = []
    alive = np.arange(num)
    # Equilibrium start (nodes of random age): the first failure is the forward recurrence time,
    # U x a length-biased interval; for a Weibull that interval is scale * Gamma(1 + 1/k)^(1/k).
    t = rng.uniform(size=num) * scale * rng.gamma(1.0 + 1.0 / shape, size=num) ** (1.0 / shape)
    while alive.size:
        keep = t < horizon
        alive, t = alive[keep], t[keep]
        times_out.append(t)
        nodes_out.append(alive)
        t = t + scale * rng.weibull(shape, size=t.size)
    return np.concatenate(times_out), np.concatenate(nodes_out)


_LLAMA3_RATE = sum(c.weight for c in LLAMA3_CAUSES) / (LLAMA3_NODES * LLAMA3_DAYS)
PRESETS: dict[str, FailureModel] = {
    "llama3": FailureModel(
        name="llama3",
        rate_per_node_day=_LLAMA3_RATE,
        planned_per_node_day=LLAMA3_PLANNED / (LLAMA3_NODES * LLAMA3_DAYS),
        source="Llama 3 (arXiv:2407.21783) Table 5: 419 unexpected + 47 planned in 54 days, 2,048 nodes",
    ),
    "meta-high": FailureModel(
        name="meta-high",
        rate_per_node_day=6.50e-3,
        source="Kokolis et al. (arXiv:2410.21680): 6.50 failures per 1,000 node-days; Llama 3 cause mix",
    ),
    "meta-low": FailureModel(
        name="meta-low",
        rate_per_node_day=2.34e-3,
        source="Kokolis et al. (arXiv:2410.21680): 2.34 failures per 1,000 node-days; Llama 3 cause mix",
    ),
}


def preset(name: str) -> FailureModel:
    require(name in PRESETS, f"unknown failure preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


@dataclass(frozen=True, kw_only=True)
class TraceFailures:
    """Replay a spot trace: each node removal is a ``spot preemption`` of one job node.

    Trace nodes are mapped to job node positions in order of first appearance (modulo the job's
    node count); a trace shorter than the run is repeated. ``notice_s`` > 0 makes preemptions
    planned (the cloud's notice lets a strategy migrate live).
    """

    trace: NodeTrace
    notice_s: float = 0.0

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents:
        del rng  # a replay is deterministic
        cause = Cause(
            name=SPOT_PREEMPTION.name, weight=1, kind=SPOT_PREEMPTION.kind, planned=self.notice_s > 0
        )
        t_rm, names = self.trace.removals()
        require(len(t_rm) > 0, f"trace {self.trace.name!r} has no removals to replay")
        pos = {name: i % job.num_nodes for i, name in enumerate(self.trace.node_order())}
        period = max(self.trace.duration_s, float(t_rm[-1]) + 1.0)
        reps = math.ceil(job.horizon_s / period)
        times = np.concatenate([t_rm + k * period for k in range(reps)])
        nodes = np.tile(np.array([pos[nm] for nm in names], dtype=np.int64), reps)
        keep = times < job.horizon_s
        times, nodes = times[keep], nodes[keep]
        return FailureEvents(
            time=times,
            node=nodes,
            cause=np.zeros(len(times), dtype=np.int64),
            lemon=np.zeros(len(times), dtype=np.bool_),
            causes=(cause,),
        )


def cause_names(causes: Sequence[Cause]) -> list[str]:
    return [c.name for c in causes]
