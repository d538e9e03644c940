"""Spot-instance traces: node add/remove events and availability counts.

Two formats, both copied into ``data/traces`` with their provenance (data/traces/PROVENANCE.md):

* Bamboo (``bamboo/*.csv``): ``ms,add|remove,nodeK`` — every node joining or leaving an AWS spot
  fleet, millisecond timestamps (all multiples of 60 s).
* SkyPilot spot-traces (``skypilot/.../*.json``): ``{"metadata": {"gap_seconds": G}, "data": [...]}``,
  the number of instances available every G seconds.

Both become an :class:`Availability` series on a fixed grid (60 s by default: Parcae's planning
interval) by holding each value until the next sample.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from nonstop.errors import UsageError
from nonstop.sim.api import require

__all__ = ["TRACE_DIR", "Availability", "NodeTrace", "find_trace", "load_availability", "load_node_trace"]

TRACE_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"
BUILTIN = {
    "p3": "bamboo/p3-trace.csv",
    "g4dn": "bamboo/g4dn-trace.csv",
    "sky-us-east-2b": "skypilot/availability-16-node-aws-08-27-2023/us-east-2b_v100_1.json",
    "sky-us-west-2a": "skypilot/availability-16-node-aws-08-27-2023/us-west-2a_v100_1.json",
    "sky-us-west-2c": "skypilot/availability-16-node-aws-08-27-2023/us-west-2c_v100_1.json",
}


def find_trace(name_or_path: str) -> Path:
    """A built-in trace name (``p3``, ``g4dn``, ``sky-us-east-2b``, ...) or a file path."""
    if name_or_path in BUILTIN:
        return TRACE_DIR / BUILTIN[name_or_path]
    path = Path(name_or_path)
    require(
        path.is_file(),
        f"trace {name_or_path!r} not found; give a file path or one of {', '.join(BUILTIN)}",
    )
    return path


@dataclass(frozen=True)
class NodeTrace:
    """Node add/remove events (seconds from the trace start, +1 add / -1 remove, node name)."""

    name: str
    time_s: npt.NDArray[np.float64]
    delta: npt.NDArray[np.int64]
    node: tuple[str, ...]

    @property
    def duration_s(self) -> float:
        return float(self.time_s[-1]) if len(self.time_s) else 0.0

    def removals(self) -> tuple[npt.NDArray[np.float64], list[str]]:
        idx = np.flatnonzero(self.delta < 0)
        return self.time_s[idx], [self.node[i] for i in idx]

    def node_order(self) -> list[str]:
        seen: dict[str, None] = {}
        for n in self.node:
            seen.setdefault(n, None)
        return list(seen)

    def availability(self, interval_s: float = 60.0) -> Availability:
        """Live nodes at the end of each interval."""
        live = np.cumsum(self.delta)
        num = int(np.ceil((self.duration_s + 1e-9) / interval_s)) + 1
        grid = np.arange(num) * interval_s
        idx = np.searchsorted(self.time_s, grid, side="right") - 1
        counts = np.where(idx >= 0, live[np.maximum(idx, 0)], 0)
        return Availability(name=self.name, interval_s=interval_s, counts=counts.astype(np.float64))


@dataclass(frozen=True)
class Availability:
    """Available instances on a regular grid."""

    name: str
    interval_s: float
    counts: npt.NDArray[np.float64]

    def resample(self, interval_s: float) -> Availability:
        """Hold each sample until the next one, on a grid of ``interval_s``."""
        span = len(self.counts) * self.interval_s
        grid = np.arange(int(span // interval_s)) * interval_s
        idx = np.minimum((grid // self.interval_s).astype(np.int64), len(self.counts) - 1)
        return Availability(name=self.name, interval_s=interval_s, counts=self.counts[idx])


def load_node_trace(path: Path) -> NodeTrace:
    """A Bamboo-format CSV: ``ms,add|remove,node``."""
    times: list[float] = []
    deltas: list[int] = []
    nodes: list[str] = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            require(
                len(row) == 3 and row[1] in ("add", "remove"),
                f"{path}:{lineno}: expected 'ms,add|remove,node'; got {','.join(row)!r}",
            )
            times.append(float(row[0]) / 1000.0)
            deltas.append(1 if row[1] == "add" else -1)
            nodes.append(row[2])
    require(len(times) > 0, f"{path}: no events")
    order = np.argsort(np.array(times), kind="stable")
    return NodeTrace(
        name=path.stem,
        time_s=np.array(times)[order],
        delta=np.array(deltas, dtype=np.int64)[order],
        node=tuple(nodes[i] for i in order),
    )


def load_availability(path: Path, interval_s: float = 60.0) -> Availability:
    """Either format, as availability on a grid of ``interval_s`` seconds."""
    if path.suffix == ".csv":
        return load_node_trace(path).availability(interval_s)
    try:
        doc = json.loads(path.read_text())
        gap = float(doc["metadata"]["gap_seconds"])
        data = np.asarray(doc["data"], dtype=np.float64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: not a SkyPilot trace (metadata.gap_seconds, data): {e}") from e
    require(len(data) > 1 and gap > 0, f"{path}: trace needs gap_seconds > 0 and at least 2 samples")
    return Availability(name=path.stem, interval_s=gap, counts=data).resample(interval_s)
