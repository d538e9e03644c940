"""Failures: what ends a process or a node becomes a failure, and failures become a recovery.

* **exits** (an agent reports one, or a lost node takes all of its processes at once): an exit
  of a member is a failure, classified (``classify_exit``: crash, error, killed for a hang, node
  lost); a spare's exit costs a replacement spare; a process that died before joining the job
  fails the job (its script cannot start);
* **hangs** (:class:`~nonstop.coordinator.detector.FailureDetector`): a member silent or stuck is
  killed (its exit is then its failure); a member whose own exception nothing else explains is
  told to raise it;
* **recovery**: the failures of one tick start the next generation -- or re-plan the one in
  setup, inheriting its failures -- within the restart budget; a boundary swap in flight is
  aborted first.

Threading: the coordinator's thread only.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import Role, WorkerRecord
from nonstop.faults import fired_at
from nonstop.policy.decisions import JOB_STALL_FACTOR, FailureKind, classify_exit, describe_exit
from nonstop.policy.grading import Grade
from nonstop.policy.phase import JobPhase
from nonstop.policy.reconfiguration import Failure
from nonstop.protocol.worker import RaiseMsg

if TYPE_CHECKING:
    from pathlib import Path

    from nonstop.coordinator.detector import FailureDetector
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import FailureGrader, NodeHistory, Recovery, SwapGuard
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog

__all__ = ["ProcessEnd", "Failures"]

log = logging.getLogger(__name__)

MAX_ERROR_DETAIL = 300
"""Characters of a rank's reported exception a failure's detail carries (the whole is in its
``fault_report`` event): enough for the job's final error to say what the rank raised."""


@dataclass
class ProcessEnd:
    """A process's end as reported: its agent's exit code, or its node's loss."""

    sid: int
    rc: int
    pid: int | None
    fault_at: float | None
    node_lost: str | None = None  # why, if the whole node was lost


class Failures:
    """Exits waiting to be handled (``exits``), and what they lead to (see the module docstring)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        life: JobLife,
        detector: FailureDetector,
        max_restarts: int,
        faults_dir: Path,
        swaps: SwapGuard,
        grader: FailureGrader,
        nodes: NodeHistory,
        recovery: Recovery,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``max_restarts``: the restart budget (``--max-restarts``); ``faults_dir``: where
        injected faults record when they fired (a failure's detection time counts from there)."""
        self.clock = clock
        self.view = view
        self.io = io
        self.events = events
        self.life = life
        self.detector = detector
        self.max_restarts = max_restarts
        self.faults_dir = faults_dir
        self.swaps = swaps
        self.grader = grader
        self.nodes = nodes
        self.recovery = recovery
        self.exits: list[ProcessEnd] = []

    def on_exit(self, ex: ProcessEnd) -> None:
        """A process's end, reported: handled at the next :meth:`handle_exits`."""
        self.exits.append(ex)

    def waiting(self, sids: set[int]) -> bool:
        """Whether any of ``sids`` has exited and its exit is not handled yet."""
        return any(ex.sid in sids for ex in self.exits)

    def handle_exits(self) -> None:
        failures = []
        failed_on: dict[int, str] = {}  # spawn id -> node, of each failure
        fatal: list[str] = []  # failures graded fail_job: no restart can help
        to_quarantine: dict[str, str] = {}  # node -> why, graded quarantine_node beyond its history
        exits, self.exits = self.exits, []
        for ex in exits:
            sid, rc = ex.sid, ex.rc
            w = self.view.workers.pop(sid, None)
            if w is None:
                continue
            node = w.node
            if w.judging_since is not None and ex.node_lost is None:  # it exited before its verdict came
                self._judged(w, hung=True, detail=f"it exited ({describe_exit(rc)}) before it was judged")
            self.events.emit(
                ev.ProcessExited(
                    spawn_id=sid, role=w.role, rank=w.rank, returncode=rc, how=describe_exit(rc), node=node
                )
            )
            is_member = w.rank is not None and self.view.members.get(w.rank) == sid
            self.swaps.on_exit(sid, member=is_member, how=describe_exit(rc))
            if (
                ex.node_lost is None
                and w.chan is None
                and (self.view.phase is JobPhase.STARTING or w.role is Role.SPARE)
            ):
                # It died before reaching nonstop.init(): the script itself cannot start, and
                # starting it again would fail the same way.
                who = f"rank {w.rank}" if w.rank is not None else "a hot spare"
                hint = (
                    "the script must call nonstop.init()"
                    if rc == 0
                    else f"see its output (logs under the job dir of node {node})"
                )
                self.life.fail(f"{who} exited with {describe_exit(rc)} before joining the job: {hint}")
                continue
            if self.view.phase.is_ending:
                if is_member and rc != 0 and self.view.phase is JobPhase.FINISHING:
                    log.warning("rank %s exited with %s after finishing", w.rank, describe_exit(rc))
                continue
            if not is_member:
                if (
                    w.role is Role.SPARE
                    and ex.node_lost is None
                    and node in self.view.nodes
                    and self.view.nodes[node].alive
                    and self.view.room_on(node) != 0  # a device node with no free device: not here
                ):
                    self.io.spawn(node, Role.SPARE, None)  # keep K spares; a lost spare costs nothing else
                continue
            assert w.rank is not None
            if ex.node_lost is not None:
                kind, detail = FailureKind.NODE_LOST, f"node {node} lost: {ex.node_lost}"
            else:
                kind = classify_exit(rc, killed_for_hang=w.killed_for_hang is not None)
                detail = w.killed_for_hang or describe_exit(rc)
                if w.fault_report is not None and kind is FailureKind.EXIT:
                    kind = FailureKind.ERROR  # it reported an exception first: say which
                    detail = f"{detail} after {w.fault_report[1][:MAX_ERROR_DETAIL]}"
            # issue 21: every failure graded (policy/grading.py): fail_job ends the job, a
            # quarantine_node the node's history alone would not have caused (a failing probe)
            # quarantines it, replace_elsewhere has the plan place the rank on another node
            # where a spare or room allows; restart_in_place is today's path
            exception = w.fault_report[1] if w.fault_report is not None else None
            graded = self.grader.grade(
                rank=w.rank,
                spawn_id=sid,
                node=node,
                kind=kind,
                returncode=None if ex.node_lost is not None else rc,
                exception=exception,
                step=self.view.reached(w.rank),
            )
            if graded.grade is Grade.FAIL_JOB:
                fatal.append(f"rank {w.rank} {detail}: {graded.reason} ({exception})")
            if ex.node_lost is None:
                self.nodes.node_failed(node)  # the history-based quarantine, as before
                if graded.grade is Grade.QUARANTINE_NODE:
                    to_quarantine[node] = graded.reason
            fault_at = w.fault_at if w.fault_at is not None else ex.fault_at
            if fault_at is None and w.pid is not None:  # its 'injected' message may be lost with it
                fault_at = fired_at(self.faults_dir, w.pid)
            failures.append(
                Failure(
                    kind=kind.value,
                    rank=w.rank,
                    spawn_id=sid,
                    detail=detail,
                    detected_at=self.clock.wall(),
                    fault_at=fault_at,
                    step=self.view.reached(w.rank),  # snapshotted or not (--snapshot-every)
                    # the grade points at the node (not lost): its spare is the last choice
                    avoid_node=node
                    if graded.grade is Grade.REPLACE_ELSEWHERE and ex.node_lost is None
                    else None,
                )
            )
            failed_on[sid] = node
            del self.view.members[w.rank]
        # the ranks of one lost node failed at one instant: the fault time one of them recorded
        by_node: dict[str, float] = {}
        for f in failures:
            if f.kind == FailureKind.NODE_LOST.value and f.fault_at is not None:
                node = failed_on[f.spawn_id]
                by_node[node] = min(by_node.get(node, f.fault_at), f.fault_at)
        for f in failures:
            if f.kind == FailureKind.NODE_LOST.value and f.fault_at is None:
                f.fault_at = by_node.get(failed_on[f.spawn_id])
        for node, why in to_quarantine.items():
            rec = self.view.nodes.get(node)
            if rec is not None and rec.alive and not rec.quarantined:  # node_failed may have done it
                self.nodes.lose_node(rec, f"quarantined: {why}", quarantine=True)
        if fatal and not self.view.phase.is_terminal:
            self._record(failures)  # the failures that end the job are failures too
            self.life.fail(f"{fatal[0]}: not restarted")
            return
        if self.view.phase is JobPhase.FINISHING and not self.view.members_alive():
            self.life.set_phase(JobPhase.DONE)
            self.events.emit(ev.JobDone(generation=self.view.generation))
        if failures and not self.view.phase.is_terminal:
            self.on_failures(failures)

    def on_failures(self, failures: list[Failure]) -> None:
        self.swaps.abort(
            f"rank {failures[0].rank} failed: {failures[0].detail}", failed=[f.spawn_id for f in failures]
        )
        self._record(failures)
        if self.view.phase is JobPhase.STARTING:  # died before the job formed: just start it again
            if self.view.failures_total <= self.max_restarts:
                for f in failures:
                    node = self.view.rank_node.get(f.rank)
                    alive = self.view.alive_nodes()
                    if not alive:
                        break
                    self.io.spawn(node if node in alive else alive[0], Role.WORKER, f.rank)
                return
        if self.view.failures_total > self.max_restarts:
            self.life.fail(
                f"restart budget exhausted ({self.max_restarts} restarts); last failure: "
                f"rank {failures[-1].rank} {failures[-1].detail}"
            )
            return
        self.recovery.recover(failures)

    def _record(self, failures: list[Failure]) -> None:
        """Log each failure (``failure`` events) and count it against the restart budget."""
        for f in failures:
            self.events.emit(
                ev.Failure(
                    failure_kind=f.kind,
                    rank=f.rank,
                    spawn_id=f.spawn_id,
                    detail=f.detail,
                    step=f.step,
                    detect_s=(f.detected_at - f.fault_at) if f.fault_at else None,
                )
            )
        self.view.failures_total += len(failures)

    def on_judged(self, sid: int, *, hung: bool, detail: str) -> None:
        """A silent worker's agent judged it (``agent/silence.py``): hung (it is being killed),
        or moving -- starved, left alive, its silence allowed ``JOB_STALL_FACTOR`` x longer."""
        w = self.view.workers.get(sid)
        if w is not None:
            self._judged(w, hung=hung, detail=detail)

    def _judged(self, w: WorkerRecord, *, hung: bool, detail: str) -> None:
        sid = w.spawn_id
        if w.judging_since is None or w.killed_for_hang is None:
            return
        w.judging_since = None
        if hung:
            w.killed_for_hang = f"{w.killed_for_hang}; {detail}"
            self.events.emit(ev.HangDetected(rank=w.rank, spawn_id=sid, reason=w.killed_for_hang))
            return
        reason, w.killed_for_hang, w.excused = w.killed_for_hang, None, True
        self.events.emit(ev.SilenceExcused(rank=w.rank, spawn_id=sid, reason=reason, detail=detail))

    def _unanswered(self, now: float) -> None:
        """A silent worker whose agent has not judged it within the excused silence (the agent is
        itself starved, or gone: its lease decides that) is killed unconditionally."""
        limit = self.detector.config.heartbeat_timeout_s * JOB_STALL_FACTOR
        for w in self.view.workers.values():
            if w.judging_since is not None and now - w.judging_since > limit and w.live:
                w.judging_since = None
                w.killed_for_hang = f"{w.killed_for_hang}; its agent did not judge it in {limit:.1f}s"
                why = w.killed_for_hang
                self.events.emit(ev.HangDetected(rank=w.rank, spawn_id=w.spawn_id, reason=why))
                self.io.kill(w.spawn_id, signal.SIGKILL)

    def detect(self) -> None:
        if self.view.phase not in (JobPhase.RUNNING, JobPhase.RECONFIGURING):
            return
        in_training = self.recovery.in_training()
        rebuilding = self.recovery.rebuilding()
        verdicts = self.detector.scan(
            now=self.clock.monotonic(),
            members={rank: self.view.workers[sid] for rank, sid in self.view.members.items()},
            everyone=list(self.view.workers.values()),
            alive=self.view.live,
            in_training=in_training,
            rebuilding=rebuilding,
            recovering=self.view.phase is JobPhase.RECONFIGURING and not in_training,
        )
        now = self.clock.monotonic()
        for sid, reason in verdicts.kill.items():
            w = self.view.workers[sid]
            if w.killed_for_hang:
                continue
            w.killed_for_hang = reason
            if sid in verdicts.ask:  # silent: its agent kills it unless it moves (on_judged)
                w.judging_since = now
                self.io.kill(sid, signal.SIGKILL, unless_moving=True)
                continue
            self.events.emit(ev.HangDetected(rank=w.rank, spawn_id=sid, reason=reason))
            self.io.kill(sid, signal.SIGKILL)
        self._unanswered(now)
        for sid in verdicts.reraise:
            w = self.view.workers[sid]
            w.told_to_raise_at = self.clock.monotonic()  # tell it once; its exit is its failure
            self.io.send(w, RaiseMsg().encode())
