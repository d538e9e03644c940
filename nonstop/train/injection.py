"""The worker's side of fault injection (``--fail``, :mod:`nonstop.faults`): at each point a fault
may fire (a step starts, a recovery or a migration's preparation restores a step), fire the one due
for this rank, tell the coordinator first (its ``injected`` timestamp starts the MTTR clock), and
turn the planned events (``migrate``, ``preempt``) into what a real one would do.

Threading contract: the training thread only.
"""

from __future__ import annotations

import time

from nonstop.config import WorkerEnv
from nonstop.faults import FaultInjector, preempt_notice_path
from nonstop.snapshot.slot import rank_slot_paths
from nonstop.train.link import CoordinatorLink

__all__ = ["WorkerFaults"]


class WorkerFaults:
    """The faults meant for this worker's job, fired at the right moment."""

    def __init__(self, env: WorkerEnv, link: CoordinatorLink) -> None:
        self.env, self.link = env, link
        self.injector = FaultInjector.from_json(env.faults_json, env.job_dir / "faults")

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
        if fault.kind == "migrate":  # a planned event, not a fault: ask and go on training
            to = None if fault.to < 0 else str(fault.to)
            self.link.send({"t": "migrate", "gen": generation, "rank": rank, "to": to})
            return
        self.link.send(
            {
                "t": "injected",
                "index": index,
                "kind": fault.kind,
                "rank": rank,
                "step": step,
                "ts": time.time(),
            }
        )

        def wipe() -> None:  # the rank's snapshot memory is lost with it
            for path in rank_slot_paths(env.shm_dir, env.job_id, rank):
                path.unlink(missing_ok=True)

        FaultInjector.fire(fault, wipe=wipe, agent_pid=env.agent_pid)
