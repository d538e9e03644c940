"""What a run reports: ETTR, goodput, lost GPU-hours by cause and by stage; JSON, tables, plots.

* **ETTR** (effective training time ratio): useful GPU-seconds / (job GPUs x wall seconds).
* **goodput**: useful GPU-seconds per wall second (ETTR x job GPUs; multiply by one GPU's
  samples/s for samples/s), and per *provisioned* GPU (spares included): the figure to compare
  strategies that buy their ETTR with spare GPUs.
* **lost GPU-hours** by cause (``steady`` = overhead paid even without failures) and by stage
  (the runtime's recovery stages + ``replan``, ``lost_work``, ``overhead``, ``shrunk``).
* **fail-slow** (``--fail-slow``): the slowdowns replayed, the proactive moves by reason
  (``straggler``, ``degraded``), and what they are worth: nonstop's ETTR with them against
  nonstop without them (:data:`NO_PROACTIVE_NAME`, the same failures and slowdowns).
* **elastic**: wall hours per day the job trained shrunk (fewer data-parallel ranks), its
  throughput meanwhile (progress per wall second in seconds of the full-size job: 1.0 = full
  speed with no overhead), and the count of each resize (wait / shrink / fail / grow).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nonstop.plotting import pyplot, save_figure
from nonstop.sim.api import STAGES, SimResult

__all__ = [
    "NO_PROACTIVE_NAME",
    "aggregate",
    "failslow_summary",
    "markdown_table",
    "plot_results",
    "result_json",
]

NO_PROACTIVE_NAME = "nonstop no-proactive"  # nonstop detecting slow ranks and degraded nodes, moving none


def result_json(r: SimResult) -> dict[str, Any]:
    hours = 3600.0 * r.job.days
    return {
        "strategy": r.strategy,
        "seed": r.seed,
        "job": {
            "num_gpus": r.job.num_gpus,
            "gpus_per_node": r.job.gpus_per_node,
            "num_nodes": r.job.num_nodes,
            "days": r.job.days,
            "state_bytes_per_gpu": r.job.state_bytes_per_gpu,
            "step_s": r.job.step_s,
            "nodes_per_domain": r.job.nodes_per_domain,
        },
        "ettr": r.ettr,
        "goodput_gpus": r.goodput_gpus,
        "goodput_per_provisioned_gpu": r.goodput_per_provisioned_gpu,
        "spare_gpus": r.spare_gpus,
        "lost_gpu_hours_per_day": r.lost_gpu_hours_per_day(),
        "lost_gpu_hours_per_day_by_stage": {k: v / hours for k, v in r.lost_by_stage.items()},
        "lost_gpu_hours_per_day_by_cause": {k: v / hours for k, v in sorted(r.lost_by_cause.items())},
        "shrunk_hours_per_day": r.shrunk_s / hours,
        "shrunk_throughput": r.shrunk_throughput,
        "resizes": r.resizes,
        "slowdowns": r.slowdowns,
        "proactive_moves": r.proactive,
        "failures": r.failures,
        "failures_by_cause": dict(sorted(r.failures_by_cause.items(), key=lambda kv: -kv[1])),
        "actions": r.actions,
        "tiers": r.tiers,
        "replacements": r.replacements,
        "sim_wall_s": r.wall_s,
        "params": r.params,
    }


def aggregate(runs: Sequence[SimResult]) -> dict[str, Any]:
    """Median and min-max over runs of one strategy (different seeds)."""
    ettr = [r.ettr for r in runs]
    lost = [r.lost_gpu_hours_per_day() for r in runs]
    return {
        "strategy": runs[0].strategy,
        "runs": len(runs),
        "ettr": {"median": statistics.median(ettr), "min": min(ettr), "max": max(ettr)},
        "lost_gpu_hours_per_day": {"median": statistics.median(lost), "min": min(lost), "max": max(lost)},
        "goodput_per_provisioned_gpu": statistics.median(r.goodput_per_provisioned_gpu for r in runs),
        "shrunk_hours_per_day": statistics.median(r.shrunk_s / 3600.0 / r.job.days for r in runs),
    }


def markdown_table(results: Sequence[SimResult]) -> str:
    head = (
        "| strategy | ETTR | lost GPU-h/day | failures | spare GPUs | goodput / provisioned GPU "
        "| biggest loss |"
    )
    rows = [head, "|---|---|---|---|---|---|---|"]
    for r in results:
        by_stage = r.lost_by_stage
        top = max(by_stage, key=lambda s: by_stage[s])
        share = by_stage[top] / max(sum(by_stage.values()), 1e-12)
        rows.append(
            f"| {r.strategy} | {r.ettr:.4f} | {r.lost_gpu_hours_per_day():,.0f} | {r.failures} | "
            f"{r.spare_gpus} | {r.goodput_per_provisioned_gpu:.4f} | {top} ({share:.0%}) |"
        )
    return "\n".join(rows)


def failslow_summary(results: Sequence[SimResult]) -> str:
    """Per strategy, the GPU-hours/day lost to slow ranks and the proactive moves; then what the
    moves are worth (nonstop against :data:`NO_PROACTIVE_NAME`), when both ran."""
    lines = []
    for r in results:
        hours = 3600.0 * r.job.days
        slow = r.lost_by_stage.get("fail_slow", 0.0) / hours
        moved = r.lost_by_stage.get("proactive_migration", 0.0) / hours
        moves = ", ".join(f"{k} {v}" for k, v in sorted(r.proactive.items())) or "none"
        lines.append(
            f"{r.strategy}: {r.slowdowns} slowdowns, {slow:,.0f} GPU-h/day lost to slow ranks; "
            f"proactive moves: {moves} ({moved:,.0f} GPU-h/day of pauses)"
        )
    by_name = {r.strategy: r for r in results}
    on, off = by_name.get("nonstop"), by_name.get(NO_PROACTIVE_NAME)
    if on is not None and off is not None:
        saved = off.lost_gpu_hours_per_day() - on.lost_gpu_hours_per_day()
        lines.append(
            f"proactive migration is worth {on.ettr - off.ettr:+.4f} ETTR ({on.ettr:.4f} with, "
            f"{off.ettr:.4f} without): {saved:,.0f} GPU-h/day at {on.job.num_gpus:,} GPUs"
        )
    return "\n".join(lines)


def plot_results(results: Sequence[SimResult], path: Path, *, title: str = "") -> Path:
    """One figure, three panels: ETTR per strategy; lost GPU-hours/day by stage (stacked);
    lost GPU-hours/day by cause (the 8 biggest)."""
    plt = pyplot()
    names = [r.strategy for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), gridspec_kw={"width_ratios": [1, 1.3, 1.6]})
    ax = axes[0]
    bars = ax.bar(names, [r.ettr for r in results], color=["#888888", "#d08c3c", "#2a7ab0"][: len(results)])
    for b, r in zip(bars, results, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, r.ettr, f"{r.ettr:.3f}", ha="center", va="bottom")
    lo = min(r.ettr for r in results)
    ax.set_ylim(max(0.0, lo - (1 - lo) * 0.6 - 0.01), 1.0)
    ax.set_ylabel("ETTR (useful / wall GPU time)")
    ax.set_title("ETTR: higher is better")

    ax = axes[1]
    hours = [3600.0 * r.job.days for r in results]
    bottom = [0.0] * len(results)
    cmap = plt.get_cmap("tab10")
    for i, stage in enumerate(STAGES):
        vals = [r.lost_by_stage.get(stage, 0.0) / h for r, h in zip(results, hours, strict=True)]
        if not any(v > 0 for v in vals):
            continue
        ax.bar(names, vals, bottom=bottom, label=stage, color=cmap(i))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("lost GPU-hours per day")
    ax.set_title("where the time goes (by stage)")
    ax.legend(fontsize=8)

    ax = axes[2]
    totals: dict[str, float] = {}
    for r in results:
        for c, v in r.lost_by_cause.items():
            totals[c] = totals.get(c, 0.0) + v
    top = sorted(totals, key=lambda c: -totals[c])[:8]
    width = 0.8 / len(results)
    ys = range(len(top))
    for j, (r, h) in enumerate(zip(results, hours, strict=True)):
        ax.barh(
            [y + j * width for y in ys],
            [r.lost_by_cause.get(c, 0.0) / h for c in top],
            height=width,
            label=r.strategy,
        )
    ax.set_yticks([y + 0.4 - width / 2 for y in ys], top)
    ax.invert_yaxis()
    ax.set_xlabel("lost GPU-hours per day")
    ax.set_title("by cause (8 biggest)")
    ax.legend(fontsize=8)
    return save_figure(fig, path, title)
