"""The chaos soak's fault schedule: which faults, in which order, aimed where (pure, seeded).

A schedule of ``n`` faults over ``k`` kinds holds every kind ``n // k`` times and ``n % k`` kinds
(drawn by the seed) once more, in a seeded random order, so a soak of ``n >= k`` faults covers
every kind and the same ``--seed`` gives the same schedule. Each fault names its target (a rank,
or a node other than node 0, which hosts the launcher and the coordinator) and its parameters
(an exit code, how long etcd is stopped, ...); the driver resolves them against the running job.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ALL_KINDS", "NODE_KINDS", "Planned", "make_schedule"]

# kill/hang/exit/stall: one worker; node: a node's agent and every process of it; wipe: a rank's
# memory (its slots and every replica) then the worker; corrupt: the newest durable checkpoint's
# chunk, then a wipe (the loader must fall back); coordinator/store_stall need the store in etcd;
# partition needs root (network namespaces); migrate/preempt are planned moves during training.
ALL_KINDS = (
    "kill",
    "hang",
    "exit",
    "stall",
    "node",
    "wipe",
    "corrupt",
    "coordinator",
    "store_stall",
    "partition",
    "migrate",
    "preempt",
)
NODE_KINDS = frozenset({"node", "partition", "preempt"})  # aimed at a node (never node 0)
MAX_STORE_STALL_S = 3.0


@dataclass(frozen=True, kw_only=True)
class Planned:
    """One fault of the schedule. ``rank`` is the rank aimed at (worker kinds, migrate's rank,
    the rank a wipe or corrupt loses), ``node`` the node (node kinds; migrate's preferred target),
    ``delay_s`` how long after the job is healthy it is injected (not on a step boundary),
    ``seconds`` a store stall's length, ``code`` an exit's status."""

    index: int
    kind: str
    rank: int
    node: int
    delay_s: float
    seconds: float = 0.0
    code: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_schedule(
    n: int, seed: int, *, kinds: tuple[str, ...], nnodes: int, world_size: int
) -> list[Planned]:
    """``n`` faults of ``kinds`` (each ``n // len(kinds)`` times, the remainder drawn), shuffled
    by ``seed``, aimed at ranks ``0..world_size-1`` and nodes ``1..nnodes-1``."""
    if n < 0:
        raise ValueError(f"n must be >= 0 (got {n})")
    if not kinds:
        raise ValueError("no fault kind to schedule")
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown} (known: {', '.join(ALL_KINDS)})")
    if NODE_KINDS & set(kinds) and nnodes < 2:
        raise ValueError("node faults need >= 2 nodes (node 0 hosts the coordinator)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    rng = random.Random(seed)
    order = list(kinds) * (n // len(kinds)) + rng.sample(list(kinds), n % len(kinds))
    rng.shuffle(order)
    out = []
    for i, kind in enumerate(order):
        out.append(
            Planned(
                index=i,
                kind=kind,
                rank=rng.randrange(world_size),
                node=rng.randrange(1, nnodes) if nnodes > 1 else 0,
                delay_s=round(rng.uniform(0.0, 1.0), 3),
                seconds=round(rng.uniform(0.5, MAX_STORE_STALL_S), 3) if kind == "store_stall" else 0.0,
                code=rng.randrange(1, 100) if kind == "exit" else 1,
            )
        )
    return out
