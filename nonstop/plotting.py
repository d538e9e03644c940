"""matplotlib helpers shared by every picture nonstop draws (the simulator's plots, ``nonstop
timeline``): pyplot on a file-only backend, imported on first use, and writing a figure out.

matplotlib is an optional extra (``pip install 'nonstop[plots]'``): nothing imports it until a
picture is drawn, and without it a picture fails with one line (:class:`PlotsUnavailable`, a
:class:`~nonstop.errors.UsageError`: the CLI prints it and exits 2) that says what to install."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nonstop.errors import UsageError

__all__ = ["INSTALL_PLOTS", "PlotsUnavailable", "plots_missing", "pyplot", "require_plots", "save_figure"]

# What a user runs to get the pictures (the extra declared in pyproject.toml).
INSTALL_PLOTS = "pip install 'nonstop[plots]'"


class PlotsUnavailable(UsageError):
    """A picture was asked for and matplotlib cannot be imported; the message says what to install."""


def plots_missing() -> str | None:
    """None when matplotlib imports; otherwise why not, in a few words after "matplotlib"
    (``is not installed``, or the import's own error for a broken install)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "matplotlib":
            return "is not installed"
        first = (str(e).splitlines() or [""])[0]
        return f"does not import ({type(e).__name__}: {first})"
    return None


def require_plots(what: str) -> None:
    """Raise :class:`PlotsUnavailable` (``WHAT needs matplotlib, which ...: pip install ...``) unless
    matplotlib imports. Called before the work a picture crowns, so a missing extra costs nothing."""
    why = plots_missing()
    if why is not None:
        raise PlotsUnavailable(f"{what} needs matplotlib, which {why}: {INSTALL_PLOTS}")


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use;
    :class:`PlotsUnavailable` when matplotlib is missing."""
    require_plots("drawing a picture")
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
