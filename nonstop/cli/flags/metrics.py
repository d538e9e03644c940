"""``--metrics-port`` of ``nonstop run`` and ``nonstop demo``: the job's Prometheus endpoint."""

from __future__ import annotations

import argparse

__all__ = ["add_metrics_args"]


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
