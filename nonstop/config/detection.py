"""What failure detection reads (:class:`DetectionConfig`, ``config.detection``): the hang
detector's rules (:class:`~nonstop.policy.decisions.DetectorConfig`), fail-slow ranks and degraded
nodes (:class:`~nonstop.policy.straggler.StragglerConfig`), each node agent's health probes
(:class:`ProbeConfig`), node leases, the quarantine of a node that fails often and the deadline of
a recovery's stage. Each validates its own fields: a bad value is one line naming its flag."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from nonstop.errors import UsageError
from nonstop.policy.decisions import DetectorConfig  # the detection policy's own config
from nonstop.policy.straggler import StragglerConfig  # issue 21: fail-slow detection and action

__all__ = ["DetectionConfig", "DetectorConfig", "ProbeConfig", "StragglerConfig"]


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """``period_s``: seconds between two rounds of probes (0: no probes at all); ``command``:
    the ``--health-cmd`` (None: none), run at most ``timeout_s`` seconds. A bad value raises
    :class:`~nonstop.errors.UsageError` with one line."""

    period_s: float = 10.0
    command: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s >= 0):
            raise UsageError(f"--probe-period must be >= 0 seconds (got {self.period_s}); 0 turns probes off")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise UsageError(f"--health-timeout must be > 0 seconds (got {self.timeout_s})")
        if self.command is not None:
            try:
                argv = shlex.split(self.command)
            except ValueError as e:
                raise UsageError(f"--health-cmd {self.command!r}: {e}") from None
            if not argv:
                raise UsageError("--health-cmd is empty: give the command to run (e.g. /usr/local/bin/check)")
            if self.period_s == 0:
                raise UsageError("--health-cmd needs --probe-period > 0 (0 turns probes off)")

    @property
    def enabled(self) -> bool:
        return self.period_s > 0


@dataclass(frozen=True, kw_only=True)
class DetectionConfig:
    """How failures are found and graded.

    ``detector``: hung and silent workers (``--heartbeat-timeout``, ``--hang-*``). ``straggler``:
    fail-slow ranks and degraded nodes (``--straggler*``, ``--on-degraded``). ``probes``: every
    node agent's health probes (``--probe-period``, ``--health-cmd``). ``lease_ttl_s``: a node
    silent this long is lost (and fences itself; ``--lease-ttl``). ``quarantine_failures`` /
    ``quarantine_window_s``: a node failing this often within this window is quarantined.
    ``rebuild_timeout_s``: a recovery's (or a swap's) stage that overruns it has its laggards
    killed; a worker waits this long for its group's rebuild."""

    detector: DetectorConfig = field(default_factory=DetectorConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    lease_ttl_s: float = 1.0
    quarantine_failures: int = 3
    quarantine_window_s: float = 600.0
    rebuild_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0.05:
            raise UsageError(f"--lease-ttl must be > 0.05 seconds (got {self.lease_ttl_s})")
        if self.quarantine_failures < 1 or self.quarantine_window_s <= 0:
            raise UsageError("--quarantine-failures must be >= 1 and --quarantine-window > 0")
