"""Scripted failures for the simulator's tests: given times, node positions and one cause."""

from __future__ import annotations

import numpy as np

from nonstop.policy.decisions import FailureKind
from nonstop.sim.api import FailureEvents, JobSpec
from nonstop.sim.failures import Cause

NODE_LOSS = Cause(name="node", weight=1, kind=FailureKind.NODE_LOST)


class Scripted:
    """An event source: failures at the given ``(time, node position)`` pairs, all of ``cause``."""

    def __init__(self, *failures: tuple[float, int], cause: Cause = NODE_LOSS) -> None:
        self.cause = cause
        self.failures = failures

    def sample(self, job: JobSpec, rng: np.random.Generator) -> FailureEvents:
        del job, rng
        n = len(self.failures)
        return FailureEvents(
            time=np.array([t for t, _ in self.failures], dtype=np.float64),
            node=np.array([k for _, k in self.failures], dtype=np.int64),
            cause=np.zeros(n, dtype=np.int64),
            lemon=np.zeros(n, dtype=np.bool_),
            causes=(self.cause,),
        )
