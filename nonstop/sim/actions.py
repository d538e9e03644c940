"""The simulator's label for what recovers a failure: its own modelling, not a runtime decision.

The runtime grades each failure (:func:`nonstop.policy.grading.grade_failure`: restart in place,
replace elsewhere, quarantine the node, fail the job), places its ranks with
:func:`~nonstop.policy.decisions.choose_replacements` and moves ranks live through its swap
machine (:mod:`nonstop.policy.boundary_swap`). A strategy here sees a failure only as a cause
(its :class:`~nonstop.policy.decisions.FailureKind`, whether it came with notice) and a node's
failure history, so it classifies it with :func:`recovery_action` (called through this module:
a test monkeypatches it) and books the result as ``Recovery.action``.
"""

from __future__ import annotations

import enum

from nonstop.policy.decisions import FailureKind

__all__ = ["RecoveryAction", "recovery_action"]


class RecoveryAction(enum.StrEnum):
    """What recovers a simulated failure (see :func:`recovery_action`)."""

    RESTART_IN_PLACE = "restart_in_place"  # process died, node healthy: same node, local memory
    REPLACE_NODE = "replace_node"  # node lost: another node, restore from a peer replica
    QUARANTINE = "quarantine"  # node failed too often: move its ranks off, place nothing there
    MIGRATE = "migrate"  # a planned event (maintenance, preemption notice): move live


def recovery_action(kind: FailureKind, *, quarantined: bool = False, planned: bool = False) -> RecoveryAction:
    """The recovery path for one failure.

    A planned event migrates; a node that the quarantine policy has flagged is
    vacated; a lost node is replaced; any process-level failure (crash, hang,
    exit, error) restarts the rank in place, where its snapshot memory is.
    """
    if planned:
        return RecoveryAction.MIGRATE
    if quarantined:
        return RecoveryAction.QUARANTINE
    if kind is FailureKind.NODE_LOST:
        return RecoveryAction.REPLACE_NODE
    return RecoveryAction.RESTART_IN_PLACE
