"""The timeline as a picture: :func:`render_timeline` draws each row and layer with its own painter,
in a fixed order (labels drawn first keep their room)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError
from nonstop.plotting import pyplot, save_figure
from nonstop.timeline.model import Recovery, StageSpan, Timeline
from nonstop.timeline.style import (
    CATCHUP_STYLE,
    FAILURE_STYLE,
    FONT,
    MOVE_STAGE_NAMES,
    OTHER_FAILURE_STYLE,
    RENUMBERED_LABELS,
    RESIZE_STYLE,
    WAIT_COLOR,
    Canvas,
    shorten,
    stage_rank,
)
from nonstop.timeline.text import fmt_s, title, unfinished_text

__all__ = ["FORMATS", "render_timeline"]

FORMATS = (".png", ".svg", ".pdf")


def render_timeline(timeline: Timeline, out: Path) -> Path:
    """Draw ``timeline`` to ``out`` (format from its extension: .png, .svg or .pdf; parent dirs
    created) and return ``out``. Raises :class:`UsageError` for another extension.

    Rows, top to bottom: one per rank (a bar per period a process trains as that rank, colored
    by node and labelled with its spawn id where it fits; hatched while a new process starts;
    dotted orange while a failed rank waits for a spare; failure markers by kind with the step;
    a migration's, or a grow's joiner's, ``prepare`` and ``swap`` as a strip under the bar, with a
    mark per catch-up round: a filled triangle for a delta, a hollow square for a whole step),
    ``recovery`` (each recovery's stages stacked, MTTR; the job's startup; the stages of a
    generation no failure caused, such as a swap, paler), one per node (up, disconnected,
    join/lost markers), ``coordinator`` (if it restarted), ``tiers`` (replicated steps, persists,
    durable restores) and ``other events`` (every event the model does not know).
    Generations are light vertical lines ``g1, g2, ...``; each shrink and grow a line across the
    rank rows (dashed: an aborted grow) labelled ``shrink 3→2`` / ``grow 2→3`` in a lane above
    them, shaded until the new world trains.
    Labels that would overlap are left out, so long jobs stay readable.
    """
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(
            f"cannot draw a timeline as {out.name!r}: use a file name ending in {', '.join(FORMATS)}"
        )
    c = Canvas(timeline, pyplot())
    for paint in PAINTERS:
        paint(c)
    return save_figure(c.fig, out, title(timeline))


def paint_generations(c: Canvas) -> None:
    """Generations: light vertical lines, labelled on top; the job's failure, a red dashed one."""
    tl, ax = c.tl, c.ax
    for g in tl.generations:
        ax.axvline(g.t, color="#888888", lw=0.7, alpha=0.45, zorder=0)
        text = f"g{g.number}"
        w = c.lanes.width_s(text)
        if c.lanes.take("gen", g.t - w / 2, g.t + w / 2):
            ax.text(
                g.t,
                -0.75 - c.lane,
                text,
                ha="center",
                va="bottom",
                fontsize=FONT,
                color="#555555",
                clip_on=False,
            )
    if tl.failed_at is not None:
        ax.axvline(tl.failed_at, color="#d62728", lw=1.2, ls="--", zorder=1)
        ax.text(
            tl.failed_at,
            -0.75 - c.lane,
            " job failed",
            ha="left",
            va="bottom",
            fontsize=FONT,
            color="#d62728",
            clip_on=False,
        )


def paint_failures(c: Canvas) -> None:
    """Failure markers by kind on the failed rank's row, with the step (first: their labels take
    the room before the spawn ids do)."""
    for f in c.tl.failures:
        if f.rank is None or ("rank", f.rank) not in c.y:
            continue
        yy = c.y[("rank", f.rank)]
        marker, color = FAILURE_STYLE.get(f.kind, OTHER_FAILURE_STYLE)
        c.legend.failures[f.kind] = (marker, color)
        if f.detected > f.t:
            c.ax.plot([f.t, f.detected], [yy, yy], color=color, lw=1.2, alpha=0.8, zorder=4)
        c.ax.scatter(
            [f.t],
            [yy],
            marker=marker,
            s=70 if c.big else 30,
            c=color,
            edgecolors="black",
            linewidths=0.6,
            zorder=5,
        )
        text = f"{f.kind} @{f.step}" if f.step is not None else f.kind
        if c.big:
            c.label(("rank", f.rank), max(f.t, f.detected) + c.pad, yy, text, color=color, box=True)


def paint_resizes(c: Canvas) -> None:
    """Shrinks and grows: a line across the rank rows where the world size changed (dashed: an
    aborted grow), a faint band until the new world trains, labelled in a lane above the ranks; a
    grow's joiners' stages under their new rows, a renumbered process's old number on its new row."""
    from matplotlib.lines import Line2D

    lane_y = -0.55 - c.lane / 2
    for z in c.tl.resizes:
        style = z.label.split(" ")[0] if z.outcome != "aborted" else "aborted"
        color, ls, name = RESIZE_STYLE[style]
        c.legend.resizes[name] = Line2D([], [], color=color, lw=1.3, ls=ls)
        c.ax.vlines(
            [z.t], lane_y + 0.15, c.n_ranks - 0.5, colors=color, linewidth=1.3, linestyles=ls, zorder=4
        )
        if z.resized and z.end > z.t:
            c.ax.fill_between([z.t, z.end], -0.5, c.n_ranks - 0.5, color=color, alpha=0.08, lw=0, zorder=1)
        c.label(("resize",), z.t, lane_y, z.label, ha="center", color=color, box=True)
        if z.kind == "grow":  # the joiners' prepare (and swap) under their new ranks' rows
            for nr in z.new_ranks:
                if ("rank", nr) in c.y:
                    c.strip(c.y[("rank", nr)], z.stages, aborted=z.outcome == "aborted")
        elif c.big:  # a renumbered process on its new row (on the first only, when many were)
            moved = sorted(z.renumbered.items())
            more = f" (+{len(moved) - 1} renumbered)" if len(moved) > RENUMBERED_LABELS else ""
            for old, new in moved if not more else moved[:1]:
                if ("rank", new) in c.y:
                    text = f"was rank {old}{more}"
                    c.label(("rank", new), z.t + c.pad, c.y[("rank", new)], text, box=True, size=c.fs - 0.5)


def paint_migrations(c: Canvas) -> None:
    """Live migrations: prepare and swap under the moving rank's row, a mark per catch-up round."""
    from matplotlib.lines import Line2D

    for mv in c.tl.migrations:
        if mv.rank is None or ("rank", mv.rank) not in c.y:
            continue
        yy = c.y[("rank", mv.rank)]
        c.strip(yy, mv.stages, aborted=mv.outcome == "aborted")
        yc = yy + 0.38
        for cu in mv.catchups:
            marker, color, filled, name = CATCHUP_STYLE[cu.kind]
            if cu.seconds is not None and cu.seconds > 0:  # the fetch, up to when it was installed
                c.ax.plot([cu.t - cu.seconds, cu.t], [yc, yc], color=color, lw=0.8, zorder=4)
            if marker == "x":
                c.ax.scatter(
                    [cu.t], [yc], marker=marker, s=24 if c.big else 12, c=color, linewidths=1.0, zorder=5
                )
            else:
                c.ax.scatter(
                    [cu.t],
                    [yc],
                    marker=marker,
                    s=24 if c.big else 12,
                    facecolors=color if filled else "white",
                    edgecolors=color,
                    linewidths=0.8,
                    zorder=5,
                )
            c.legend.catchups[name] = Line2D(
                [], [], marker=marker, color=color, markerfacecolor=color if filled else "white", ls="", ms=5
            )
        if c.big:
            rounds = f", {mv.rounds} catch-up{'s' if mv.rounds != 1 else ''}" if mv.rounds else ""
            text = {"done": "moved", "aborted": "move aborted"}.get(mv.outcome, "moving")
            text += f" to node {mv.target}{rounds}" if mv.outcome != "aborted" else ""
            c.label(("rank", mv.rank), mv.end + c.pad, yy, text, box=True, size=c.fs - 0.5, color="#333333")


def paint_waits(c: Canvas) -> None:
    """Waits for a spare: dotted on the failed rank's row, until the shrink (or the spare) came."""
    for wt in c.tl.waits:
        for wr in wt.ranks:
            if ("rank", wr) not in c.y:
                continue
            yy = c.y[("rank", wr)]
            c.ax.broken_barh(
                [(wt.start, max(wt.seconds, 0.0))],
                (yy - 0.22, 0.44),
                facecolors="white",
                edgecolors=WAIT_COLOR,
                hatch="...",
                linewidth=0.6,
                zorder=2,
            )
            if c.big:
                c.label(
                    ("rank", wr),
                    (wt.start + wt.end) / 2,
                    yy,
                    "waits for a spare",
                    ha="center",
                    color=WAIT_COLOR,
                    box=True,
                    size=c.fs - 0.5,
                    inside=(wt.start, wt.end),
                )


def paint_ranks(c: Canvas) -> None:
    """A bar per period a process trains as a rank (colored by node, its spawn id once per process
    and row where it fits), hatched while a new process starts."""
    named: set[tuple[int, int]] = set()
    for iv in c.tl.intervals:
        yy = c.y[("rank", iv.rank)]
        color = c.ncolor(iv.node)
        if iv.phase == "start":
            c.ax.broken_barh(
                [(iv.start, iv.seconds)],
                (yy - 0.22, 0.44),
                facecolors="white",
                edgecolors=color,
                hatch="////",
                linewidth=0.6,
                zorder=2,
            )
            continue
        c.ax.broken_barh(
            [(iv.start, max(iv.seconds, 0.0))],
            (yy - 0.3, 0.6),
            facecolors=color,
            edgecolors="#555555",
            linewidth=0.4,
            zorder=2,
        )
        # the spawn id once per process and row (the first bar it fits in): a new id is a new process
        if iv.spawn_id is not None and c.big and (iv.rank, iv.spawn_id) not in named:
            mid = (iv.start + iv.end) / 2
            inside = (iv.start, iv.end)
            if c.label(
                ("rank", iv.rank), mid, yy, f"s{iv.spawn_id}", ha="center", color="#333333", inside=inside
            ):
                named.add((iv.rank, iv.spawn_id))


def _stages(c: Canvas, stages: Sequence[StageSpan], *, alpha: float = 1.0) -> None:
    """Stages as boxes on the recovery row."""
    yr = c.y[("recovery",)]
    for s in stages:
        if s.seconds <= 0:
            continue
        color = c.legend.stage_color(s.stage)
        c.legend.stages.setdefault(s.stage, color)
        c.ax.broken_barh(
            [(s.start, s.seconds)],
            (yr - 0.32, 0.64),
            facecolors=color,
            edgecolors=color,
            linewidth=0.3,
            alpha=alpha,
            hatch=None,
            zorder=3,
        )


def paint_recovery(c: Canvas) -> None:
    """The recovery row: stages stacked per reconfiguration with its MTTR (what an unfinished one
    does not show, hatched red); the startup before the first generation; paler, the stages of a
    generation no failure caused."""
    tl = c.tl
    yr = c.y[("recovery",)]
    first = tl.generations[0] if tl.generations else None
    if first is not None and first.t > 0:
        _stages(c, [StageSpan("startup", 0.0, first.t)])
        c.label(("recovery",), first.t / 2, yr, f"startup {first.t:.1f}s", ha="center", inside=(0.0, first.t))
    covered = {r.generation for r in tl.recoveries if r.generation is not None}
    for g in tl.generations:
        if g.number not in covered:
            _stages(c, g.stages, alpha=0.55)
    groups: dict[object, list[Recovery]] = {}
    for i, r in enumerate(tl.recoveries):
        groups.setdefault(r.generation if r.generation is not None else ("r", i), []).append(r)
    for rs in groups.values():
        lead = min(rs, key=lambda r: r.start)
        _stages(c, lead.stages)
        mttrs = [r.mttr_s for r in rs if r.mttr_s is not None]
        if lead.complete:
            text = f"MTTR {fmt_s(max(mttrs))}" if mttrs else "recovered"
        else:  # what the log does not show: still recovering, or never will (the job failed)
            seen = max((s.end for s in lead.stages), default=lead.start)
            if lead.end > seen:
                c.ax.broken_barh(
                    [(seen, lead.end - seen)],
                    (yr - 0.32, 0.64),
                    facecolors="white",
                    edgecolors="#d62728",
                    hatch="xxx",
                    linewidth=0.6,
                    zorder=3,
                )
            text = unfinished_text(tl, lead.end)
        text += f" x{len(rs)}" if len(rs) > 1 else ""
        if c.big:
            c.label(("recovery",), lead.end + c.pad, yr, text, color="#333333")


NODE_STYLE = {  # mark kind -> (marker, color, size)
    "join": (">", "#2ca02c", 22),
    "rejoin": (">", "#2ca02c", 40),
    "lost": ("X", "#222222", 70),
    "disconnected": ("|", "#d62728", 50),
    "reconnected": ("|", "#2ca02c", 50),
}


def paint_nodes(c: Canvas) -> None:
    """A row per node: up (solid) or disconnected (dashed), join / lost / reconnect markers."""
    for s in c.tl.node_spans:
        yy = c.y[("node", s.node)]
        color = c.ncolor(s.node)
        up = s.state == "up"
        c.ax.broken_barh(
            [(s.start, s.seconds)],
            (yy - 0.18, 0.36),
            facecolors=color if up else "white",
            edgecolors="#777777" if up else color,
            linestyle="-" if up else "--",
            linewidth=0.4 if up else 0.8,
            zorder=2,
        )
    for m in c.tl.node_marks:
        if m.node is None or ("node", m.node) not in c.y:
            continue
        yy = c.y[("node", m.node)]
        marker, color, size = NODE_STYLE.get(m.kind, ("o", "#7f7f7f", 20))
        c.ax.scatter(
            [m.t],
            [yy],
            marker=marker,
            s=size if c.big else size / 2,
            c=color,
            zorder=5,
            edgecolors="black" if m.kind == "lost" else None,
            linewidths=0.5,
        )
        if m.kind in ("lost", "rejoin") and c.big:
            text = f"lost: {shorten(m.detail, 48)}" if m.kind == "lost" and m.detail else m.kind
            c.label(("node", m.node), m.t + c.pad, yy, text, box=True)


def paint_coordinator(c: Canvas) -> None:
    """The coordinator's row (only when it logged a lead or a restart): a star per mark."""
    if not c.tl.coordinator_marks:
        return
    yy = c.y[("coordinator",)]
    for m in c.tl.coordinator_marks:
        resumed = m.kind == "resumed"
        c.ax.scatter(
            [m.t],
            [yy],
            marker="*",
            s=110 if resumed else 45,
            c="#d62728" if resumed else "#2ca02c",
            edgecolors="black",
            linewidths=0.4,
            zorder=5,
        )
        if c.big:
            text = f"restarted, resumed {m.detail}" if resumed else "leads"
            c.label(("coordinator",), m.t + c.pad, yy, text, box=True)


TIER_STYLE = {  # mark kind -> (marker, color, size, legend name)
    "persist": ("D", "#2b8a3e", 36, "persisted (durable)"),
    "persist_failed": ("x", "#d62728", 40, "persist failed"),
    "replication_failed": ("x", "#ff7f0e", 30, "replication failed"),
    "restore_durable": ("P", "#6a3d9a", 90, "restored from durable"),
    "durable_failed": ("x", "#6a3d9a", 40, "durable restore failed"),
}


def paint_tiers(c: Canvas) -> None:
    """The tiers' row: a tick per replicated step (the last one labelled), a marker per persist,
    durable restore and failure."""
    from matplotlib.lines import Line2D

    marks = c.tl.tier_marks
    if not marks:
        return
    yy = c.y[("tiers",)]
    rep = [m.t for m in marks if m.kind == "replicated"]
    if rep:
        c.ax.vlines(rep, yy - 0.25, yy + 0.25, colors="#4e79a7", linewidth=0.8, zorder=3)
        c.legend.tiers["replicated (memory)"] = Line2D([], [], color="#4e79a7", marker="|", ls="", ms=8)
    for m in marks:
        if m.kind not in TIER_STYLE:
            continue
        marker, color, size, name = TIER_STYLE[m.kind]
        c.ax.scatter(
            [m.t],
            [yy],
            marker=marker,
            s=size if c.big else size / 2,
            c=color,
            zorder=5,
            edgecolors="black" if marker not in ("x", "|") else None,
            linewidths=0.4,
        )
        c.legend.tiers[name] = Line2D([], [], color=color, marker=marker, ls="", ms=6)
        if c.big and m.kind in ("persist", "restore_durable") and m.step is not None:
            text = f"restore {m.step}" if m.kind == "restore_durable" else f"step {m.step}"
            c.label(("tiers",), m.t + c.pad, yy - 0.02, text, box=True, size=c.fs - 0.5)
        elif c.big and m.kind != "persist":
            c.label(("tiers",), m.t + c.pad, yy, name, box=True, color=color, size=c.fs - 0.5)
    steps = [m.step for m in marks if m.kind == "replicated" and m.step is not None]
    if c.big and rep and steps:  # the last replicated step, once
        last = max(m.t for m in marks if m.kind == "replicated")
        text = f"replicated {max(steps)}"
        c.label(("tiers",), last + c.pad, yy, text, box=True, size=c.fs - 0.5, color="#4e79a7")


def paint_other(c: Canvas) -> None:
    """Events with no row of their own: ticks, the name at the first of each run of one name."""
    if not c.tl.other:
        return
    yy = c.y[("other",)]
    c.ax.vlines([o.t for o in c.tl.other], yy - 0.22, yy + 0.22, colors="#7f7f7f", linewidth=0.8, zorder=3)
    prev = None
    for o in c.tl.other:
        if o.event != prev and c.big:
            text = (
                o.event + (f" r{o.rank}" if o.rank is not None else "") + (f" {o.stage}" if o.stage else "")
            )
            c.label(("other",), o.t + c.pad, yy, text, size=c.fs - 0.5, color="#555555")
        prev = o.event


def paint_axes(c: Canvas) -> None:
    """Row names, the time axis (m:ss past three minutes), a separator under the rank rows."""
    from matplotlib.ticker import FuncFormatter

    ax = c.ax
    ax.set_ylim(c.n_rows - 0.5, -0.8 - c.lane)
    ax.set_yticks(range(c.n_rows), [name for _, name in c.rows], fontsize=8 if c.n_rows <= 40 else 6)
    ax.set_xlim(c.x_lo, c.x_hi)
    if c.span > 180:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v // 60)}:{int(v % 60):02d}"))
        ax.set_xlabel("time since job start (m:ss)")
    else:
        ax.set_xlabel("seconds since job start")
    ax.grid(axis="x", color="#eeeeee", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for sp in ("top", "right"):
        ax.spines[sp].set_visible(False)
    if c.n_ranks:  # a faint separator under the rank rows
        ax.axhline(c.n_ranks - 0.5, color="#bbbbbb", lw=0.6)


def paint_legend(c: Canvas) -> None:
    """The legend under the axes: nodes, then what the painters drew; "no events" for an empty log."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    tl, seen = c.tl, c.legend
    handles: list[Any] = []
    for n in tl.nodes[:12]:
        handles.append(Patch(facecolor=c.ncolor(n), edgecolor="#555555", linewidth=0.4, label=f"node {n}"))
    if len(tl.nodes) > 12:
        handles.append(Patch(facecolor="#cccccc", label=f"+{len(tl.nodes) - 12} nodes"))
    if any(i.phase == "start" for i in tl.intervals):
        handles.append(Patch(facecolor="white", edgecolor="#777777", hatch="////", label="process starting"))
    for kind, (marker, color) in seen.failures.items():
        handles.append(
            Line2D(
                [],
                [],
                marker=marker,
                color=color,
                markeredgecolor="black",
                ls="",
                ms=7,
                label=f"{kind} failure",
            )
        )
    for stage, color in sorted(seen.stages.items(), key=lambda kv: stage_rank(kv[0])):
        handles.append(Patch(facecolor=color, label=stage))
    if tl.waits:
        handles.append(
            Patch(facecolor="white", edgecolor=WAIT_COLOR, hatch="...", label="waiting for a spare")
        )
    for stage, color in seen.moves.items():
        handles.append(Patch(facecolor=color, label=MOVE_STAGE_NAMES[stage]))
    for name, h in (*seen.resizes.items(), *seen.catchups.items(), *seen.tiers.items()):
        h.set_label(name)
        handles.append(h)
    if handles:
        height_in = (c.n_rows + c.lane) * c.row_h + 0.2
        c.ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.45 / height_in - 0.02),
            ncol=min(len(handles), 9),
            fontsize=7.5,
            frameon=False,
            handlelength=1.6,
            columnspacing=1.2,
        )
    if not tl.events:
        c.ax.text(0.5, 0.5, "no events", transform=c.ax.transAxes, ha="center", va="center", color="#777777")


# the order they paint in: failures' labels before the spawn ids, the axes and legend last
PAINTERS = (
    paint_generations,
    paint_failures,
    paint_resizes,
    paint_migrations,
    paint_waits,
    paint_ranks,
    paint_recovery,
    paint_nodes,
    paint_coordinator,
    paint_tiers,
    paint_other,
    paint_axes,
    paint_legend,
)
