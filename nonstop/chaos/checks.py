"""The soak's checks across its jobs: the invariants of each job (:mod:`.invariants`) fed from what
the driver sees, and what a finished job left behind (shared memory, processes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nonstop.agent.gc import processes_of_job
from nonstop.chaos.cluster import Episode, proc_state
from nonstop.chaos.invariants import Invariants, Observation
from nonstop.launch.launcher import default_shm_dir

__all__ = ["Checks", "running"]


def running(pid: int) -> bool:
    """``pid`` exists and can run (not a zombie, not stopped)."""
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X", "T", "t")


@dataclass
class Checks:
    """Every failed check of the soak, one line each, and the totals the report gives."""

    failures: list[str] = field(default_factory=list)
    leaked_segments: list[str] = field(default_factory=list)
    leaked_processes: list[int] = field(default_factory=list)
    done: list[Invariants] = field(default_factory=list)
    job: Invariants = field(default_factory=Invariants)
    pids: set[int] = field(default_factory=set)  # every worker pid of the current job
    durable_to: int | None = None  # a durable restore seen, its step: the next drop may go to it

    def new_job(self) -> None:
        self.done.append(self.job)
        self.job = Invariants()
        self.pids = set()
        self.durable_to = None

    @property
    def violations(self) -> list[str]:
        out = list(self.failures)
        for inv in [*self.done, self.job]:
            out += inv.violations
        return out

    @property
    def lost(self) -> int:
        return sum(inv.lost for inv in [*self.done, self.job])

    def fail(self, line: str) -> None:
        self.failures.append(line)

    def look(self, status: dict[str, Any] | None, events: list[dict[str, Any]], *, fault: str = "") -> None:
        """Feed one look at the job: its status (None while the coordinator is away) and the
        events logged since the last look."""
        for e in events:
            if e.get("event") == "spawned" and e.get("pid"):
                self.pids.add(int(e["pid"]))
            if e.get("event") == "restore_from_durable":
                self.durable_to = int(e.get("step", 0))
        if status is None:
            return
        members = {int(r): int(rec["pid"]) for r, rec in status["ranks"].items() if rec.get("pid")}
        self.pids |= set(members.values())
        live = frozenset(p for p in self.pids if running(p))
        ranks = status["ranks"].values()
        connected = frozenset(int(r["pid"]) for r in ranks if r.get("pid") and r.get("connected", True))
        self.job.observe(Observation(time.monotonic(), members, live, connected), fault=fault)
        # A durable restore lets the committed step go back, to that checkpoint or later, once:
        # the status is asked for before the events are read, so the look that reads the event
        # may still show the step before it, and the drop only the next one.
        # Until its first replication round a job of several nodes reports the step in its nodes'
        # memory (no guarantee yet), then the replicated one, which may be lower: the rule holds
        # from the first replicated step on.
        step = status.get("committed_step") if status.get("replicated_step") is not None else None
        last = self.job.last_committed
        durable = False
        if self.durable_to is not None and step is not None and last is not None and step < last:
            durable, self.durable_to = step >= self.durable_to, None
        self.job.committed(step, durable_restore=durable, fault=fault)

    def leftovers(self, job_id: str | None, ep: Episode, prefix: str, timeout: float = 30.0) -> None:
        """After a job: none of its shared-memory segments, worker or node processes may be left
        (each is given ``timeout`` seconds to go)."""
        deadline = time.monotonic() + timeout
        while True:
            procs = set(ep.wait_all(max(0.1, deadline - time.monotonic())))
            segs: list[str] = []
            if job_id is not None:
                procs |= set(processes_of_job(job_id))
                segs = sorted(p.name for p in default_shm_dir().glob(f"nonstop-{job_id}*"))
            procs |= {p for p in self.pids if proc_state(p) not in (None, "Z", "X")}
            if (not procs and not segs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for s in segs:
            self.fail(f"{prefix}shared-memory segment left: {s}")
        for p in sorted(procs):
            self.fail(f"{prefix}process left: pid {p}")
        self.leaked_segments += segs
        self.leaked_processes += sorted(procs)
        self.new_job()
