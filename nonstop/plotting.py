"""matplotlib helpers shared by every picture nonstop draws (the simulator's plots, ``nonstop
timeline``): pyplot on a file-only backend, imported on first use, and writing a figure out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save_figure"]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str = "") -> Path:
    """Title, lay out and write ``fig`` to ``path`` (parent dirs created), then free it."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
