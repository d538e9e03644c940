"""``nonstop timeline``: a job's event log as a summary, and drawn (a picture, or a Chrome trace)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``timeline`` to ``nonstop``'s subcommands."""
    timeline = sub.add_parser(
        "timeline", help="draw a job's event log: ranks, failures, recovery stages, nodes, tiers"
    )
    timeline.add_argument(
        "path", nargs="?", type=Path, default=Path(".nonstop/job"), help="a job dir or its events.jsonl"
    )
    timeline.add_argument(
        "--out",
        type=Path,
        default=None,
        help="file to write: .png, .svg, .pdf, or .json for a trace (default JOB_DIR/timeline.png)",
    )
    timeline.add_argument(
        "--format",
        choices=("png", "svg", "pdf", "trace"),
        default=None,
        help="trace: Chrome-trace/Perfetto JSON (default JOB_DIR/timeline.trace.json); default: by --out",
    )
    timeline.add_argument("--text-only", action="store_true", help="print the summary, draw nothing")


def run(ns: argparse.Namespace) -> int:
    """Print the summary, then draw it (without matplotlib: one line on stderr says why not); 0."""
    from nonstop.timeline import load_timeline, timeline_text
    from nonstop.timeline.output import picture_skipped, write_timeline

    skipped = None if ns.text_only else picture_skipped(out=ns.out, fmt=ns.format)  # no matplotlib
    tl = load_timeline(ns.path)
    print(timeline_text(tl))
    if skipped is not None:
        print(f"nonstop: {skipped}", file=sys.stderr)
    elif not ns.text_only:
        out, what = write_timeline(tl, job=ns.path, out=ns.out, fmt=ns.format)
        print(f"nonstop: timeline {'drawn' if what == 'picture' else 'trace written'} to {out}")
    return 0
