"""The soak's checks across its jobs: the invariants of each job (:mod:`.invariants`) fed from what
the driver sees, and what a finished job left behind (shared memory, processes)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nonstop.chaos.cluster import Episode, proc_state
from nonstop.chaos.invariants import Invariants, Observation
from nonstop.runtime.gc import processes_of_job
from nonstop.runtime.launcher import default_shm_dir

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

    def new_job(self) -> None:
        self.done.append(self.job)
        self.job = Invariants()
        self.pids = set()

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
        durable = any(e.get("event") == "restore_from_durable" for e in events)
        if status is None:
            return
        members = {int(r): int(rec["pid"]) for r, rec in status["ranks"].items() if rec.get("pid")}
        self.pids |= set(members.values())
        live = frozenset(p for p in self.pids if running(p))
        self.job.observe(Observation(time.monotonic(), members, live), fault=fault)
        self.job.committed(status.get("committed_step"), durable_restore=durable, fault=fault)

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
