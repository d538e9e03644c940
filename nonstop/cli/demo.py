"""``nonstop demo``: train the demo model with injected failures (and with ``--verify`` check the
weights bitwise against a run without them); exit 1 when they differ."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nonstop.cli.flags.detection import detector, detector_args, health, health_args
from nonstop.cli.flags.logs import add_level_arg
from nonstop.cli.flags.metrics import add_metrics_args
from nonstop.cli.flags.security import add_security_args
from nonstop.config import SURVIVOR_MODES
from nonstop.policy.cadence import DEFAULT_BUDGET

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to ``nonstop``'s subcommands."""
    demo = sub.add_parser("demo", help="train the demo model with injected failures")
    demo.add_argument("--nproc", type=int, default=3, help="ranks per node")
    demo.add_argument("--nnodes", type=int, default=1, help="nodes, each a separate agent on this machine")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--spares", type=int, default=1)
    demo.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    demo.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="SPEC",
        help="kill:rank=R,step=S | hang:rank=R,step=S | stall:rank=R,step=S | spin:rank=R,step=S | "
        "exit:rank=R,step=S,code=C | "
        "slow:rank=R,step=S,seconds=X | node:node=I,step=S "
        "(add ,at=recovery to fire during a recovery); repeatable",
    )
    demo.add_argument(
        "--verify",
        action="store_true",
        help="also run without faults and check the final weights are bitwise equal",
    )
    demo.add_argument(
        "--mesh",
        default=None,
        metavar="replicate=R,shard=S,tp=T",
        help="train the sharded demo on this mesh (FSDP2 on shard, HSDP with replicate, tensor "
        "parallel on tp; the product is nnodes x nproc); --verify compares every rank's shards",
    )
    demo.add_argument(
        "--min-world-size",
        type=int,
        default=0,
        metavar="N",
        help="elastic: the job may shrink to N ranks (the demo reads its batches by data shard)",
    )
    demo.add_argument(
        "--survivors",
        choices=SURVIVOR_MODES,
        default="auto",
        help="elastic: on a failure a spare could replace, 'continue' goes on without the rank at "
        "once and the spare joins at a step boundary; 'wait' waits for the spare (default %(default)s)",
    )
    demo.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        metavar="K",
        help="snapshot every K steps: a failure redoes up to K-1 steps past the last snapshot "
        "(--verify still compares bitwise; default %(default)s)",
    )
    demo.add_argument(
        "--snapshot-budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="FRACTION",
        help="tune the interval to this stall budget, as `nonstop run --snapshot-budget` (0: keep "
        "--snapshot-every; default %(default)s)",
    )
    demo.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    demo.add_argument("--job-dir", type=Path, default=Path(".nonstop/demo"))
    detector_args(demo)
    health_args(demo)  # issue 21: --straggler, --on-degraded
    add_security_args(demo, etcd=False)
    add_metrics_args(demo)
    add_level_arg(demo)


def run(ns: argparse.Namespace) -> int:
    """Run the demo (and write its report to ``--json``); 0 unless ``--verify`` found a difference."""
    from nonstop.demo.runner import DemoOptions, run_demo

    opts = DemoOptions(
        nproc=ns.nproc,
        nnodes=ns.nnodes,
        steps=ns.steps,
        spares=ns.spares,
        model=ns.model,
        faults=tuple(ns.fail),
        verify=ns.verify,
        job_dir=ns.job_dir,
        detector=detector(ns),
        straggler=health(ns),
        mesh=ns.mesh,
        min_world_size=ns.min_world_size,
        survivors=ns.survivors,
        snapshot_every=ns.snapshot_every,
        snapshot_budget=ns.snapshot_budget,
        tls=ns.tls,
        metrics_port=ns.metrics_port,
    )
    report = run_demo(opts)
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps(report, indent=2))
    return 0 if report["equal"] in (None, True) else 1
