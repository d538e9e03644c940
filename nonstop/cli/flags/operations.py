"""The flags of operating a running job and the part they fill
(:class:`~nonstop.config.OperationsConfig`): preemption notices (``--preempt-*``) and how a live
migration's swap moves the boundary step (``--swap-transfer``), which ``nonstop run`` lists in its
group "many nodes", and ``--metrics-port`` (:mod:`nonstop.cli.flags.metrics`).
:func:`operations_config` reads them back."""

from __future__ import annotations

import argparse

from nonstop.config import SWAP_TRANSFERS, OperationsConfig

__all__ = ["operations_config", "preempt_args", "swap_transfer_arg"]


def preempt_args(g: argparse._ArgumentGroup) -> None:
    """Preemption notices: SIGTERM, a file in the job dir, or a polled endpoint."""
    c = OperationsConfig()
    g.add_argument(
        "--preempt-grace",
        type=float,
        default=c.preempt_grace_s,
        metavar="SECONDS",
        help="SIGTERM to a node (not node 0) is a preemption notice: its ranks move live to other nodes "
        "within this grace; also JOB_DIR/preempt-node-N appearing (content: grace seconds)",
    )
    g.add_argument(
        "--preempt-url",
        default=None,
        metavar="URL",
        help="poll this HTTP endpoint for a preemption notice (a cloud metadata service, e.g. AWS "
        ".../spot/instance-action, GCP .../instance/preempted, Azure scheduled events); '{node}' is "
        "replaced by the node rank",
    )
    g.add_argument(
        "--preempt-header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="header of the notice request (e.g. 'Metadata-Flavor: Google'); repeatable",
    )
    g.add_argument(
        "--preempt-poll",
        type=float,
        default=c.preempt_poll_s,
        metavar="SECONDS",
        help="how often the notice endpoint is polled (default %(default)s)",
    )


def swap_transfer_arg(g: argparse._ArgumentGroup) -> None:
    """``--swap-transfer``."""
    g.add_argument(
        "--swap-transfer",
        choices=SWAP_TRANSFERS,
        default=OperationsConfig().swap_transfer,
        help="how a live migration's swap brings the boundary step to the joiner's node: as a delta "
        "against the step its catch-up fetched, the whole step, or auto: a delta when the catch-up "
        "measured deltas faster (a slow link) (default %(default)s)",
    )


def operations_config(ns: argparse.Namespace) -> OperationsConfig:
    """The job's operations part from the flags above and ``--metrics-port``."""
    return OperationsConfig(
        metrics_port=ns.metrics_port,
        preempt_grace_s=ns.preempt_grace,
        preempt_url=ns.preempt_url,
        preempt_headers=tuple(ns.preempt_header),
        preempt_poll_s=ns.preempt_poll,
        swap_transfer=ns.swap_transfer,
    )
