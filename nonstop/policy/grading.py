"""Failure grading: what a failure says about where the rank can run next (pure; no I/O).

Every failure the coordinator handles is graded by :func:`grade_failure` from what is known of
it -- how the process ended (:class:`~nonstop.policy.decisions.FailureKind`, exit code, signal),
the Python exception the worker reported before it died (its ``fault`` message: ``"TypeName:
message"``), the node's latest health-probe verdict, and the node's failure history (the
quarantine policy's window) -- into one of four :class:`Grade` s, with the reason:

=====================  ===========================================================================
``restart_in_place``   the process failed, the node is fine: a spare on the same node restores
                       from local memory (today's path for crashes, hangs, exits, errors)
``replace_elsewhere``  the node is lost, or what killed the process points at the node (a bus
                       error, a device/ECC/NCCL error, a degraded probe): prefer another node
``quarantine_node``    the node failed too often within the window, or its probe says failing:
                       move its ranks off and place nothing there
``fail_job``           no restart can help: the script's own mistake (a ``UsageError``), a
                       program that cannot even load (``SyntaxError``, ``ImportError``), or one
                       that raised the same exception at the same step in
                       :data:`REPEATS_TO_FAIL` generations in a row (:class:`RepeatedErrors`)
=====================  ===========================================================================

The first rule that matches wins, in that table's reverse order (fail, quarantine, replace,
restart). The last usable node is never quarantined (the job would have nowhere to run).
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from nonstop.policy.decisions import FailureKind, QuarantinePolicy

__all__ = [
    "FATAL_EXCEPTIONS",
    "NODE_EXCEPTION_MARKERS",
    "PEER_SYMPTOM_MARKERS",
    "REPEATS_TO_FAIL",
    "FailureSignal",
    "Grade",
    "Graded",
    "RepeatedErrors",
    "grade_failure",
    "is_peer_symptom",
]


class Grade(enum.StrEnum):
    RESTART_IN_PLACE = "restart_in_place"
    REPLACE_ELSEWHERE = "replace_elsewhere"
    QUARANTINE_NODE = "quarantine_node"
    FAIL_JOB = "fail_job"


# Exceptions no restart can fix: the program cannot load. (A TypeError or a ValueError may be the
# script's bug too, but also a symptom of a peer's failure mid-collective: those restart, and
# RepeatedErrors ends a job that raises the same one at the same step generation after generation.)
FATAL_EXCEPTIONS = frozenset({"SyntaxError", "IndentationError", "ImportError", "ModuleNotFoundError"})
# Words in a reported exception that point at the node's hardware or its interconnect.
NODE_EXCEPTION_MARKERS = (
    "ecc",
    "xid",
    "uncorrectable",
    "nccl",
    "cuda error",
    "device-side assert",
    "hardware",
)
# Words in a reported exception that say a collective failed because a peer left it: the symptom
# of another rank's failure, not a cause (gloo, NCCL, torch.distributed, nonstop's own PeerFailed).
PEER_SYMPTOM_MARKERS = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "distbackenderror",
    "remote worker crashing",
    "remote process exited",
    "communicator was aborted",
    "a peer failed",
)
# Signals that point at the node: a bus error (bad memory, a vanished shared-memory file).
NODE_SIGNALS = frozenset({signal.SIGBUS})
PROBE_VERDICTS = ("healthy", "degraded", "failing")
REPEATS_TO_FAIL = 3
"""Generations in a row in which the same exception was raised at the same step before the job
fails instead of restarting again: a restored step that raises the same error each time it runs
is the program's (a bug, a bad sample), and every restart would only replay it. Three, not two:
a transient fault that comes back once (a peer's failure seen the same way twice) still restarts."""


@dataclass(frozen=True, kw_only=True)
class FailureSignal:
    """What is known of one failure. ``returncode``: the agent's (negative: the signal), None
    for a node lost; ``exception``: the worker's reported exception (``"TypeName: message"``);
    ``usage``: it said the script misused nonstop; ``probe``: the node's latest verdict
    (healthy / degraded / failing; None: no probe); ``node_failures``: when the node failed
    before (same clock as ``now``), this failure included; ``others_usable``: live,
    unquarantined nodes besides this one."""

    kind: FailureKind
    returncode: int | None = None
    exception: str | None = None
    usage: bool = False
    probe: str | None = None
    node_failures: Sequence[float] = ()
    now: float = 0.0
    others_usable: int = 0
    same_error_generations: int = 1  # RepeatedErrors.count: this failure's generation included


@dataclass(frozen=True, kw_only=True)
class Graded:
    grade: Grade
    reason: str


def exception_type(text: str | None) -> str | None:
    """``"TypeName: message"`` -> ``"TypeName"`` (a dotted module path dropped)."""
    if not text:
        return None
    head = text.split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if head and " " not in head else None


def is_peer_symptom(text: str | None) -> bool:
    """Whether a reported exception says a peer left the collective (:data:`PEER_SYMPTOM_MARKERS`)."""
    low = (text or "").lower()
    return any(m in low for m in PEER_SYMPTOM_MARKERS)


def grade_failure(sig: FailureSignal, quarantine: QuarantinePolicy) -> Graded:
    """The grade of one failure and why (see the module docstring for the rules)."""
    etype = exception_type(sig.exception)
    if sig.usage:
        return Graded(
            grade=Grade.FAIL_JOB, reason="the script misused nonstop (UsageError): no restart fixes it"
        )
    if etype in FATAL_EXCEPTIONS:
        return Graded(grade=Grade.FAIL_JOB, reason=f"{etype}: the program cannot load; no restart fixes it")
    if sig.exception and sig.same_error_generations >= REPEATS_TO_FAIL:
        return Graded(
            grade=Grade.FAIL_JOB,
            reason=f"the same {etype or 'exception'} at the same step in {sig.same_error_generations} "
            "generations in a row: the program's own error, which every restart replays",
        )
    if sig.others_usable >= 1:
        if sig.probe == "failing":
            return Graded(grade=Grade.QUARANTINE_NODE, reason="the node's health probe says failing")
        if quarantine.should_quarantine(sig.node_failures, now=sig.now, others_usable=sig.others_usable):
            recent = sum(1 for t in sig.node_failures if sig.now - t <= quarantine.window_s)
            return Graded(
                grade=Grade.QUARANTINE_NODE,
                reason=f"{recent} failures on the node within {quarantine.window_s:g}s",
            )
    if sig.kind is FailureKind.NODE_LOST:
        return Graded(grade=Grade.REPLACE_ELSEWHERE, reason="the node is lost")
    if sig.others_usable >= 1:
        rc = sig.returncode
        if rc is not None and rc < 0 and -rc in {s.value for s in NODE_SIGNALS}:
            return Graded(
                grade=Grade.REPLACE_ELSEWHERE,
                reason=f"killed by {signal.Signals(-rc).name}: the node's memory",
            )
        low = (sig.exception or "").lower()
        marker = next((m for m in NODE_EXCEPTION_MARKERS if m in low), None)
        if marker is not None:
            return Graded(
                grade=Grade.REPLACE_ELSEWHERE, reason=f"{etype or 'error'} names the node ({marker!r})"
            )
        if sig.probe == "degraded":
            return Graded(grade=Grade.REPLACE_ELSEWHERE, reason="the node's health probe says degraded")
    what = {
        FailureKind.KILLED: "killed by a signal",
        FailureKind.HANG: "hung (killed by nonstop)",
        FailureKind.EXIT: "exited",
        FailureKind.ERROR: f"raised {etype or 'an exception'}",
    }.get(sig.kind, str(sig.kind))
    return Graded(grade=Grade.RESTART_IN_PLACE, reason=f"the process {what}; the node is healthy")


class RepeatedErrors:
    """How many generations in a row raised one exception at one step (pure; no I/O).

    :meth:`count` is called for each failure with a reported exception: the exception's text,
    the step its rank had reached, and the generation. The count is the number of distinct
    generations that raised that same text at that same step since the last failure that did
    not (a different text or step: the job moved on, or it is another fault). Failures without
    an exception (kills, hangs, lost nodes) leave it alone: a node lost between two replays of a
    bug does not make the bug less deterministic. Several ranks raising it in one generation
    count once."""

    def __init__(self) -> None:
        self._key: tuple[str, int] | None = None
        self._generations: set[int] = set()

    def count(self, *, exception: str, step: int, generation: int) -> int:
        key = (exception, step)
        if key != self._key:
            self._key, self._generations = key, set()
        self._generations.add(generation)
        return len(self._generations)
