"""The failure-detection flags of ``nonstop run`` and ``demo`` and the configs they become: the
hang detector (``--heartbeat-timeout``, ...), fail-slow ranks and degraded nodes (``--straggler``,
``--on-degraded``), each node agent's health probes (``--probe-period``, ``--health-cmd``), node
leases (``--lease-ttl``) and quarantine (``--quarantine-*``). Each ``*_args`` adds flags to a
parser; the function named after its config reads them back; :func:`detection_config` composes
them into the job's :class:`~nonstop.config.DetectionConfig`."""

from __future__ import annotations

import argparse

from nonstop.config import DetectionConfig, DetectorConfig, ProbeConfig
from nonstop.policy.straggler import DEGRADED_ACTIONS, STRAGGLER_MODES, StragglerConfig

__all__ = [
    "detection_config",
    "detector",
    "detector_args",
    "health",
    "health_args",
    "lease_arg",
    "probe_args",
    "probes",
    "quarantine_args",
]


def detector_args(p: argparse.ArgumentParser) -> None:
    d = DetectorConfig()
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout_s,
        help="seconds of heartbeat silence before a worker counts as hung (default %(default)s)",
    )
    p.add_argument(
        "--hang-factor",
        type=float,
        default=d.hang_factor,
        help="no progress for this many median step times counts as a hang (default %(default)s)",
    )
    p.add_argument(
        "--hang-min-s",
        type=float,
        default=d.hang_min_s,
        help="floor of the progress-based hang timeout, seconds (default %(default)s)",
    )
    p.add_argument(
        "--no-confirm-silence",
        dest="confirm_silence",
        action="store_false",
        help="kill a silent worker at once, without its node agent's look at whether it is starved "
        "of CPU rather than stuck (by default one that moves is spared, for 3x the timeout)",
    )


def detector(ns: argparse.Namespace) -> DetectorConfig:
    return DetectorConfig(
        heartbeat_timeout_s=ns.heartbeat_timeout,
        hang_factor=ns.hang_factor,
        hang_min_s=ns.hang_min_s,
        confirm_silence=ns.confirm_silence,
    )


def health_args(p: argparse.ArgumentParser) -> None:
    """Issue 21: fail-slow ranks and degraded nodes (policy/straggler.py, coordinator/health.py)."""
    s = StragglerConfig()
    p.add_argument(
        "--straggler",
        choices=STRAGGLER_MODES,
        default=s.mode,
        help="a rank persistently slower than its peers (its compute time outside the gradient "
        "allreduce): 'warn' logs it (event 'straggler', status), 'migrate' also moves it live to a "
        "node with an idle spare when the slowdown over the remaining steps costs more than a "
        "migration, 'off' does not look (default %(default)s)",
    )
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=s.factor,
        help="slower than this x the median of the other ranks is slow (default %(default)s)",
    )
    p.add_argument(
        "--straggler-window",
        type=int,
        default=s.window,
        metavar="STEPS",
        help="a rank slow in 3/4 of the last STEPS steps is flagged (default %(default)s)",
    )
    p.add_argument(
        "--migration-cost",
        type=float,
        default=s.migration_cost_s,
        metavar="SECONDS",
        help="what a live migration is assumed to cost until one is measured (default %(default)s)",
    )
    p.add_argument(
        "--on-degraded",
        choices=DEGRADED_ACTIONS,
        default=s.on_degraded,
        help="a node whose health verdict is degraded or failing: 'warn' logs it, 'drain' moves its "
        "ranks live to nodes with an idle spare and releases it (default %(default)s)",
    )


def health(ns: argparse.Namespace) -> StragglerConfig:
    return StragglerConfig(
        mode=ns.straggler,
        factor=ns.straggler_factor,
        window=ns.straggler_window,
        migration_cost_s=ns.migration_cost,
        on_degraded=ns.on_degraded,
    )


def probe_args(p: argparse.ArgumentParser) -> None:
    """Issue 21: every node agent's health probes (agent/probes.py); validated by
    :class:`~nonstop.config.ProbeConfig` (a bad value: one line, exit 2)."""
    c = ProbeConfig()
    p.add_argument(
        "--probe-period",
        type=float,
        default=c.period_s,
        metavar="SECONDS",
        help="each node agent runs its health probes (host memory and clock, NVML where "
        "nvidia-ml-py is installed, --health-cmd) this often; 0: no probes (default %(default)s)",
    )
    p.add_argument(
        "--health-cmd",
        default=c.command,
        metavar="CMD",
        help="a node's own health check, run by each agent every --probe-period (split like a shell "
        "would, run without one; NONSTOP_NODE names the node): exit 0 healthy, else failing; a last "
        'stdout line {"verdict": "degraded", "detail": "..."} refines it',
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=c.timeout_s,
        metavar="SECONDS",
        help="a --health-cmd still running after this is killed and counts as failing (default %(default)s)",
    )


def probes(ns: argparse.Namespace) -> ProbeConfig:
    return ProbeConfig(period_s=ns.probe_period, command=ns.health_cmd, timeout_s=ns.health_timeout)


def lease_arg(g: argparse._ArgumentGroup) -> None:
    """``--lease-ttl`` (in ``nonstop run``'s group "many nodes")."""
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=DetectionConfig().lease_ttl_s,
        help="seconds without a lease renewal after which a node is lost (default %(default)s)",
    )


def quarantine_args(g: argparse._ArgumentGroup) -> None:
    """``--quarantine-failures``, ``--quarantine-window`` (in the group "many nodes")."""
    d = DetectionConfig()
    g.add_argument("--quarantine-failures", type=int, default=d.quarantine_failures)
    g.add_argument("--quarantine-window", type=float, default=d.quarantine_window_s, metavar="SECONDS")


def detection_config(ns: argparse.Namespace) -> DetectionConfig:
    """The job's detection part from the flags above."""
    return DetectionConfig(
        detector=detector(ns),
        straggler=health(ns),
        probes=probes(ns),
        lease_ttl_s=ns.lease_ttl,
        quarantine_failures=ns.quarantine_failures,
        quarantine_window_s=ns.quarantine_window,
    )
