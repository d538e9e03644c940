"""The coordinator: membership, generations, failure detection, recovery.

Threading: one thread (the caller of :meth:`Coordinator.run`) owns all state.
The control server's threads only put events on a queue; the agent is polled.

Fencing: every message from a worker carries the generation it was sent in;
``restored``/``ready``/``step``/``done``/``fault`` from an older generation
are ignored, so a late message can never complete a newer reconfiguration.
"""

from __future__ import annotations

import enum
import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nonstop.config import JobConfig
from nonstop.control.channel import Channel, ControlServer, Message
from nonstop.errors import ControlError, NonstopError
from nonstop.faults import fired_at
from nonstop.runtime.agent import Agent
from nonstop.runtime.detector import FailureDetector, WorkerRecord
from nonstop.runtime.eventlog import EventLog
from nonstop.runtime.policy import (
    FailureKind,
    classify_exit,
    describe_exit,
    plan_recovery,
)
from nonstop.runtime.recovery import Failure, Reconfiguration, Stage
from nonstop.snapshot.persist import Persister

__all__ = ["Coordinator", "JobResult", "JobState"]

log = logging.getLogger(__name__)

TICK_S = 0.005
PLAN_WAIT_S = 2.0


class JobState(enum.StrEnum):
    STARTING = "starting"
    RECONFIGURING = "reconfiguring"
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"


@dataclass
class JobResult:
    state: JobState
    generation: int
    final_step: int
    failures: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    median_step_s: float | None = None


class Coordinator:
    def __init__(
        self,
        *,
        config: JobConfig,
        agent: Agent,
        server: ControlServer,
        events: EventLog,
        persister: Persister | None = None,
        initial_step: int | None = None,
    ) -> None:
        self.config = config
        self.persister = persister
        self.initial_step = initial_step  # resumed from the durable tier: restore this first
        self.clients: dict[int, Channel] = {}  # `nonstop persist` and other control clients
        self.client_tickets: list[tuple[Channel, int]] = []
        self.agent = agent
        self.server = server
        self.events = events
        self.world_size = config.nproc_per_node
        self.state = JobState.STARTING
        self.generation = 0
        self.workers: dict[int, WorkerRecord] = {}
        self.members: dict[int, int] = {}  # rank -> spawn_id
        self.reconf: Reconfiguration | None = None
        self.failures_total = 0
        self.reports: list[dict[str, Any]] = []
        self.detector = FailureDetector(config.detector)
        self.latest_step: dict[int, int] = {}
        self.done_ranks: set[int] = set()
        self.error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> JobResult:
        for rank in range(self.world_size):
            self._spawn("worker", rank)
        for _ in range(self.config.spares):
            self._spawn("spare", None)
        while self.state not in (JobState.DONE, JobState.FAILED):
            if stop.is_set():
                self._fail("stopped by signal")
                break
            self._pump_events(TICK_S)
            self._handle_exits()
            # Handling an exit can take a while (planning waits for in-flight snapshot
            # writes): read the heartbeats that arrived meanwhile before judging silence.
            self._pump_events(0)
            self._detect()
            self._check_timeouts()
            self._answer_clients()
        final = min(self.latest_step.values()) if self.latest_step else 0
        return JobResult(
            state=self.state,
            generation=self.generation,
            final_step=final,
            failures=self.reports,
            error=self.error,
            median_step_s=self.detector.median_step_s,
        )

    def _spawn(self, role: str, rank: int | None) -> int:
        sid = self.agent.spawn(role)
        now = time.monotonic()
        self.workers[sid] = WorkerRecord(spawn_id=sid, role=role, rank=rank, last_hb=now, last_progress=now)
        if rank is not None:
            self.members[rank] = sid
        self.events.emit("spawn", spawn_id=sid, role=role, rank=rank, pid=self.agent.pid(sid))
        return sid

    def _fail(self, error: str) -> None:
        self.error = error
        self.state = JobState.FAILED
        self.events.emit("job_failed", error=error)
        for w in self.workers.values():
            self._send(w, {"t": "abort", "error": error})

    def _send(self, w: WorkerRecord, msg: Message) -> None:
        if w.chan is not None and not w.chan.closed:
            try:
                w.chan.send(msg)
            except ControlError:
                pass

    # -- events ------------------------------------------------------------------------------
    def _pump_events(self, timeout: float) -> None:
        try:
            kind, chan, msg = self.server.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._on_event(kind, chan, msg)
            try:
                kind, chan, msg = self.server.events.get_nowait()
            except queue.Empty:
                return

    def _on_event(self, kind: str, chan: Channel, msg: Message | None) -> None:
        if kind == "open" and chan.hello.get("role") == "client":
            chan.tag = -1 - len(self.clients)
            self.clients[chan.tag] = chan
            self.events.emit("client", peer=chan.peer)
            return
        if kind == "msg" and msg is not None and chan.tag in self.clients:
            self._on_client(chan, msg)
            return
        if kind == "open":
            sid = int(chan.hello.get("spawn_id", -1))
            w = self.workers.get(sid)
            if w is None or w.chan is not None:
                self.events.emit("refused", peer=chan.peer, reason=f"unknown or duplicate spawn id {sid}")
                chan.close()
                return
            chan.tag = sid
            w.chan = chan
            w.last_hb = time.monotonic()
            self.events.emit("connect", spawn_id=sid, role=w.role, rank=w.rank)
            self._on_connect(w)
        elif kind == "msg" and msg is not None:
            w = self.workers.get(chan.tag)
            if w is not None:
                self._on_message(w, msg)
        elif kind == "close":
            w = self.workers.get(chan.tag)
            if w is not None:
                w.chan_closed_at = time.monotonic()

    def _on_client(self, chan: Channel, msg: Message) -> None:
        if msg.get("t") == "persist":
            if self.persister is None:
                chan.send({"t": "persisted", "error": "this job has no durable tier"})
                return
            self.client_tickets.append((chan, self.persister.request()))
        else:
            chan.send({"t": "error", "error": f"unknown request {msg.get('t')!r}"})

    def _answer_clients(self) -> None:
        if not self.client_tickets or self.persister is None:
            return
        pending = []
        for chan, ticket in self.client_tickets:
            if not self.persister.wait(ticket, 0):
                pending.append((chan, ticket))
                continue
            last = self.persister.last
            reply: Message = {"t": "persisted", "error": self.persister.last_error}
            if last is not None:
                reply.update(step=last.step, url=self.persister.durable.url, stored_bytes=last.stored_bytes)
            try:
                chan.send(reply)
            except ControlError:
                pass
        self.client_tickets = pending

    def _on_connect(self, w: WorkerRecord) -> None:
        if self.state is JobState.STARTING:
            if all(self.workers[sid].chan is not None for sid in self.members.values()):
                self._begin_generation([])
            return
        r = self.reconf
        if r is not None and w.role == "spare" and r.waiting_launch:
            # A spare came up before the cold process launched for a rank: it takes the
            # rank, and the cold process will wait as a spare when it connects.
            rank = min(r.waiting_launch)
            cold = self.workers[self.members[rank]]
            cold.role, cold.rank = "spare", None
            w.role, w.rank = "worker", rank
            self.members[rank] = w.spawn_id
            r.replacements[rank] = "spare"
            self.events.emit("spare_takes_over", rank=rank, spawn_id=w.spawn_id, cold_spawn_id=cold.spawn_id)
        if r is not None and w.rank is not None and w.rank in r.waiting_launch:
            r.waiting_launch.discard(w.rank)
            self._send_reconfigure(w)
            self._advance()

    def _on_message(self, w: WorkerRecord, msg: Message) -> None:
        t = msg.get("t")
        now = time.monotonic()
        if t == "hb":
            w.last_hb = now
            w.coll = bool(msg.get("coll"))
            return
        if t == "injected":
            w.fault_at = float(msg["ts"])
            self.events.emit(
                "fault_injected",
                rank=msg.get("rank"),
                step=msg.get("step"),
                kind=msg.get("kind"),
                spawn_id=w.spawn_id,
            )
            return
        gen = int(msg.get("gen", -1))
        if gen != self.generation or w.rank is None or self.members.get(w.rank) != w.spawn_id:
            return  # fenced: an older generation, or not (any more) a member
        rank = w.rank
        if t == "step":
            w.last_progress, w.stepped = now, True
            self.detector.record_step(float(msg["step_s"]))
            self.latest_step[rank] = int(msg["step"])
            if self.reconf is not None:
                self.reconf.stepped.add(rank)
                self._advance()
        elif t == "restored" and self.reconf is not None:
            self.reconf.restored.add(rank)
            self._advance()
        elif t == "ready" and self.reconf is not None:
            self.reconf.ready.add(rank)
            w.last_progress = now
            self._advance()
        elif t == "done":
            self.latest_step[rank] = int(msg["step"])
            self.done_ranks.add(rank)
            if self.reconf is not None:
                self.reconf.stepped.add(rank)
                self._advance()
            if self.state is JobState.RUNNING and self.done_ranks >= set(range(self.world_size)):
                self._finish()
        elif t == "fault":
            w.fault_report = (now, str(msg.get("error", "")))
            self.events.emit("fault_report", rank=rank, spawn_id=w.spawn_id, error=msg.get("error"))

    # -- failures ----------------------------------------------------------------------------
    def _handle_exits(self) -> None:
        failures = []
        for sid, rc in self.agent.poll():
            pid = self.agent.exited_pids.get(sid)
            w = self.workers.pop(sid, None)
            if w is None:
                continue
            self.events.emit(
                "exit", spawn_id=sid, role=w.role, rank=w.rank, returncode=rc, how=describe_exit(rc)
            )
            is_member = w.rank is not None and self.members.get(w.rank) == sid
            if w.chan is None and (self.state is JobState.STARTING or w.role == "spare"):
                # It died before reaching nonstop.init(): the script itself cannot start, and
                # starting it again would fail the same way.
                who = f"rank {w.rank}" if w.rank is not None else "a hot spare"
                hint = (
                    "the script must call nonstop.init()"
                    if rc == 0
                    else "see its output"
                    + (f" in {self.agent.job_dir / 'logs'}" if self.agent.redirect_output else "")
                )
                self._fail(f"{who} exited with {describe_exit(rc)} before joining the job: {hint}")
                continue
            if self.state in (JobState.FINISHING, JobState.DONE, JobState.FAILED):
                if is_member and rc != 0 and self.state is JobState.FINISHING:
                    log.warning("rank %s exited with %s after finishing", w.rank, describe_exit(rc))
                continue
            if not is_member:
                if w.role == "spare":
                    self._spawn("spare", None)  # keep K spares; a lost spare costs nothing else
                continue
            assert w.rank is not None
            kind = classify_exit(rc, killed_for_hang=w.killed_for_hang is not None)
            if w.fault_report is not None and kind is FailureKind.EXIT:
                kind = FailureKind.ERROR
            detail = w.killed_for_hang or describe_exit(rc)
            if w.fault_at is None and pid is not None:  # its 'injected' message may still be in flight
                w.fault_at = fired_at(self.agent.job_dir / "faults", pid)
            failures.append(
                Failure(
                    kind=kind.value,
                    rank=w.rank,
                    spawn_id=sid,
                    detail=detail,
                    detected_at=time.time(),
                    fault_at=w.fault_at,
                    step=self.latest_step.get(w.rank, 0),
                )
            )
            del self.members[w.rank]
        if self.state is JobState.FINISHING and not self._members_alive():
            self.state = JobState.DONE
            self.events.emit("job_done", generation=self.generation)
        if failures:
            self._on_failures(failures)

    def _on_failures(self, failures: list[Failure]) -> None:
        for f in failures:
            self.events.emit(
                "failure",
                kind=f.kind,
                rank=f.rank,
                spawn_id=f.spawn_id,
                detail=f.detail,
                step=f.step,
                detect_s=(f.detected_at - f.fault_at) if f.fault_at else None,
            )
        self.failures_total += len(failures)
        if self.state is JobState.STARTING:  # died before the job formed: just start it again
            if self.failures_total <= self.config.max_restarts:
                for f in failures:
                    self._spawn("worker", f.rank)
                return
        if self.failures_total > self.config.max_restarts:
            self._fail(
                f"restart budget exhausted ({self.config.max_restarts} restarts); last failure: "
                f"rank {failures[-1].rank} {failures[-1].detail}"
            )
            return
        previous = self.reconf if self.state is JobState.RECONFIGURING else None
        if previous is None:
            self._begin_generation(failures)
        else:  # a failure during a recovery: re-plan, keeping what the interrupted plan did
            self._begin_generation(
                previous.failures + failures, replans=previous.replans + 1, replacements=previous.replacements
            )

    def _detect(self) -> None:
        if self.state not in (JobState.RUNNING, JobState.RECONFIGURING):
            return
        in_training = self.state is JobState.RUNNING or (
            self.reconf is not None and self.reconf.stage is Stage.RESUME
        )
        verdicts = self.detector.scan(
            now=time.monotonic(),
            members={rank: self.workers[sid] for rank, sid in self.members.items()},
            everyone=list(self.workers.values()),
            alive=lambda sid: sid in self.agent.procs,
            in_training=in_training,
        )
        for sid, reason in verdicts.kill.items():
            w = self.workers[sid]
            w.killed_for_hang = reason
            self.events.emit("hang_detected", rank=w.rank, spawn_id=sid, reason=reason)
            self.agent.kill(sid, signal.SIGKILL)
        for sid in verdicts.reraise:
            w = self.workers[sid]
            assert w.fault_report is not None
            w.fault_report = (float("inf"), w.fault_report[1])  # tell it once
            self._send(w, {"t": "raise"})

    def _check_timeouts(self) -> None:
        r = self.reconf
        if self.state is not JobState.RECONFIGURING or r is None or r.stage in (Stage.LAUNCH, Stage.RESUME):
            return
        if r.deadline == 0.0:
            r.deadline = time.time() + self.config.rebuild_timeout_s
        if time.time() > r.deadline:
            waiting = r.restored if r.stage is Stage.RESTORE else r.ready
            for rank in set(range(self.world_size)) - waiting:
                sid = self.members.get(rank)
                if sid is not None and sid in self.workers:
                    self.workers[sid].killed_for_hang = f"stage {r.stage} timed out"
                    self.agent.kill(sid)
            r.deadline = time.time() + self.config.rebuild_timeout_s  # one kill round per period

    # -- reconfiguration -------------------------------------------------------------------------
    def _begin_generation(
        self, failures: list[Failure], *, replans: int = 0, replacements: dict[int, str] | None = None
    ) -> None:
        now = time.time()
        self.generation += 1
        self.state = JobState.RECONFIGURING
        self.done_ranks.clear()
        missing = [r for r in range(self.world_size) if r not in self.members]
        idle = [
            sid
            for sid, w in self.workers.items()
            if w.role == "spare" and w.rank is None and w.chan is not None and not w.killed_for_hang
        ]
        if failures:
            complete = self._settled_snapshots()
        elif self.initial_step is not None:  # resumed: the durable checkpoint is in every rank's slots
            complete = self.agent.complete_steps(self.world_size)
            self.initial_step = None
        else:
            complete = {}
        plan = plan_recovery(
            failed_ranks=missing, idle_spares=idle, complete_steps=complete, world_size=self.world_size
        )
        if failures and plan.restore_step is None and self._restore_from_durable():
            # Memory has no step every rank holds (a rank's memory was lost): next tier.
            complete = self.agent.complete_steps(self.world_size)
            plan = plan_recovery(
                failed_ranks=missing, idle_spares=idle, complete_steps=complete, world_size=self.world_size
            )
        if failures and plan.restore_step is None:
            # Survivors hold later state than any fresh process could: never mix them.
            self._fail(
                "no step is snapshotted for every rank in memory or in the durable tier "
                f"({self.persister.durable.url if self.persister else 'none configured'}); "
                "cannot recover this failure (persist more often with --persist-every)"
            )
            return
        r = Reconfiguration(
            generation=self.generation,
            world_size=self.world_size,
            failures=failures,
            restore_step=plan.restore_step,
            replans=replans,
            replacements=dict(replacements or {}),
        )
        r.marks["detect"] = max((f.detected_at for f in failures), default=now)
        if failures and plan.restore_step is not None:
            # committed steps redone: what every rank had reported done, minus where we restart
            committed = min((self.latest_step.get(rank, 0) for rank in range(self.world_size)), default=0)
            r.lost_steps = max(0, committed - plan.restore_step)
        spares = list(plan.spares_used)
        for rank, source in plan.replacements.items():
            r.replacements[rank] = source.value
            if source.value == "spare":
                sid = spares.pop(0)
                w = self.workers[sid]
                w.rank, w.role = rank, "worker"
                w.last_progress, w.stepped = time.monotonic(), False
                self.members[rank] = sid
            else:
                self._spawn("worker", rank)
                r.waiting_launch.add(rank)
        r.marks["plan"] = time.time()
        self.reconf = r
        self.events.emit(
            "generation",
            generation=self.generation,
            restore_step=plan.restore_step,
            members={str(k): v for k, v in sorted(self.members.items())},
            replacements=r.replacements,
            cause=[f.rank for f in failures],
            replans=replans,
        )
        for rank, sid in self.members.items():
            if self.workers[sid].chan is None:  # still starting (e.g. launched by a re-planned generation)
                r.waiting_launch.add(rank)
            elif rank not in r.waiting_launch:
                self._send_reconfigure(self.workers[sid])
        r.stage = Stage.LAUNCH
        self._advance()

    def _restore_from_durable(self) -> bool:
        """Install the newest good durable checkpoint into every rank's slots."""
        if self.persister is None:
            return False
        t0 = time.monotonic()
        try:
            ckpt = self.persister.durable.load(world_size=self.world_size)
        except NonstopError as e:
            self.events.emit("durable_unavailable", error=str(e))
            return False
        self.agent.install(ckpt.step, [ckpt.ranks[r] for r in range(self.world_size)])
        self.events.emit(
            "restore_from_durable",
            step=ckpt.step,
            url=self.persister.durable.url,
            seconds=time.monotonic() - t0,
        )
        return True

    def _settled_snapshots(self) -> dict[int, list[int]]:
        """Complete steps per rank, after live processes finish the snapshot they are writing.

        A survivor may be copying the very step the failed rank already committed;
        waiting the few milliseconds that takes saves redoing that step. A slot left
        WRITING by a dead writer is not waited for (the slot names its writer's pid).
        Bounded: a writer that does not finish within PLAN_WAIT_S is planned around.
        """
        deadline = time.monotonic() + PLAN_WAIT_S
        while True:
            complete = self.agent.complete_steps(self.world_size)
            writing = self.agent.writing_steps(self.world_size)
            if not writing or time.monotonic() > deadline:
                return complete
            time.sleep(0.002)

    def _send_reconfigure(self, w: WorkerRecord) -> None:
        r = self.reconf
        assert r is not None and w.rank is not None
        w.stepped, w.coll, w.fault_report = False, False, None
        self._send(
            w,
            {
                "t": "reconfigure",
                "gen": r.generation,
                "rank": w.rank,
                "world_size": self.world_size,
                "restore_step": r.restore_step,
                "recovery": bool(r.failures),
            },
        )

    def _advance(self) -> None:
        r = self.reconf
        if r is None:
            return
        before = r.stage
        after = r.advance()
        if after is not before:
            r.deadline = 0.0  # each stage gets its own rebuild_timeout_s
        order = [Stage.LAUNCH, Stage.RESTORE, Stage.REBUILD, Stage.RESUME, Stage.DONE]
        now = time.time()
        for s in order[order.index(before) : order.index(after)]:
            r.marks[s.value] = now
            self.events.emit(
                "stage", generation=r.generation, stage=s.value, seconds=now - r.marks[_previous(s)]
            )
        if before is not Stage.REBUILD and after in (Stage.REBUILD, Stage.RESUME, Stage.DONE):
            for sid in self.members.values():
                self._send(self.workers[sid], {"t": "rebuild", "gen": r.generation})
        if after in (Stage.RESUME, Stage.DONE) and before not in (Stage.RESUME, Stage.DONE):
            self.state = JobState.RUNNING
            now_m = time.monotonic()
            for sid in self.members.values():
                self.workers[sid].last_progress = now_m
        if after is Stage.DONE:
            self.reconf = None
            if r.failures:
                records = r.report()
                self.reports.extend(records)
                for rec in records:
                    self.events.emit("recovery", **rec)
            self._replenish_spares()
            if self.done_ranks >= set(range(self.world_size)) and self.state is JobState.RUNNING:
                self._finish()

    def _finish(self) -> None:
        """Every rank has the final step snapshotted: release members and spares."""
        self.state = JobState.FINISHING
        self.events.emit("finish", step=min(self.latest_step.values(), default=0), generation=self.generation)
        for w in self.workers.values():
            self._send(w, {"t": "finish"})

    def _members_alive(self) -> bool:
        return any(sid in self.agent.procs for sid in self.members.values())

    def _replenish_spares(self) -> None:
        have = sum(1 for w in self.workers.values() if w.role == "spare")
        for _ in range(self.config.spares - have):
            self._spawn("spare", None)


def _previous(stage: Stage) -> str:
    return {
        Stage.LAUNCH: "plan",
        Stage.RESTORE: "launch",
        Stage.REBUILD: "restore",
        Stage.RESUME: "rebuild",
        Stage.DONE: "resume",
    }.get(stage, "plan")
