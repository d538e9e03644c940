"""The operator's flags and views of the CLI: ``--metrics-port`` (``nonstop run`` and ``demo``)
and ``nonstop status --watch`` (a live view of a running job, redrawn every second)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from nonstop.errors import NonstopError

__all__ = ["add_metrics_args", "add_watch_args", "watch_status"]

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus /metrics and /status JSON on the control host, port P (0: any free "
        "port, written to JOB_DIR/job.json); requests need 'Authorization: Bearer' with the token "
        "in JOB_DIR/metrics.token",
    )


def add_watch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="redraw the status every --interval s until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of --watch")


def watch_status(
    job_dir: Path,
    render: Callable[[dict[str, Any]], str],
    *,
    interval_s: float = 1.0,
    out: TextIO = sys.stdout,
    rounds: int | None = None,
) -> int:
    """Redraw ``render(status)`` of the job in ``job_dir`` every ``interval_s`` until Ctrl-C (or
    ``rounds`` redraws), then 0. The job ending while watched ends the watch with a line saying
    so; a job that cannot be reached at the first look raises (the usual one-line error)."""
    from nonstop.launch.job_client import request_status

    seen = 0
    try:
        while rounds is None or seen < rounds:
            t0 = time.monotonic()
            try:
                st = request_status(job_dir)
            except NonstopError as e:
                if seen == 0:
                    raise
                out.write(f"\nnonstop: the job is no longer reachable ({e})\n")
                return 0
            stamp = time.strftime("%H:%M:%S")
            head = f"nonstop status {job_dir}  {stamp}  (every {interval_s:g} s, Ctrl-C to stop)"
            out.write(f"{CLEAR}{head}\n\n")
            out.write(render(st) + "\n")
            out.flush()
            seen += 1
            time.sleep(max(0.0, interval_s - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        out.write("\n")
    return 0
