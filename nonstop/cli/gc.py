"""``nonstop gc``: remove the shared memory and processes crashed jobs left behind."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gc`` to ``nonstop``'s subcommands."""
    gc = sub.add_parser("gc", help="remove shared memory and processes left by crashed jobs")
    gc.add_argument("--dry-run", action="store_true")


def run(ns: argparse.Namespace) -> int:
    """Collect (or with ``--dry-run`` only list) what orphaned jobs left; 0."""
    from nonstop.agent.gc import collect_garbage
    from nonstop.launch.launcher import default_shm_dir

    rep = collect_garbage(default_shm_dir(), dry_run=ns.dry_run)
    verb = "would remove" if ns.dry_run else "removed"
    print(
        f"nonstop gc: {verb} {len(rep.segments)} segment(s) of {len(rep.jobs)} orphaned job(s), "
        f"killed {len(rep.killed)} process(es); {len(rep.live_jobs)} live job(s) left alone"
        + (f"; {len(rep.skipped)} path(s) it may not touch skipped" if rep.skipped else "")
    )
    for path in rep.skipped:
        print(f"  skipped {path}")
    return 0
