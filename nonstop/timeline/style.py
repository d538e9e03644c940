"""The picture's styles and its canvas: colors and markers per kind, the rows of a timeline, and
:class:`Canvas`, which places labels only where they fit and collects the legend's entries as the
painters of :mod:`nonstop.timeline.render` draw."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nonstop.timeline.model import STAGE_ORDER, StageSpan, Timeline

__all__ = ["Canvas", "Legend", "rows_of", "shorten", "stage_rank"]

STAGE_COLORS = {
    "startup": "#d9d9d9",
    "detect": "#e15759",
    "replan": "#9c755f",
    "plan": "#f28e2b",
    "launch": "#edc948",
    "restore": "#59a14f",
    "rebuild": "#4e79a7",
    "resume": "#b07aa1",
}
EXTRA_STAGE_COLORS = ("#76b7b2", "#ff9da7", "#bab0ac", "#86bcb6")
NODE_COLORS = (
    "#80b1d3", "#fdb462", "#b3de69", "#bebada", "#8dd3c7", "#fccde5",
    "#ffed6f", "#e5c494", "#bc80bd", "#ccebc5", "#b3cde3", "#fb8072",
)  # fmt: skip
FAILURE_STYLE = {  # kind -> (marker, color)
    "kill": ("X", "#d62728"),
    "hang": ("D", "#ff7f0e"),
    "exit": ("s", "#9467bd"),
    "error": ("^", "#8c564b"),
    "node": ("v", "#222222"),
}
OTHER_FAILURE_STYLE = ("o", "#7f7f7f")
MOVE_COLORS = {"prepare": "#a0cbe8", "swap": "#ffbe7d"}  # a migration's or a grow's stages
MOVE_STAGE_NAMES = {"prepare": "prepare (move, grow)", "swap": "pause + swap"}
RESIZE_STYLE = {  # kind -> (color, line style, legend name)
    "shrink": ("#b2182b", "-", "shrink"),
    "grow": ("#1a9850", "-", "grow"),
    "aborted": ("#7f7f7f", "--", "grow aborted"),
}
CATCHUP_STYLE = {  # kind -> (marker, color, filled, legend name)
    "delta": ("v", "#1f5fa8", True, "catch-up (delta)"),
    "whole": ("s", "#1f5fa8", False, "catch-up (whole step)"),
    "failed": ("x", "#d62728", False, "catch-up failed"),
}
WAIT_COLOR = "#e8871e"
RENUMBERED_LABELS = 8  # "was rank N" on each renumbered row up to this many; beyond, on the first only
FONT = 7.5  # points, for the labels in the plot
_CHAR_W = 0.58  # a character's width in font sizes (an estimate, for "does it fit")


class _Lanes:
    """Keeps the labels of a row from overlapping: a label is drawn only if its extent (in
    points along x) is free on its row."""

    def __init__(self, pts_per_s: float) -> None:
        self.pts_per_s = pts_per_s
        self.taken: dict[object, list[tuple[float, float]]] = {}

    def width_s(self, text: str, size: float = FONT) -> float:
        return (len(text) * size * _CHAR_W + 2.0) / self.pts_per_s

    def take(self, row: object, x0: float, x1: float) -> bool:
        spans = self.taken.setdefault(row, [])
        if any(a < x1 and x0 < b for a, b in spans):
            return False
        spans.append((x0, x1))
        return True


def shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def stage_rank(stage: str) -> int:
    """The legend's order of stages: the startup, then :data:`STAGE_ORDER`, then any other."""
    order = ("startup", *STAGE_ORDER)
    return order.index(stage) if stage in order else len(order)


def rows_of(tl: Timeline) -> list[tuple[object, str]]:
    """The picture's rows, top to bottom: (key, label)."""
    rows: list[tuple[object, str]] = [(("rank", r), f"rank {r}") for r in tl.ranks]
    rows.append((("recovery",), "recovery"))
    rows += [(("node", n), f"node {n}") for n in tl.nodes]
    if tl.coordinator_marks:
        rows.append((("coordinator",), "coordinator"))
    if tl.tier_marks:
        rows.append((("tiers",), "tiers"))
    if tl.other:
        rows.append((("other",), "other events"))
    return rows


@dataclass
class Legend:
    """What the painters drew, by name, for the legend (in the order first drawn)."""

    failures: dict[str, tuple[str, str]] = field(default_factory=dict)  # kind -> (marker, color)
    stages: dict[str, str] = field(default_factory=dict)  # stage -> color
    moves: dict[str, str] = field(default_factory=dict)  # prepare / swap -> color
    resizes: dict[str, Any] = field(default_factory=dict)  # name -> handle
    catchups: dict[str, Any] = field(default_factory=dict)
    tiers: dict[str, Any] = field(default_factory=dict)
    extra_stage_colors: dict[str, str] = field(default_factory=dict)  # stages not in STAGE_COLORS

    def stage_color(self, stage: str) -> str:
        if stage in STAGE_COLORS:
            return STAGE_COLORS[stage]
        extra = self.extra_stage_colors
        if stage not in extra:
            extra[stage] = EXTRA_STAGE_COLORS[len(extra) % len(EXTRA_STAGE_COLORS)]
        return extra[stage]


class Canvas:
    """One timeline being drawn on ``ax``: a row per key of :func:`rows_of` (``y``), sizes that
    follow the number of rows, and :meth:`label`, which draws a text only where it fits."""

    WIDTH_IN = 15.0

    def __init__(self, tl: Timeline, plt: Any) -> None:
        self.tl = tl
        self.rows = rows_of(tl)
        self.y = {key: i for i, (key, _) in enumerate(self.rows)}
        self.n_rows = len(self.rows)
        self.n_ranks = len(tl.ranks)
        self.row_h = 0.34 if self.n_rows <= 24 else max(0.12, 10.0 / self.n_rows)
        self.lane = 0.2 / self.row_h if tl.resizes else 0.0  # rows of room above the ranks for resizes
        self.fig, self.ax = plt.subplots(
            figsize=(self.WIDTH_IN, 1.9 + 0.8 + (self.n_rows + self.lane) * self.row_h)
        )
        self.span = max(tl.end - tl.begin, 1e-3)
        self.x_lo, self.x_hi = tl.begin - 0.01 * self.span, tl.end + 0.03 * self.span
        self.lanes = _Lanes((self.WIDTH_IN - 2.0) * 72.0 / (self.x_hi - self.x_lo))
        self.big = self.row_h >= 0.19  # room for text inside rows
        self.fs = FONT if self.row_h >= 0.3 else FONT - 1.0
        self.pad = 4.0 / self.lanes.pts_per_s  # a label's distance from its marker, seconds
        self.node_color = {n: NODE_COLORS[i % len(NODE_COLORS)] for i, n in enumerate(tl.nodes)}
        self.legend = Legend()

    def ncolor(self, node: str | None) -> str:
        return self.node_color.get(node, "#cccccc") if node is not None else "#cccccc"

    def label(
        self,
        row: object,
        x: float,
        yy: float,
        text: str,
        *,
        ha: str = "left",
        size: float = 0.0,
        color: str = "black",
        box: bool = False,
        inside: tuple[float, float] | None = None,
    ) -> bool:
        """Draw ``text`` at ``x`` if it fits (inside ``inside``, within the axes, clear of the row's
        other labels); a left-aligned label that would run off the right edge goes left of its
        marker instead. Whether it was drawn."""
        size = size or self.fs
        w = self.lanes.width_s(text, size)
        if inside is not None and inside[1] - inside[0] < w:
            return False
        if ha == "left" and x + w > self.x_hi:
            ha, x = "right", x - 2 * self.pad
        x0 = x - w / 2 if ha == "center" else x if ha == "left" else x - w
        if x0 < self.x_lo or x0 + w > self.x_hi or not self.lanes.take(row, x0, x0 + w):
            return False
        bbox = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75} if box else None
        self.ax.text(
            x, yy, text, ha=ha, va="center", fontsize=size, color=color, bbox=bbox, zorder=6, clip_on=True
        )
        return True

    def strip(self, yy: float, stages: Sequence[StageSpan], *, aborted: bool) -> None:
        """A migration's or a grow's stages as a thin strip under the rank bar at ``yy`` (hatched
        red when it was aborted)."""
        for s in stages:
            if s.seconds <= 0 or s.stage not in MOVE_COLORS:
                continue
            c = MOVE_COLORS[s.stage]
            self.legend.moves.setdefault(s.stage, c)
            self.ax.broken_barh(
                [(s.start, s.seconds)],
                (yy + 0.3, 0.16),
                facecolors=c,
                edgecolors="#d62728" if aborted else c,
                hatch="xxx" if aborted else None,
                linewidth=0.4,
                zorder=3,
            )
