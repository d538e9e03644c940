"""Progress on the CLI's long work (issue 16): ``nonstop inspect`` verifying every checkpoint's
chunks, ``nonstop persist`` waiting for the committed step to be durable.

Progress is drawn with ``rich`` on **stderr**, only when stderr is a terminal (``TERM`` not
``dumb``) or when asked (``--progress``), never when asked not to (``--no-progress``), and never
for ``--json`` output unless asked; the bar is transient (it leaves no line behind), so what
stdout prints is the same with and without it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

__all__ = ["add_progress_args", "inspect_report", "wait_with_status", "wanted"]

T = TypeVar("T")


def add_progress_args(p: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress`` (default: only when stderr is a terminal): ``ns.progress``."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="show progress on stderr"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


def wanted(flag: bool | None, *, json_output: bool = False, stream: TextIO | None = None) -> bool:
    """``flag`` True/False forces it; None: only when ``stream`` (stderr) is a terminal and the
    output is not JSON."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    return not json_output and stream.isatty() and os.environ.get("TERM") != "dumb"


def _console(stream: TextIO | None) -> Any:
    from rich.console import Console

    return Console(file=stream if stream is not None else sys.stderr)


def inspect_report(url: str, *, verify: bool, show: bool, stream: TextIO | None = None) -> dict[str, Any]:
    """``DurableStore(url).describe(verify=verify)``, with a bar of the checkpoints verified so far
    when ``show`` (and there is something to verify)."""
    from nonstop.snapshot.durable import DurableStore  # the CLI's parser does not pay for it

    if not (show and verify):
        return DurableStore(url).describe(verify=verify)

    class CountingStore(DurableStore):
        """A store whose :meth:`verify` moves the bar after each checkpoint it verified."""

        def verify(self, step: int) -> list[str]:
            try:
                return super().verify(step)
            finally:
                bar.advance(task)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_console(stream), transient=True) as bar:
        task = bar.add_task("verifying checkpoints", total=None)
        store = CountingStore(url)
        bar.update(task, total=len(store.steps()) or None)
        return store.describe(verify=True)


def wait_with_status(work: Callable[[], T], what: str, *, show: bool, stream: TextIO | None = None) -> T:
    """``work()``, with a spinner saying ``what`` and the seconds so far while it runs (``show``).
    Its result or its exception, as if called directly."""
    if not show:
        return work()
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as e:
            out["error"] = e

    columns = (SpinnerColumn(), TextColumn(what), TimeElapsedColumn())
    with Progress(*columns, console=_console(stream), transient=True) as bar:
        bar.add_task(what, total=None)
        t = threading.Thread(target=run, name="nonstop-cli-work", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
    if "error" in out:
        raise out["error"]
    value: T = out["value"]
    return value
