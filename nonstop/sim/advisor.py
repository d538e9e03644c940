"""``nonstop advise``: pick nonstop's settings for a cluster, and show the goodput frontier.

Search, in two stages (replication x snapshot interval x persist interval at the default spare
count, then the spare count for each replication factor's best); every candidate is simulated
with the same failures (common random numbers), so the comparison is not drowned in noise:

* replication factor r, under the host-memory budget: each node holds its own 2 snapshot slots
  and r other nodes' replicas, ``gpus_per_node x state_bytes x (2 + r)`` bytes;
* snapshot interval (every k steps): stall / k against ~k/2 steps redone per in-memory restore;
  1, 2, 4, 8 and Daly's optimum for one snapshot's stall and the job's MTBF, with its half and
  its double (:func:`snapshot_intervals`: a job that rarely fails snapshots less often), and
  with rescue snapshots (on by default: a failure redoes only the step in flight) 16, 32, 64;
  and the runtime's default, the interval tuned to ``--snapshot-budget``
  (:data:`~nonstop.policy.cadence.DEFAULT_BUDGET`);
* persist interval: at least ``10 x`` the time one persist takes (the durable tier stays <= 10%
  busy), and the multiples 2x, 4x of that;
* spare nodes: 0 up to ~5% of the job's nodes;
* elasticity (a third stage, on the best setting so far, with the spare scan again): off, or
  ``--min-world-size`` at 90% of the GPUs with ``--shards-per-rank`` 1 or 4 (a lost node no hot
  spare can take is dropped and the job trains on shrunk instead of waiting for the scheduler's
  pool; the runtime's ``--survivors auto`` decides per failure whether to shrink first), and
  where the user accepts it (``--may-drop-batch``) ``--shrink-batch drop``: the shrunk job skips
  the lost ranks' shares of the batch, torchft's semantics, instead of playing them slower.

The objective is goodput per *provisioned* GPU (spares cost GPUs). With an ETTR goal
(``--ettr-goal``) it is the best goodput per provisioned GPU among the settings that reach the
goal, and where none does, the highest ETTR (:func:`ranking`). The frontier is, for each host
memory level (each r), the best setting so ranked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nonstop.plotting import pyplot, save_figure
from nonstop.policy.cadence import DEFAULT_BUDGET
from nonstop.sim.api import JobSpec, SimResult, default_spare_nodes, require
from nonstop.sim.calibrate import Calibration
from nonstop.sim.engine import simulate
from nonstop.sim.failslow import FailSlowModel, WithFailSlow
from nonstop.sim.failures import FailureModel
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.proactivesim import NO_PROACTIVE
from nonstop.sim.theory import daly_interval

__all__ = [
    "Advice",
    "Candidate",
    "ProactiveWorth",
    "advise",
    "plot_frontier",
    "proactive_worth",
    "ranking",
    "snapshot_intervals",
]

MAX_SNAPSHOT_EVERY = 1024
RESCUE_INTERVALS = (16, 32, 64)
"""The longest snapshot interval the advisor tries, in steps."""


def snapshot_intervals(
    job: JobSpec, model: FailureModel, calibration: Calibration, *, rescue: bool = False
) -> list[int]:
    """The snapshot intervals (steps) the advisor tries: 1, 2, 4, 8, and Daly's optimum
    (:func:`~nonstop.sim.theory.daly_interval`) for one snapshot's stall at this job's state and
    step against the job's MTBF under ``model``, with its half and its double, at most
    :data:`MAX_SNAPSHOT_EVERY`. The stall per snapshot plays the checkpoint's cost and a rollback
    the lost work, as in Young's and Daly's derivation; the simulation then decides. ``rescue``
    (the runtime's rescue snapshots, policy/rescue.py): a failure in memory rolls back only the
    step in flight whatever the interval, so longer ones are tried too (:data:`RESCUE_INTERVALS`;
    longer still saves a stall already under 0.1 % of a step at the defaults)."""
    out = {1, 2, 4, 8, *(RESCUE_INTERVALS if rescue else ())}
    stall = calibration.snapshot_stall_s(job.state_bytes_per_gpu, job.step_s)
    rate = model.job_rate_per_s(job.num_nodes)
    if stall > 0 and rate > 0:
        steps = daly_interval(ckpt_s=stall, mtbf_s=1.0 / rate) / job.step_s
        out |= {min(MAX_SNAPSHOT_EVERY, max(1, round(steps * f))) for f in (0.5, 1.0, 2.0)}
    return sorted(out)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    replicas: int
    snapshot_every: int  # the interval, steps: fixed, or the one the budget chose
    persist_every_s: float
    spare_nodes: int
    host_bytes_per_node: float
    ettr: float
    goodput_per_provisioned_gpu: float
    min_world_size: int = 0  # 0: not elastic
    shards_per_rank: int = 1
    shrink_batch: str = "keep"
    replica_nodes: int | None = None  # the job's layout (NonstopParams.replica_nodes), not searched
    snapshot_budget: float = 0.0  # > 0: the interval tuned to this stall budget; 0: fixed

    @property
    def interval(self) -> tuple[int, float]:
        """(``--snapshot-every``, ``--snapshot-budget``): a budget's floor is 1."""
        return (1, self.snapshot_budget) if self.snapshot_budget > 0 else (self.snapshot_every, 0.0)

    @property
    def snapshots(self) -> str:
        """The interval, as the table and the advice print it."""
        if self.snapshot_budget > 0:
            return f"{self.snapshot_every} steps (--snapshot-budget {self.snapshot_budget:g})"
        return f"{self.snapshot_every} steps"

    def params(self) -> NonstopParams:
        """nonstop's settings this candidate stands for."""
        every, budget = self.interval
        return NonstopParams(
            replicas=self.replicas,
            snapshot_every=every,
            snapshot_budget=budget,
            persist_every_s=self.persist_every_s,
            spare_nodes=self.spare_nodes,
            min_world_size=self.min_world_size,
            shards_per_rank=self.shards_per_rank,
            shrink_batch=self.shrink_batch,
            replica_nodes=self.replica_nodes,
        )

    @property
    def elastic(self) -> str:
        if not self.min_world_size:
            return "off"
        if self.shrink_batch == "drop":
            return f">= {self.min_world_size:,} GPUs, shrunk batch dropped"
        return f">= {self.min_world_size:,} GPUs, {self.shards_per_rank} shard(s)/rank"

    def to_json(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "snapshot_every": self.snapshot_every,
            "snapshot_budget": self.snapshot_budget,
            "persist_every_s": self.persist_every_s,
            "spare_nodes": self.spare_nodes,
            "min_world_size": self.min_world_size,
            "shards_per_rank": self.shards_per_rank,
            "shrink_batch": self.shrink_batch,
            "host_gb_per_node": self.host_bytes_per_node / 1e9,
            "ettr": self.ettr,
            "goodput_per_provisioned_gpu": self.goodput_per_provisioned_gpu,
        }


def ranking(goal: float | None) -> Callable[[Candidate], tuple[bool, float]]:
    """The advisor's order of candidates, highest best: goodput per provisioned GPU; with an ETTR
    ``goal``, the candidates that reach it first (by goodput per provisioned GPU), then the others
    by ETTR (the closest to the goal)."""

    def key(c: Candidate) -> tuple[bool, float]:
        if goal is None:
            return (True, c.goodput_per_provisioned_gpu)
        met = c.ettr >= goal
        return (met, c.goodput_per_provisioned_gpu if met else c.ettr)

    return key


@dataclass(frozen=True, kw_only=True)
class Advice:
    best: Candidate
    frontier: list[Candidate]
    candidates: list[Candidate]
    rejected_for_memory: list[int]
    goal: float | None = None  # the ETTR goal asked for (--ettr-goal), if any

    @property
    def goal_met(self) -> bool | None:
        """Whether the chosen setting reaches the ETTR goal (None: no goal)."""
        return None if self.goal is None else self.best.ettr >= self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "ettr_goal": self.goal,
            "goal_met": self.goal_met,
            "best": self.best.to_json(),
            "frontier": [c.to_json() for c in self.frontier],
            "rejected_replicas_for_memory": self.rejected_for_memory,
            "candidates_evaluated": len(self.candidates),
        }

    def table(self) -> str:
        rows = [
            "| replicas | host GB/node | snapshot every | persist every | spare nodes | elastic | ETTR "
            "| goodput/provisioned GPU |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in self.frontier:
            mark = " **(chosen)**" if c == self.best else ""
            rows.append(
                f"| {c.replicas} | {c.host_bytes_per_node / 1e9:,.0f} | {c.snapshots} | "
                f"{c.persist_every_s:,.0f} s | {c.spare_nodes} | {c.elastic} | {c.ettr:.4f} | "
                f"{c.goodput_per_provisioned_gpu:.4f}{mark} |"
            )
        return "\n".join(rows)


def host_bytes(job: JobSpec, replicas: int) -> float:
    return job.gpus_per_node * job.state_bytes_per_gpu * (2 + replicas)


def advise(
    *,
    job: JobSpec,
    model: FailureModel,
    calibration: Calibration,
    host_budget_bytes: float,
    seeds: tuple[int, ...] = (0, 1),
    max_replicas: int = 3,
    may_drop_batch: bool = False,
    replica_nodes: int | None = None,
    goal: float | None = None,
) -> Advice:
    """Evaluate the grid (see module docstring) and return the best setting and the frontier
    (``goal``: an ETTR to reach, :func:`ranking`).
    ``may_drop_batch``: the user accepts ``--shrink-batch drop`` (a shrunk job trains fewer samples
    per step until it grows back, as torchft's does), so stage 3 tries it too. ``replica_nodes``:
    the job's layout (:class:`~nonstop.sim.nonstop_params.NonstopParams`; None: torchft-like's)."""
    require(host_budget_bytes > 0, "--host-mem-gb must be > 0")
    require(goal is None or 0.0 < goal < 1.0, f"--ettr-goal must be a fraction in (0, 1) (got {goal})")
    rank = ranking(goal)
    feasible = [r for r in range(max_replicas + 1) if host_bytes(job, r) <= host_budget_bytes]
    require(
        bool(feasible),
        f"two snapshot slots of {job.gpus_per_node} x {job.state_bytes_per_gpu / 1e9:.1f} GB need "
        f"{host_bytes(job, 0) / 1e9:.0f} GB of host memory per node: raise --host-mem-gb",
    )
    rejected = [r for r in range(max_replicas + 1) if r not in feasible]
    write = calibration.durable_write_s(job.state_bytes_per_gpu, job.num_gpus, job.gpus_per_node)
    base_persist = max(10 * write, 300.0)
    persists = [base_persist, 2 * base_persist, 4 * base_persist]
    top = max(1, math.ceil(0.05 * job.num_nodes))
    spares = sorted({0, 1, 2, 4, *(2**i for i in range(3, 16) if 2**i <= top), top})
    # fixed intervals, and the runtime's default: tuned to its stall budget
    fixed = snapshot_intervals(job, model, calibration, rescue=NonstopParams().rescue)
    snaps = [*((k, 0.0) for k in fixed), (1, DEFAULT_BUDGET)]
    evaluated: dict[tuple[int, tuple[int, float], float, int, int, int, str], Candidate] = {}

    def run(
        r: int, k: tuple[int, float], pe: float, s: int, floor: int = 0, m: int = 1, batch: str = "keep"
    ) -> Candidate | None:
        key = (r, k, pe, s, floor, m, batch)
        if key not in evaluated:
            params = NonstopParams(
                replicas=r,
                snapshot_every=k[0],
                snapshot_budget=k[1],
                persist_every_s=pe,
                spare_nodes=s,
                min_world_size=floor,
                shards_per_rank=m,
                shrink_batch=batch,
                replica_nodes=replica_nodes,
            )
            try:
                strat = Nonstop(job=job, params=params, calibration=calibration)
            except ValueError:
                return None  # e.g. the stall does not fit in the step
            runs: list[SimResult] = [simulate(job, model, strat, seed=seed) for seed in seeds]
            evaluated[key] = Candidate(
                replicas=r,
                snapshot_every=strat.every,
                snapshot_budget=k[1],
                persist_every_s=pe,
                spare_nodes=s,
                host_bytes_per_node=host_bytes(job, r),
                ettr=sum(x.ettr for x in runs) / len(runs),
                goodput_per_provisioned_gpu=sum(x.goodput_per_provisioned_gpu for x in runs) / len(runs),
                min_world_size=floor,
                shards_per_rank=m,
                shrink_batch=batch,
                replica_nodes=replica_nodes,
            )
        return evaluated[key]

    # stage 1: replicas x snapshot interval x persist interval, at the default spare count;
    # stage 2: for each replication factor's best, the number of spares.
    default_spares = default_spare_nodes(job.num_nodes)
    for r, k, pe in itertools.product(feasible, snaps, persists):
        run(r, k, pe, default_spares)
    for r in feasible:
        mine = [c for c in evaluated.values() if c.replicas == r]
        if mine:
            b = max(mine, key=rank)
            for s in spares:
                run(r, b.interval, b.persist_every_s, s)
    # stage 3: elasticity on the best so far, the spare count scanned again (shrinking instead of
    # waiting for the pool may need fewer spares)
    so_far = max(evaluated.values(), key=rank, default=None)
    floor = int(0.9 * job.num_gpus)
    if so_far is not None and 0 < floor < job.num_gpus:
        # drop: a shrunk step is as fast whatever the shards per rank; keep: more spread thinner
        shapes = [(1, "keep"), (4, "keep"), *([(1, "drop")] if may_drop_batch else [])]
        for (m, batch), s in itertools.product(shapes, spares):
            run(so_far.replicas, so_far.interval, so_far.persist_every_s, s, floor, m, batch)
    out = list(evaluated.values())
    require(bool(out), "no feasible setting: the snapshot stall exceeds the step time at every interval")
    frontier = []
    for r in feasible:
        mine = [c for c in out if c.replicas == r]
        if mine:
            frontier.append(max(mine, key=rank))
    best = max(frontier, key=lambda c: (*rank(c), -c.host_bytes_per_node))
    return Advice(best=best, frontier=frontier, candidates=out, rejected_for_memory=rejected, goal=goal)


@dataclass(frozen=True, kw_only=True)
class ProactiveWorth:
    """nonstop's chosen setting with and without proactive moves, under fail-slow events and
    degraded signals (means over the seeds, the same failures and slowdowns for both)."""

    num_gpus: int
    ettr_with: float
    ettr_without: float
    lost_gpu_h_per_day_with: float
    lost_gpu_h_per_day_without: float
    moves_per_day: dict[str, float]

    def line(self) -> str:
        moves = ", ".join(f"{k} {v:.1f}/day" for k, v in sorted(self.moves_per_day.items())) or "none"
        saved = self.lost_gpu_h_per_day_without - self.lost_gpu_h_per_day_with
        verdict = "" if saved > 0 else " -> do not move proactively"
        gain = self.ettr_with - self.ettr_without
        return (
            f"proactive migration (fail-slow ranks, degraded nodes) at {self.num_gpus:,} GPUs: ETTR "
            f"{self.ettr_with:.4f} with, {self.ettr_without:.4f} without ({gain:+.4f}; "
            f"{saved:,.0f} GPU-h/day); moves: {moves}{verdict}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "num_gpus": self.num_gpus,
            "ettr_with": self.ettr_with,
            "ettr_without": self.ettr_without,
            "lost_gpu_hours_per_day_with": self.lost_gpu_h_per_day_with,
            "lost_gpu_hours_per_day_without": self.lost_gpu_h_per_day_without,
            "moves_per_day": self.moves_per_day,
        }


def proactive_worth(
    *,
    job: JobSpec,
    model: FailureModel,
    failslow: FailSlowModel,
    calibration: Calibration,
    params: NonstopParams | None = None,
    seeds: tuple[int, ...] = (0, 1),
) -> ProactiveWorth:
    """What proactive moves are worth to nonstop (``params``) on this job: the same runs with the
    runtime's ``--straggler migrate --on-degraded drain`` and with detection only."""
    params = params or NonstopParams()
    source = WithFailSlow(base=model, model=failslow)
    runs: dict[bool, list[SimResult]] = {}
    for moving in (True, False):
        p = params if moving else replace(params, straggler=NO_PROACTIVE)
        strat = Nonstop(job=job, params=p, calibration=calibration)
        runs[moving] = [simulate(job, source, strat, seed=s) for s in seeds]
    kinds = sorted({k for r in runs[True] for k in r.proactive})
    return ProactiveWorth(
        num_gpus=job.num_gpus,
        ettr_with=mean([r.ettr for r in runs[True]]),
        ettr_without=mean([r.ettr for r in runs[False]]),
        lost_gpu_h_per_day_with=mean([r.lost_gpu_hours_per_day() for r in runs[True]]),
        lost_gpu_h_per_day_without=mean([r.lost_gpu_hours_per_day() for r in runs[False]]),
        moves_per_day={k: mean([r.proactive.get(k, 0) / job.days for r in runs[True]]) for k in kinds},
    )


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def plot_frontier(advice: Advice, path: Path, *, title: str = "") -> Path:
    """Left: goodput per provisioned GPU vs host memory per node (each r's best); right: the
    chosen replication factor's goodput vs spare nodes."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    ax = axes[0]
    for c in advice.candidates:
        ax.scatter(c.host_bytes_per_node / 1e9, c.goodput_per_provisioned_gpu, s=6, color="#bbbbbb")
    xs = [c.host_bytes_per_node / 1e9 for c in advice.frontier]
    ys = [c.goodput_per_provisioned_gpu for c in advice.frontier]
    ax.plot(xs, ys, "o-", color="#2a7ab0", label="best per replication factor")
    for c in advice.frontier:
        ax.annotate(f"r={c.replicas}", (c.host_bytes_per_node / 1e9, c.goodput_per_provisioned_gpu))
    b = advice.best
    ax.scatter(
        [b.host_bytes_per_node / 1e9],
        [b.goodput_per_provisioned_gpu],
        s=120,
        marker="*",
        color="red",
        zorder=3,
        label="chosen",
    )
    ax.set_xlabel("host memory per node for snapshots (GB)")
    ax.set_ylabel("goodput per provisioned GPU")
    ax.set_title("goodput frontier")
    ax.legend(fontsize=8)
    ax = axes[1]
    same = [
        c
        for c in advice.candidates
        if (c.replicas, c.snapshot_every, c.persist_every_s)
        == (b.replicas, b.snapshot_every, b.persist_every_s)
    ]
    same.sort(key=lambda c: c.spare_nodes)
    ax.plot([c.spare_nodes for c in same], [c.goodput_per_provisioned_gpu for c in same], "o-")
    ax.axvline(b.spare_nodes, color="red", linestyle=":")
    ax.set_xlabel("spare nodes")
    ax.set_ylabel("goodput per provisioned GPU")
    ax.set_title(f"spares (r={b.replicas}, snapshot every {b.snapshot_every})")
    return save_figure(fig, path, title)
