"""The job's health on the coordinator (issue 21): fail-slow ranks, graded failures, probe verdicts,
and the proactive migrations they lead to. The decisions are pure policies
(:mod:`~nonstop.policy.straggler`, :mod:`~nonstop.policy.grading`,
:mod:`~nonstop.policy.proactive`); this operation feeds them what the coordinator sees, logs
their verdicts and carries them out with the existing machinery (``swaps.request_migration``).

* **steps**: every step report of a member gives its compute time (``step_s - wait_s``) to the
  :class:`~nonstop.policy.straggler.StragglerTracker`; once per tick (while the job runs) the
  tracker judges the members: a newly flagged rank is logged (``straggler``) and shown in
  ``status``; a rank no longer flagged is logged (``straggler_cleared``);
* **--straggler migrate**: a flagged rank is moved live to a node with an idle spare when
  :func:`~nonstop.policy.proactive.decide_migration` says doing nothing costs more (logged as
  ``proactive``; the migration's reason is ``straggler``); at most one such move in flight, and
  each process is moved at most once. The move's cost is the last migration's measured pause,
  else the configured constant;
* **failures**: :meth:`grade` grades one (logged as ``failure_graded``, the last few in
  ``status``); :mod:`~nonstop.coordinator.failures` acts on the grade;
* **probes**: :meth:`on_probe` records a node's verdict (healthy / degraded / failing), sent by
  its agent's probes (:mod:`~nonstop.agent.probes`) or a ``degrade`` fault, used by the
  grading.

Threading: the coordinator's thread only (the event subscriber runs on the thread that logs,
which for ``migration_done`` is the coordinator's).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.view import WorkerRecord
from nonstop.policy.decisions import FailureKind
from nonstop.policy.grading import FailureSignal, Graded, RepeatedErrors, grade_failure
from nonstop.policy.migration import choose_target
from nonstop.policy.phase import JobPhase
from nonstop.policy.proactive import decide_migration, measured_migration_cost
from nonstop.policy.straggler import StragglerTracker, StragglerVerdict
from nonstop.protocol import wire

if TYPE_CHECKING:
    from nonstop.coordinator.peers import Mover
    from nonstop.coordinator.view import JobView
    from nonstop.events.log import EventLog
    from nonstop.policy.decisions import QuarantinePolicy
    from nonstop.policy.straggler import StragglerConfig

__all__ = ["Health"]

GRADES_KEPT = 10  # graded failures shown in status


class Health:
    """See the module docstring."""

    def __init__(
        self,
        *,
        view: JobView,
        events: EventLog,
        config: StragglerConfig,
        quarantine: QuarantinePolicy,
        mover: Mover,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``config``: ``--straggler-*``; ``quarantine``: the nodes' failure history policy a
        grade weighs; ``mover``: where a proactive migration is asked for."""
        self.clock = clock
        self.view = view
        self.events = events
        self.config = config
        self.quarantine = quarantine
        self.mover = mover
        self.tracker = StragglerTracker(self.config)
        self.flagged: dict[int, StragglerVerdict] = {}
        self._dirty = False
        self.total_steps: int | None = None  # the run's length, as the workers say
        self.cost_s: float | None = None  # the last migration's measured cost
        self._moved: set[int] = set()  # spawn ids a proactive move was asked for
        self._said: dict[int, str] = {}  # rank -> the last proactive reason logged (no repeats)
        self.grades: collections.deque[dict[str, Any]] = collections.deque(maxlen=GRADES_KEPT)
        self.repeated = RepeatedErrors()
        self.probes: dict[str, str] = {}  # node -> its latest probe verdict
        events.subscribe(self._on_event)

    # -- steps and stragglers -----------------------------------------------------------------
    def on_step(self, w: WorkerRecord, rank: int, m: wire.Step) -> None:
        """A member's step report (fenced already)."""
        if self.config.mode == "off":
            return
        self.tracker.record(rank, m.step, m.step_s - m.wait_s, who=w.spawn_id)
        if m.of is not None:
            self.total_steps = m.of
        self._dirty = True

    def tick(self) -> None:
        """Judge the members once per tick with new steps, while the job runs."""
        if not self._dirty or self.view.phase is not JobPhase.RUNNING:
            return
        self._dirty = False
        v = self.view
        verdicts = self.tracker.judge(list(v.members))
        for rank in sorted(set(self.flagged) - set(verdicts)):
            del self.flagged[rank]
            self.events.emit(ev.StragglerCleared(rank=rank, step=v.latest_step.get(rank)))
        for rank, verdict in sorted(verdicts.items()):
            sid = v.members[rank]
            if rank not in self.flagged:
                self.events.emit(
                    ev.Straggler(
                        rank=rank,
                        factor=verdict.factor,
                        steps=verdict.steps,
                        window=verdict.window,
                        step=verdict.step,
                        compute_s=round(verdict.compute_s, 6),
                        peers_s=round(verdict.peers_s, 6),
                        spawn_id=sid,
                        node=v.rank_node.get(rank),
                    )
                )
            self.flagged[rank] = verdict
            if self.config.mode == "migrate" and sid not in self._moved:
                self._maybe_migrate(rank, sid, verdict)

    def _maybe_migrate(self, rank: int, sid: int, verdict: StragglerVerdict) -> None:
        v = self.view
        if self.mover.moving:
            return  # one move at a time: judged again once it is over
        alive = v.alive_nodes()
        leaver = v.rank_node.get(rank)
        target = None
        if leaver is not None:
            idle = v.idle_spares()
            target = choose_target(leaver, idle, alive, {n: v.nodes[n].domain for n in alive}, v.load(alive))
        done = min(v.latest_step.values(), default=0)
        remaining = None if self.total_steps is None else max(0, self.total_steps - done)
        decision = decide_migration(
            compute_s=verdict.compute_s,
            peers_s=verdict.peers_s,
            remaining_steps=remaining,
            migration_cost_s=self.cost_s if self.cost_s is not None else self.config.migration_cost_s,
            has_target=target is not None,
        )
        if self._said.get(rank) != decision.reason:  # each distinct reason once, not every tick
            self._said[rank] = decision.reason
            self.events.emit(
                ev.ProactiveDecision(
                    rank=rank,
                    migrate=decision.migrate,
                    reason=decision.reason,
                    expected_loss_s=decision.expected_loss_s,
                    cost_s=decision.cost_s,
                )
            )
        if not decision.migrate:
            return
        self._moved.add(sid)
        error = self.mover.request_migration(rank, target, "straggler")
        if error is not None:
            self.events.emit(ev.MigrationRefused(rank=rank, target=target, reason=error))

    def _on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.MigrationDone):
            self.cost_s = measured_migration_cost(
                event.max_step_gap_s, event.median_step_s, self.config.migration_cost_s
            )

    # -- failures and probes ------------------------------------------------------------------
    def on_probe(
        self, node: str, verdict: str, *, probe: str | None = None, detail: str | None = None
    ) -> None:
        """Node ``node``'s probe said ``verdict``; logged when it changes. A degraded or failing
        verdict drains the node with ``--on-degraded drain`` (when another node has a spare). A
        node is presumed healthy: its first verdict, when healthy, is recorded but not logged
        (every agent's probes send one at start: no news)."""
        prev = self.probes.get(node)
        if prev == verdict:
            return
        self.probes[node] = verdict
        if prev is None and verdict == "healthy":
            return
        self.events.emit(ev.HealthVerdict(node=node, verdict=verdict, probe=probe, detail=detail))
        if verdict != "healthy" and self.config.on_degraded == "drain":
            self._drain(node)

    def _drain(self, node: str) -> None:
        """Move every rank off ``node`` live (reason ``degraded``) and release it once empty, as a
        preemption notice does -- only when some other node has an idle spare to go to."""
        v = self.view
        rec = v.nodes.get(node)
        if rec is None or not rec.alive or rec.draining or v.phase.is_ending:
            return
        alive = v.alive_nodes()
        target = choose_target(
            node, v.idle_spares(), alive, {n: v.nodes[n].domain for n in alive}, v.load(alive)
        )
        ranks = v.ranks_on(node)
        if target is None or not ranks:
            why = "no other node has an idle hot spare" if ranks else "the node plays no rank"
            self.events.emit(
                ev.ProactiveDecision(
                    rank=None,
                    migrate=False,
                    reason=f"drain node {node}: {why}",
                    expected_loss_s=None,
                    cost_s=None,
                )
            )
            return
        rec.draining = True  # no spare is started there again; released once it plays no rank
        for rank in ranks:
            error = self.mover.request_migration(rank, None, "degraded")
            if error is not None:
                self.events.emit(ev.MigrationRefused(rank=rank, target=None, reason=error))

    def grade(
        self,
        *,
        rank: int | None,
        spawn_id: int | None,
        node: str,
        kind: FailureKind,
        returncode: int | None,
        exception: str | None,
        step: int | None = None,
    ) -> Graded:
        """Grade one failure of a process on ``node`` (before the node's history counts it: this
        failure is added here), log it and keep it for ``status``. ``step``: the step its rank
        had reached (an exception raised at the same step generation after generation fails the
        job: :class:`~nonstop.policy.grading.RepeatedErrors`)."""
        now = self.clock.monotonic()
        same = 1
        if exception is not None and step is not None:
            same = self.repeated.count(exception=exception, step=step, generation=self.view.generation)
        rec = self.view.nodes.get(node)
        history = [*(rec.failure_times if rec is not None else ()), now]
        others = len([n for n in self.view.alive_nodes() if n != node])
        graded = grade_failure(
            FailureSignal(
                kind=kind,
                returncode=returncode,
                exception=exception,
                probe=self.probes.get(node),
                node_failures=history if kind is not FailureKind.NODE_LOST else (),
                now=now,
                others_usable=others,
                same_error_generations=same,
            ),
            self.quarantine,
        )
        self.events.emit(
            ev.FailureGraded(
                rank=rank, spawn_id=spawn_id, node=node, grade=graded.grade, reason=graded.reason
            )
        )
        self.grades.append({"rank": rank, "node": node, "grade": str(graded.grade), "reason": graded.reason})
        return graded

    def status(self) -> dict[str, Any]:
        """What ``nonstop status`` shows of the job's health."""
        return {
            "straggler_mode": self.config.mode,
            "stragglers": {
                str(r): {"factor": vd.factor, "steps": vd.steps, "window": vd.window, "step": vd.step}
                for r, vd in sorted(self.flagged.items())
            },
            "grades": list(self.grades),
            "health": dict(sorted(self.probes.items())),
        }
