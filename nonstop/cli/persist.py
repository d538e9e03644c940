"""``nonstop persist``: make a running job's committed step durable now, and say where."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.progress import add_progress_args

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``persist`` to ``nonstop``'s subcommands."""
    persist = sub.add_parser("persist", help="make a running job's committed step durable now")
    persist.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    persist.add_argument("--timeout", type=float, default=300.0)
    add_progress_args(persist)


def run(ns: argparse.Namespace) -> int:
    """Ask the job in ``ns.job_dir`` to persist and wait for it; 0 once durable (errors raise)."""
    from nonstop.launch.job_client import request_persist
    from nonstop.progress import wait_with_status, wanted

    reply = wait_with_status(
        lambda: request_persist(ns.job_dir, timeout=ns.timeout),
        "nonstop persist: making the committed step durable",
        show=wanted(ns.progress),
    )
    print(f"nonstop persist: step {reply.step} is durable at {reply.url} ({reply.stored_bytes} bytes stored)")
    return 0
