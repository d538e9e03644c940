"""What operating a running job reads (:class:`OperationsConfig`, ``config.operations``): the
metrics endpoint, preemption notices (SIGTERM's grace, a polled endpoint) and how a live
migration's swap moves the boundary step. Validated alone: a bad value is one line naming its
flag."""

from __future__ import annotations

from dataclasses import dataclass

from nonstop.config.enums import SwapTransfer, set_members
from nonstop.errors import UsageError

__all__ = ["OperationsConfig"]


@dataclass(frozen=True, kw_only=True)
class OperationsConfig:
    """``metrics_port``: Prometheus ``/metrics`` and ``/status`` on the control host (0: any free
    port; None: none). ``preempt_grace_s``: SIGTERM to a node's agent is a preemption notice with
    this grace. ``preempt_url``: an HTTP endpoint polled every ``preempt_poll_s`` for a notice
    (``{node}``: the node's name), with ``preempt_headers`` ("Name: value") on the request.
    ``swap_transfer``: how a live migration's swap fetches the boundary step
    (policy/migration.py: swap_as_delta)."""

    metrics_port: int | None = None
    preempt_grace_s: float = 30.0
    preempt_url: str | None = None
    preempt_headers: tuple[str, ...] = ()
    preempt_poll_s: float = 2.0
    swap_transfer: SwapTransfer = SwapTransfer.AUTO

    def __post_init__(self) -> None:
        set_members(self, (("swap_transfer", SwapTransfer, "--swap-transfer"),))
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise UsageError(
                f"--metrics-port must be in 0..65535 (got {self.metrics_port}); 0 picks a free port"
            )
        if self.preempt_url is not None and not self.preempt_url.startswith(("http://", "https://")):
            raise UsageError(f"--preempt-url must be an http:// or https:// URL (got {self.preempt_url!r})")
        for h in self.preempt_headers:
            if ":" not in h or not h.partition(":")[0].strip():
                raise UsageError(f"--preempt-header must be 'Name: value' (got {h!r})")
        if self.preempt_poll_s <= 0:
            raise UsageError(f"--preempt-poll must be > 0 seconds (got {self.preempt_poll_s})")
