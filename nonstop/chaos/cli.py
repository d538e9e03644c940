"""``nonstop chaos``: its parser (added to the main CLI by :func:`add_parsers`) and its command."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parsers", "dispatch"]


def add_parsers(sub: Any) -> None:
    """Add ``chaos`` to an ``argparse`` subparsers object."""
    from nonstop.chaos.schedule import ALL_KINDS

    p = sub.add_parser(
        "chaos",
        help="soak: inject N seeded random faults into real multi-node jobs here and check every invariant",
    )
    p.add_argument("--faults", type=int, required=True, help="how many faults to inject")
    p.add_argument("--seed", type=int, default=0, help="the schedule's seed (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report here")
    p.add_argument("--nnodes", type=int, default=3, help="nodes per job (default %(default)s)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node (default %(default)s)")
    p.add_argument("--spares", type=int, default=1, help="hot spares per node (default %(default)s)")
    p.add_argument("--steps", type=int, default=400, help="steps per job (default %(default)s)")
    p.add_argument(
        "--duration", type=float, default=None, metavar="SECONDS", help="stop injecting after this long"
    )
    p.add_argument(
        "--step-delay", type=float, default=0.05, help="extra seconds per step (default %(default)s)"
    )
    p.add_argument(
        "--lease-ttl", type=float, default=3.0, help="node lease TTL, seconds (default %(default)s)"
    )
    p.add_argument("--persist-every", type=int, default=10, help="steps between durable checkpoints")
    p.add_argument(
        "--kinds", default=",".join(ALL_KINDS), help="comma-separated fault kinds (default: all of them)"
    )
    p.add_argument("--job-dir", type=Path, default=Path(".nonstop/chaos"))
    p.add_argument(
        "--timeout", type=float, default=240.0, help="seconds any one wait may take (default %(default)s)"
    )


def dispatch(ns: argparse.Namespace) -> int:
    from nonstop.chaos.driver import ChaosOptions, run_chaos
    from nonstop.chaos.report import summary_lines

    opts = ChaosOptions(
        faults=ns.faults, seed=ns.seed, nnodes=ns.nnodes, nproc=ns.nproc, spares=ns.spares, steps=ns.steps,
        duration_s=ns.duration, step_delay_s=ns.step_delay, lease_ttl_s=ns.lease_ttl,
        persist_every=ns.persist_every, kinds=tuple(k.strip() for k in ns.kinds.split(",") if k.strip()),
        job_dir=ns.job_dir, timeout_s=ns.timeout,
    )  # fmt: skip

    def write(report: dict[str, Any]) -> None:
        if ns.json is not None:
            ns.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = ns.json.with_name(f".{ns.json.name}.tmp")
            tmp.write_text(json.dumps(report, indent=1) + "\n")
            tmp.replace(ns.json)

    def stop(signum: int, frame: object) -> None:  # stop the soak cleanly: nodes, etcd, namespaces
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)  # also when started in the background (SIGINT ignored)
    report = run_chaos(opts, progress=write)
    write(report)
    for line in summary_lines(report):
        print(line)
    for line in report["failures"]:
        print(f"nonstop chaos: FAILED: {line}", file=sys.stderr)
    return 0 if report["ok"] else 1
