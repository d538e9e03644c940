"""``nonstop status``: a running job's ranks, nodes, spares, steps and tiers, once (for a person
or as JSON) or, with ``--watch``, as a live view redrawn every ``--interval`` seconds."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from nonstop.errors import NonstopError

__all__ = ["add_parser", "format_status", "run", "watch_status"]

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``status`` to ``nonstop``'s subcommands."""
    status = sub.add_parser("status", help="a running job: ranks, nodes, spares, steps, tiers, migration")
    status.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    add_watch_args(status)


def run(ns: argparse.Namespace) -> int:
    """Print the job's status (or watch it); 0. A job that cannot be reached raises."""
    from nonstop.launch.job_client import request_status

    if ns.watch:
        return watch_status(ns.job_dir, format_status, interval_s=ns.interval)
    st = request_status(ns.job_dir)
    print(json.dumps(st, indent=2) if ns.json else format_status(st))
    return 0


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


def format_status(st: dict[str, object]) -> str:
    """``nonstop status`` for a person: one line for the job, one per node, one per rank."""
    lines = [
        f"job {st.get('job_id')}: {st.get('state')}, generation {st.get('generation')}, "
        f"{st.get('world_size')} ranks, {st.get('failures')} failure(s); store {st.get('store')}",
        f"steps: committed {st.get('committed_step')}, replicated {st.get('replicated_step')}, "
        f"durable {st.get('durable_step')} ({st.get('durable_url')})",
    ]
    nodes = st.get("nodes")
    if isinstance(nodes, dict):
        for name, n in nodes.items():
            what = "alive" if n["alive"] else ("quarantined" if n["quarantined"] else "lost")
            lines.append(
                f"node {name} [{n['domain']}]: {what}, ranks {n['ranks']}, {n['idle_spares']} idle spare(s), "
                f"{n['failures']} failure(s)"
            )
    ranks = st.get("ranks")
    shards = st.get("shards")
    full = st.get("full_world_size", st.get("num_shards"))
    shrunk = full not in (None, st.get("world_size"))
    if isinstance(ranks, dict):
        for r, info in ranks.items():
            played = f", shards {shards.get(r)}" if shrunk and isinstance(shards, dict) else ""
            lines.append(
                f"rank {r}: node {info['node']}, spawn {info['spawn_id']}, pid {info['pid']}, "
                f"step {info['step']}{played}"
            )
    if shrunk:
        lines.append(
            f"elastic: shrunk to {st.get('world_size')} of {full} ranks (minimum {st.get('min_world_size')})"
        )
    grow = st.get("growing")
    if isinstance(grow, dict):
        lines.append(f"growing to {grow['to']} ranks at step {grow['boundary']}")
    m = st.get("migration")
    if isinstance(m, dict):
        lines.append(
            f"migration: rank {m['rank']} {m['source']} -> {m['target']}, {m['phase']}"
            + (f" at step {m['boundary']}" if m.get("boundary") is not None else "")
        )
    if st.get("queued_migrations"):
        lines.append(f"queued migrations: ranks {st['queued_migrations']}")
    return "\n".join(lines)
