"""Failure detection: what the coordinator sees of each worker, turned into verdicts.

The coordinator records observations on :class:`WorkerRecord` as messages
arrive (heartbeats, steps, fault reports, a closed channel); once per tick it
asks :meth:`FailureDetector.scan` which workers to kill (hung, unsteerable)
and which to tell to re-raise their own exception. The hang rule itself is the
pure :func:`~nonstop.policy.decisions.find_hung_ranks`; this module adds the
bookkeeping around it. A process exit needs no verdict: the agent reports it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from nonstop.config import DetectorConfig
from nonstop.coordinator.view import WorkerRecord
from nonstop.policy.decisions import RankObservation, find_hung_ranks, median_step_time
from nonstop.policy.grading import is_peer_symptom

__all__ = ["FailureDetector", "Verdicts", "WorkerRecord"]

# A dying process closes its socket a moment before its exit is seen: only a channel
# closed for longer than this while the process lives counts as a failure.
CLOSE_GRACE_S = 0.5


# A rank told to raise its own exception exits on that order: its heartbeats stop while the
# interpreter unwinds (torch's and gloo's teardown take seconds on a busy machine), and killing it
# as hung then would record a hang for an error. Judged again if it has not exited by then.
RAISE_EXIT_GRACE_S = 60.0


def _exiting(w: WorkerRecord, now: float) -> bool:
    return w.told_to_raise_at is not None and now - w.told_to_raise_at < RAISE_EXIT_GRACE_S


@dataclass
class Verdicts:
    kill: dict[int, str] = field(default_factory=dict)  # spawn id -> reason
    # of those, the ones silent for the first time since they last spoke: their agent is to kill
    # them only if it sees them stuck, not moving (agent/silence.py)
    ask: set[int] = field(default_factory=set)
    reraise: list[int] = field(default_factory=list)  # spawn ids told to re-raise


class FailureDetector:
    """Applies the detection rules of :class:`~nonstop.config.DetectorConfig`."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.step_times: collections.deque[float] = collections.deque(maxlen=64)
        self._last_scan: float | None = None
        # when the coordinator last resumed from a stall of its own (starved of CPU): silence and
        # lack of progress are judged from then on, never across a gap in which it could not read
        # the heartbeats and step reports waiting for it
        self._resumed_at = 0.0

    def record_step(self, seconds: float) -> None:
        self.step_times.append(seconds)

    @property
    def median_step_s(self) -> float | None:
        return median_step_time(list(self.step_times))

    def scan(
        self,
        *,
        now: float,
        members: Mapping[int, WorkerRecord],
        everyone: Iterable[WorkerRecord],
        alive: Callable[[int], bool],
        in_training: bool,
        rebuilding: Collection[int] = (),
        recovering: bool = False,
    ) -> Verdicts:
        """Verdicts for this tick. ``members`` maps rank -> worker playing it.

        Progress is judged only ``in_training``; during a reconfiguration the
        coordinator's stage deadline applies instead, and only heartbeats count.
        ``rebuilding``: ranks joining the new generation's groups (a longer silence is allowed).
        ``recovering``: a generation is being planned or set up after a failure.
        """
        v = Verdicts()
        if any(w.killed_for_hang for w in members.values()):
            # a rank was just killed as hung and its recovery is coming: a peer it held in a
            # collective leaves it with the kill, stepless for as long as the hang lasted, until
            # its fault report or the new generation arrives -- it is not stuck (found under load:
            # an FSDP2 peer blamed while it tore its group down). Heartbeats are still judged.
            in_training = False
        if self._last_scan is not None and now - self._last_scan > max(
            0.2, self.config.heartbeat_timeout_s / 4
        ):
            self._resumed_at = now  # this process did not run for a while: the heartbeats wait unread
        self._last_scan = now
        obs = {
            rank: RankObservation(
                last_heartbeat=max(w.last_hb, self._resumed_at),
                last_progress=max(w.last_progress, self._resumed_at) if in_training else now,
                collective_pending=w.coll,
                idle_s=w.idle_s,
                moving=w.moving,
                excused=w.excused,
                stepped=w.stepped,
                rebuilding=rank in rebuilding,
            )
            for rank, w in members.items()
            if w.chan is not None and not w.killed_for_hang and not _exiting(w, now)
        }
        hung = find_hung_ranks(obs, now=now, median_step_s=self.median_step_s, config=self.config)
        for rank, reason in hung.items():
            at = members[rank].at  # where its training thread was (a progress hang only)
            silent = at is None or reason.startswith("no heartbeat")
            v.kill[members[rank].spawn_id] = reason if silent else f"{reason}, at {at}"
            if (
                self.config.confirm_silence
                and reason.startswith("no heartbeat")
                and not members[rank].excused
            ):
                v.ask.add(members[rank].spawn_id)
        for w in everyone:
            if (
                w.chan_closed_at is not None
                and not w.killed_for_hang
                and now - w.chan_closed_at > CLOSE_GRACE_S
                and alive(w.spawn_id)
            ):
                v.kill.setdefault(w.spawn_id, "control channel closed")
        # An exception no other failure explains within two heartbeat timeouts was the
        # rank's own: it must raise (and exit, and be restarted like any crash). A peer's
        # symptom of it ("connection closed by peer") is explained while a rank that reported a
        # cause is there, or while the recovery of a failure is under way: it waits for that
        # recovery's reconfigure, and survives (told to raise too, a survivor exited beside the
        # rank that raised -- found in a job whose script raised a ValueError on one rank: each
        # failure cost a second, cold replacement).
        # A peer already judged lost -- killed as hung, or its control channel closed (its node
        # partitioned: the recovery starts when the node's lease ends, which may be after two
        # heartbeat timeouts) -- explains it too (found in the chaos soak: a survivor told to
        # raise before a partitioned node's lease ended was replaced cold, and its rescue lost).
        reports = [w for w in members.values() if w.fault_report is not None]
        judged = bool(v.kill) or any(
            w.killed_for_hang or w.chan_closed_at is not None for w in members.values()
        )
        caused = (
            recovering
            or judged
            or any(not is_peer_symptom(w.fault_report[1]) for w in reports if w.fault_report)
        )
        for w in reports:
            assert w.fault_report is not None
            if caused and is_peer_symptom(w.fault_report[1]):
                continue
            if w.told_to_raise_at is None and now - w.fault_report[0] > 2 * self.config.heartbeat_timeout_s:
                v.reraise.append(w.spawn_id)
        return v
