"""``nonstop migrate`` (one rank to another node) and ``nonstop drain`` (every rank off a node):
live moves of a running job's ranks, one line per rank moved or not."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``migrate`` and ``drain`` to ``nonstop``'s subcommands."""
    migrate = sub.add_parser("migrate", help="move a rank of a running job live to another node")
    migrate.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    migrate.add_argument("--rank", type=int, required=True)
    migrate.add_argument(
        "--to", default=None, metavar="NODE", help="target node (default: the policy's choice)"
    )
    migrate.add_argument("--timeout", type=float, default=300.0)

    drain = sub.add_parser("drain", help="move every rank off a node of a running job (maintenance)")
    drain.add_argument("node", help="the node (its --node-rank)")
    drain.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    drain.add_argument("--timeout", type=float, default=300.0)


def run(ns: argparse.Namespace) -> int:
    """Ask for the move (``ns.cmd``: migrate or drain); 0 when every rank moved, else 1."""
    from nonstop.launch.job_client import request_migration
    from nonstop.protocol.base import MigrateMsg
    from nonstop.protocol.client import DrainMsg

    req = MigrateMsg(gen=-1, rank=ns.rank, to=ns.to) if ns.cmd == "migrate" else DrainMsg(node=ns.node)
    answers = request_migration(ns.job_dir, req, timeout=ns.timeout)
    failed = 0
    for a in answers:
        if a.ok:
            ratio = a.pause_ratio
            print(
                f"nonstop: rank {a.rank} moved {a.source} -> {a.target} at step "
                f"{a.boundary}" + (f", longest step gap {ratio:.2f}x the median step" if ratio else "")
            )
        else:
            failed += 1
            rank = "?" if a.rank is None else a.rank
            print(f"nonstop: rank {rank} not moved: {a.error}", file=sys.stderr)
    return 1 if failed or not answers else 0
