"""Where ``nonstop timeline`` writes, and as what: a picture (:mod:`.render`) or a trace
(:mod:`.trace`), chosen by ``--format`` or, without it, by the ``--out`` file's extension."""

from __future__ import annotations

from pathlib import Path

from nonstop.errors import UsageError
from nonstop.plotting import INSTALL_PLOTS, plots_missing, require_plots
from nonstop.timeline.model import Timeline
from nonstop.timeline.render import FORMATS, render_timeline
from nonstop.timeline.trace import write_trace

__all__ = ["OUTPUT_FORMATS", "picture_skipped", "write_timeline"]

# --format's choices: a picture's extension, or a Chrome/Perfetto trace (JSON)
OUTPUT_FORMATS = (*(f.lstrip(".") for f in FORMATS), "trace")


def write_timeline(tl: Timeline, *, job: Path, out: Path | None, fmt: str | None) -> tuple[Path, str]:
    """Write ``tl`` and return where and what (``"picture"`` or ``"trace"``).

    ``job``: the job dir or events file given (the default output goes beside the log:
    ``timeline.png``, ``timeline.svg``, ``timeline.pdf`` or ``timeline.trace.json``). ``fmt``: one
    of :data:`OUTPUT_FORMATS`, or None to take it from ``out``'s extension (``.json``: a trace;
    none given: a PNG). A ``fmt`` and an ``out`` that disagree is a :class:`UsageError`."""
    where = job if job.is_dir() else job.parent
    if fmt is not None and fmt not in OUTPUT_FORMATS:
        raise UsageError(f"unknown timeline format {fmt!r}: use one of {', '.join(OUTPUT_FORMATS)}")
    fmt = _format(out, fmt)
    if fmt == "trace":
        out = out or where / "timeline.trace.json"
        if out.suffix.lower() != ".json":
            raise UsageError(f"a trace is JSON: name the file {out.stem}.json, not {out.name!r}")
        return write_trace(tl, out), "trace"
    if out is not None and fmt in OUTPUT_FORMATS and out.suffix.lower() != f".{fmt}":
        raise UsageError(f"--format {fmt} and --out {out.name!r} disagree: name the file *.{fmt}")
    return render_timeline(tl, out or where / f"timeline.{fmt}"), "picture"


def picture_skipped(*, out: Path | None, fmt: str | None) -> str | None:
    """Before anything is read or drawn, whether the picture can be drawn without matplotlib (the
    optional ``plots`` extra). None: go on (a trace, or matplotlib is there). A picture asked for
    by name (``--out *.png|svg|pdf``, ``--format png|svg|pdf``) without matplotlib raises
    :class:`~nonstop.plotting.PlotsUnavailable` (one line, exit 2); the default picture, a side
    product of the printed summary, is skipped instead: the line returned says so and why."""
    picture = _format(out, fmt)
    if picture == "trace" or picture not in OUTPUT_FORMATS or (why := plots_missing()) is None:
        return None  # a trace; a format write_timeline refuses with its own line; or it can draw
    if out is not None or fmt is not None:
        require_plots(f"a {out.name if out is not None else fmt} timeline")
    return (
        f"timeline picture skipped: drawing needs matplotlib, which {why} ({INSTALL_PLOTS}); "
        "--format trace writes a Perfetto trace without it"
    )


def _format(out: Path | None, fmt: str | None) -> str:
    """--format, or what ``out``'s extension says (``.json``: a trace; no ``out``: a PNG)."""
    if fmt is not None:
        return fmt
    return "png" if out is None else "trace" if out.suffix.lower() == ".json" else out.suffix.lower()[1:]
