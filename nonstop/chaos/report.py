"""The chaos soak's report: the faults as they happened, counts and recovery times per kind, what
the checks found (what ``--json`` writes and the summary printed)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FaultRecord", "mttr_by_kind", "percentile", "summary_lines"]


@dataclass(kw_only=True)
class FaultRecord:
    """One injected fault: ``time`` (unix) it was injected, ``recovery_s`` until the job trained
    again at full size past its committed step, ``ready_s`` until it was whole again (nodes back,
    spares ready) for the next fault, ``detail`` what was done and what the job did."""

    index: int
    kind: str
    episode: int
    time: float
    recovery_s: float | None = None
    ready_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    ok: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def mttr_by_kind(faults: list[FaultRecord]) -> dict[str, dict[str, float | int | None]]:
    """Per kind: how many faults recovered, the median and p95 of their recovery seconds."""
    by: dict[str, list[float]] = {}
    for f in faults:
        if f.recovery_s is not None:
            by.setdefault(f.kind, []).append(f.recovery_s)
    return {
        k: {
            "n": len(v),
            "median_s": round(statistics.median(v), 3),
            "p95_s": round(percentile(v, 95) or 0.0, 3),
            "max_s": round(max(v), 3),
        }
        for k, v in sorted(by.items())
    }


def build(
    *,
    faults: list[FaultRecord],
    failures: list[str],
    lost: int,
    equal: bool | None,
    leaked_segments: list[str],
    leaked_processes: list[int],
    **extra: Any,
) -> dict[str, Any]:
    return {
        **extra,
        "faults": [f.to_json() for f in faults],
        "kinds": dict(sorted(Counter(f.kind for f in faults).items())),
        "mttr": mttr_by_kind(faults),
        "lost_committed_steps": lost,
        "equal": equal,
        "leaked_segments": leaked_segments,
        "leaked_processes": leaked_processes,
        "failures": failures,
        "ok": not failures,
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    out = [
        f"chaos: {len(report['faults'])} faults in {report.get('episodes', '?')} jobs, "
        f"{report.get('duration_s', 0):.0f}s; lost committed steps {report['lost_committed_steps']}, "
        f"bitwise equal {report['equal']}, leaked segments {len(report['leaked_segments'])}, "
        f"leaked processes {len(report['leaked_processes'])}"
    ]
    for kind, m in report["mttr"].items():
        out.append(f"  {kind:12s} n={m['n']:<4} recovery median {m['median_s']:.2f}s  p95 {m['p95_s']:.2f}s")
    for kind, why in (report.get("skipped_kinds") or {}).items():
        out.append(f"  {kind:12s} skipped: {why}")
    return out
