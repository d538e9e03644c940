"""Fail-slow events and degraded-before-failure signals: the failures that warn, or only slow.

A **fail-slow** rank is alive and heartbeating but computes ``factor`` x slower than its peers
(thermal throttling, a degraded link, a noisy neighbour). A synchronous job runs at the pace of
its slowest rank, so while it lasts the whole job progresses at ``1 / factor`` of its rate: the
engine books ``dt x (1 - 1/factor)`` of every job GPU to the cause ``fail-slow``, stage
``fail_slow``. It ends when its duration is over, when its node is replaced (a failure the
strategy answers with a new machine), or when the strategy moves the rank away
(:class:`~nonstop.sim.api.Proactive`; nonstop asks the runtime's detector and proactive policy,
:func:`detection_steps` and :mod:`nonstop.sim.nonstop_strategy`).

A **degraded-before-failure** signal: a share of the hardware failures (causes the control plane
sees as a lost node, unplanned) are preceded by a detectable degraded signal (ECC error trends,
throttling, Xid events: what the runtime's health probes report) ``lead_s`` before the failure.
A strategy that drains a degraded node in time turns that unplanned failure into a planned live
migration (nothing rolled back, no restart).

Sources (docs/simulator.md, "Fail-slow and degraded signals", has the same table):

* Durations from tens of seconds to nearly ten hours; fail-slows delay large jobs by 1.34x on
  average; detected with > 99% accuracy: Wu et al., "FALCON: Pinpointing and Mitigating
  Stragglers for Large-Scale Hybrid-Parallel Training", arXiv:2410.12588 (a production cluster of
  over 10,000 GPUs at Alibaba; published as "Greyhound: Hunting Fail-Slows in Hybrid-Parallel
  Training at Scale", USENIX ATC '25, whose abstract says "sub-minutes to nearly ten hours"). The
  range is theirs; the log-uniform shape over it is **our assumption** (most fail-slows are
  short, a few last hours, as the range suggests; the paper's distribution was not checked).
* The rate per GPU-hour: **an assumption**, as frequent as a fail-stop under Llama 3's rate
  (419 unexpected interruptions / (16,384 GPUs x 54 days x 24 h) = 1.97e-5 per GPU-hour,
  arXiv:2407.21783 Table 5). FALCON calls fail-slows "common" but we could not verify a
  published per-GPU rate. With these shapes an unmitigated 16,384-GPU job loses about a fifth of
  its time to fail-slows (BENCHMARKS.md), the order of FALCON's 1.34x delay of large jobs.
* The slowdown factor: uniform on [1.2, 3]: **an assumption** (the issue's "2-3x slower";
  FALCON's 1.34x is a delay of whole jobs, not one rank's factor). Below the runtime's detection
  factor (1.5) a slow rank is never flagged, as on a real job.
* Degraded-before-failure: **assumptions**, 20% of hardware failures, 10 minutes ahead. Liu et
  al., "Prediction of GPU Failures Under Deep Learning Workloads" (arXiv:2201.11853) reach 84%
  precision predicting GPU failures from production telemetry, which says failures can be
  foreseen, but neither the share of failures foreseen (recall) nor the lead time was verified
  here. A blog's "ECC trends predict failure 48-72 h ahead" (attributed to Meta) was not found
  in a paper and is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from nonstop.policy import straggler
from nonstop.policy.decisions import FailureKind
from nonstop.policy.straggler import StragglerConfig, StragglerVerdict
from nonstop.sim.api import FailureEvents, JobSpec, SlowEvents, require
from nonstop.sim.failures import SPOT_PREEMPTION

__all__ = [
    "DEFAULT_FAILSLOW",
    "FailSlowModel",
    "WithFailSlow",
    "detection_steps",
]

LLAMA3_PER_GPU_HOUR = 419 / (16_384 * 54 * 24)  # Llama 3 Table 5: fail-stops per GPU-hour


@dataclass(frozen=True, kw_only=True)
class FailSlowModel:
    """Fail-slow events (Poisson per GPU, job-wide) and degraded-before-failure signals.

    ``rate_per_gpu_hour``: fail-slow events per GPU-hour. ``factor_min``/``factor_max``: the slow
    rank's compute time over its peers', uniform. ``duration_min_s``/``duration_max_s``: how long
    one lasts, log-uniform. ``warned_fraction``: share of the hardware failures (unplanned, node
    lost) preceded by a degraded signal, ``lead_s`` seconds before. Every default's source or
    reasoning is in the module docstring.
    """

    rate_per_gpu_hour: float = LLAMA3_PER_GPU_HOUR
    factor_min: float = 1.2
    factor_max: float = 3.0
    duration_min_s: float = 30.0
    duration_max_s: float = 10 * 3600.0
    warned_fraction: float = 0.2
    lead_s: float = 600.0

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.rate_per_gpu_hour) and self.rate_per_gpu_hour >= 0,
            f"--fail-slow-rate must be >= 0 per GPU-hour; got {self.rate_per_gpu_hour}",
        )
        require(
            1.0 <= self.factor_min <= self.factor_max,
            f"fail-slow factors must satisfy 1 <= min <= max; got {self.factor_min}, {self.factor_max}",
        )
        require(
            0 < self.duration_min_s <= self.duration_max_s,
            "fail-slow durations must satisfy 0 < min <= max",
        )
        require(
            0 <= self.warned_fraction <= 1,
            f"--warned-fraction must be in [0, 1]; got {self.warned_fraction}",
        )
        require(self.lead_s >= 0, f"--lead-s must be >= 0; got {self.lead_s}")

    def sample_slow(self, job: JobSpec, rng: np.random.Generator) -> SlowEvents:
        """Every fail-slow event of the run: Poisson in time, a uniform node, its factor and
        duration (vectorised)."""
        count = rng.poisson(self.rate_per_gpu_hour * job.num_gpus * job.horizon_s / 3600.0)
        times = np.sort(rng.uniform(0.0, job.horizon_s, size=count))
        nodes = rng.integers(0, job.num_nodes, size=count)
        factors = rng.uniform(self.factor_min, self.factor_max, size=count)
        lo, hi = math.log(self.duration_min_s), math.log(self.duration_max_s)
        durations = np.exp(rng.uniform(lo, hi, size=count))
        return SlowEvents(time=times, node=nodes.astype(np.int64), factor=factors, duration_s=durations)

    def sample_leads(self, events: FailureEvents, rng: np.random.Generator) -> np.ndarray:
        """Per failure, the lead of its degraded signal (0: none): a ``warned_fraction`` share of
        the unplanned lost-node failures, ``lead_s`` ahead (a spot preemption is not a failing
        machine: it gives no degraded signal; its notice is ``--spot-notice-s``)."""
        hardware = np.array(
            [
                c.kind is FailureKind.NODE_LOST and not c.planned and c.name != SPOT_PREEMPTION.name
                for c in events.causes
            ],
            dtype=np.bool_,
        )
        eligible = hardware[events.cause] if len(events) else np.zeros(0, dtype=np.bool_)
        warned = eligible & (rng.uniform(size=len(events)) < self.warned_fraction)
        return np.where(warned, self.lead_s, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "rate_per_gpu_hour": self.rate_per_gpu_hour,
            "factor": [self.factor_min, self.factor_max],
            "duration_s": [self.duration_min_s, self.duration_max_s],
            "warned_fraction": self.warned_fraction,
            "lead_s": self.lead_s,
            "sources": {
                "duration_range": "Wu et al., FALCON arXiv:2410.12588 / Greyhound ATC'25: tens of "
                "seconds to nearly ten hours (log-uniform shape: assumption)",
                "rate": "assumption: as frequent as a fail-stop at Llama 3's rate (arXiv:2407.21783)",
                "factor": "assumption: uniform 1.2-3x",
                "warned_fraction": "assumption (Liu et al. arXiv:2201.11853: failures predictable, "
                "84% precision; recall not verified)",
                "lead_s": "assumption",
            },
        }


DEFAULT_FAILSLOW = FailSlowModel()


@dataclass(frozen=True, kw_only=True)
class WithFailSlow:
    """An event source (:class:`~nonstop.sim.engine.EventSource`) that adds fail-slow events and
    degraded signals to another's failures. The base draws first from the same generator, so its
    failures are the same with or without this wrapper (common random numbers)."""

    base: Any  # an EventSource
    model: FailSlowModel = DEFAULT_FAILSLOW

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents:
        events: FailureEvents = self.base.sample(job, rng)
        slow = self.model.sample_slow(job, rng)
        return replace(events, lead_s=self.model.sample_leads(events, rng), slow=slow)


def detection_steps(
    config: StragglerConfig, factor: float, *, step_s: float, peers: int = 3
) -> tuple[int, StragglerVerdict] | None:
    """Slow steps after which the runtime's detector flags a rank computing ``factor`` x
    ``step_s`` where its peers compute ``step_s``, and its verdict (None: never flagged), replayed
    through the runtime's own tracker (:class:`~nonstop.policy.straggler.StragglerTracker`,
    called through its module): a window of ordinary steps, then slow ones until ``judge`` flags
    the rank. Three peers stand for the job (a rank is judged against the median of the others,
    which a job's thousands of healthy peers give the same)."""
    tracker = straggler.StragglerTracker(config)
    ranks = list(range(peers + 1))  # rank 0 turns slow
    step = 0
    for step in range(config.window):
        for r in ranks:
            tracker.record(r, step, step_s)
    for k in range(1, 2 * config.window + 1):
        step += 1
        for r in ranks:
            tracker.record(r, step, factor * step_s if r == 0 else step_s)
        verdict = tracker.judge(ranks).get(0)
        if verdict is not None:
            return k, verdict
    return None
