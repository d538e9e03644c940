"""The worker's side of fault injection (``--fail``, :mod:`nonstop.faults`): at each point a fault
may fire (a step starts, a recovery or a migration's preparation restores a step), fire the one due
for this rank, tell the coordinator first (its ``injected`` timestamp starts the MTTR clock), and
turn the planned events (``migrate``, ``preempt``) into what a real one would do.

Two faults are states of the process rather than events (issue 21): ``slowdown`` makes every later
step of this process compute ``factor`` x as long (:meth:`WorkerFaults.stretch` sleeps at the
step's start, before its gradient allreduce, ``factor - 1`` times the process's own compute time
of its previous step, as :meth:`WorkerFaults.observe` measured it without the stretch); a process
that takes the rank over later is not slow. ``degrade`` tells the coordinator that this node's
health verdict is now ``degraded``, as a health probe would.

Threading contract: the training thread only.
"""

from __future__ import annotations

import time

from nonstop.config import WorkerEnv
from nonstop.faults import FaultInjector, preempt_notice_path
from nonstop.protocol.base import HealthMsg, MigrateMsg
from nonstop.protocol.worker import InjectedMsg
from nonstop.snapshot.slot import rank_slot_paths
from nonstop.train.link import CoordinatorLink

__all__ = ["WorkerFaults"]


class WorkerFaults:
    """The faults meant for this worker's job, fired at the right moment."""

    def __init__(self, env: WorkerEnv, link: CoordinatorLink) -> None:
        self.env, self.link = env, link
        self.injector = FaultInjector.from_json(env.faults_json, env.job_dir / "faults")
        self.slowdown: float | None = None  # a slowdown fault's factor, once it fired here
        self._compute_s: float | None = None  # the last step's own compute, without the stretch
        self._stretched_s = 0.0  # seconds stretch() slept in the current step

    def stretch(self) -> None:
        """At a step's start: under a slowdown, sleep ``(factor - 1)`` x the last step's own
        compute time, in 10 ms slices (a recovery interrupts it like a real step)."""
        self._stretched_s = 0.0
        if self.slowdown is None or self._compute_s is None:
            return
        t0 = time.monotonic()
        end = t0 + (self.slowdown - 1) * self._compute_s
        while time.monotonic() < end:
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))
        self._stretched_s = time.monotonic() - t0

    def observe(self, compute_s: float) -> None:
        """A step completed computing ``compute_s`` seconds (its time out of collectives)."""
        self._compute_s = max(0.0, compute_s - self._stretched_s)

    def maybe_fire(self, phase: str, *, rank: int, step: int, generation: int) -> None:
        """Fire the fault due for ``rank`` at ``phase`` of ``step``, if any."""
        env = self.env
        node = int(env.node) if env.node.isdigit() else -1
        due = self.injector.due(rank=rank, step=step, phase=phase, node=node)
        if due is None:
            return
        index, fault = due
        if fault.kind == "preempt":  # the node's notice arrives; its agent drains it
            notice = preempt_notice_path(env.job_dir, env.node)
            tmp = notice.with_suffix(".tmp")
            tmp.write_text(f"{fault.grace}\n")
            tmp.replace(notice)
            return
        if fault.kind == "slowdown":  # a state of this process from now on (not a failure: no
            self.slowdown = fault.factor  # 'injected' message, which would time a later failure)
            return
        if fault.kind == "degrade":  # the node's health verdict, as a probe would send it
            self.link.send(
                HealthMsg(verdict="degraded", probe="fault", detail=f"degrade at step {step}").encode()
            )
            return
        if fault.kind == "migrate":  # a planned event, not a fault: ask and go on training
            to = None if fault.to < 0 else str(fault.to)
            self.link.send(MigrateMsg(gen=generation, rank=rank, to=to).encode())
            return
        self.link.send(
            InjectedMsg(index=index, kind=fault.kind, rank=rank, step=step, ts=time.time()).encode()
        )

        def wipe() -> None:  # the rank's snapshot memory is lost with it
            for path in rank_slot_paths(env.shm_dir, env.job_id, rank):
                path.unlink(missing_ok=True)

        FaultInjector.fire(fault, wipe=wipe, agent_pid=env.agent_pid)
