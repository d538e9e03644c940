"""A silent worker, judged where it runs: stuck, or starved of CPU (the agent's second opinion).

The coordinator hears a worker's heartbeat every 0.1 s and calls it hung after
``heartbeat_timeout_s`` (1 s) of silence. On a machine with more runnable threads than cores the
heartbeat thread of a healthy worker can wait that long for a CPU, or for the GIL held by a
training thread that itself waits for a CPU; killing it restarts a rank for nothing. A silence
verdict therefore goes to the worker's node agent as a conditional kill (``unless_moving``), and
the agent, which can read the process in ``/proc``, decides:

* **stopped** (state ``T``/``t``: SIGSTOP, a debugger), or **still** (no thread of it ran or
  waited for a CPU over :data:`WINDOW_S`, none runnable at either end: deadlocked, or blocked in
  the kernel): it is hung. The agent kills it at once (detection stays about a second).
* **moving**: some thread of it ran or waited on the run queue over the window, or was runnable
  (state ``R``) at either look -- slow, not stuck. The agent leaves it alive and says so; the
  coordinator then allows its silence ``JOB_STALL_FACTOR`` times longer, and kills it
  unconditionally past that: a process that spins forever with the GIL held also moves, and is
  caught at the longer limit (:func:`nonstop.policy.decisions.find_hung_ranks`).

Reading: ``/proc/<pid>/stat`` for the state, and for every thread ``/proc/<pid>/task/<tid>/
schedstat`` (nanoseconds on a CPU, nanoseconds runnable but waiting) and ``stat`` (its state).
Where procfs says nothing (another platform, a process gone) the verdict is ``unknown``, and the
agent kills: the judgement only ever spares a process it saw move.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nonstop.protocol.agent import JudgedMsg

__all__ = ["MOVED_NS", "WINDOW_S", "Motion", "Verdict", "judge", "kill_unless_moving", "motion"]

WINDOW_S = 0.2
"""How long the agent watches a silent process (two heartbeat intervals)."""

MOVED_NS = 1_000_000
"""CPU or run-queue nanoseconds, summed over the process's threads, that count as moving."""


@dataclass(frozen=True)
class Motion:
    """One look at a process: its state letter, its threads' schedstat sums, and whether any of
    its threads was runnable (state ``R``: running or waiting for a CPU, not blocked)."""

    state: str
    cpu_ns: int
    wait_ns: int
    runnable: bool = False


@dataclass(frozen=True)
class Verdict:
    """``kind``: ``stopped``, ``still``, ``moving`` or ``unknown``; ``detail`` says what was seen."""

    kind: str
    detail: str

    @property
    def hung(self) -> bool:
        return self.kind != "moving"


def motion(pid: int, proc: str = "/proc") -> Motion | None:
    """``pid``'s state and its threads' CPU and run-queue nanoseconds; None if it cannot be read."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
        # "pid (comm) S ...": the name may hold spaces and parentheses; the state follows the last ")"
        state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode()
        tids = os.listdir(f"{proc}/{pid}/task")
    except (OSError, ValueError):
        return None
    cpu = wait = 0
    runnable = False
    for tid in tids:
        try:
            with open(f"{proc}/{pid}/task/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            cpu += int(fields[0])
            wait += int(fields[1])
            with open(f"{proc}/{pid}/task/{tid}/stat", "rb") as f:
                task = f.read()
            runnable = runnable or task[task.rindex(b")") + 2 : task.rindex(b")") + 3] == b"R"
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended between the listing and the read
    return Motion(state=state, cpu_ns=cpu, wait_ns=wait, runnable=runnable)


def judge(pid: int, *, window_s: float = WINDOW_S, proc: str = "/proc") -> Verdict:
    """Watch ``pid`` for ``window_s`` and say whether it is hung (see the module docstring)."""
    first = motion(pid, proc)
    if first is None:
        return Verdict("unknown", "its /proc entry cannot be read")
    if first.state in ("T", "t"):
        return Verdict("stopped", f"stopped (state {first.state})")
    if first.state in ("Z", "X"):
        return Verdict("stopped", "exited")
    time.sleep(window_s)
    second = motion(pid, proc)
    if second is None:
        return Verdict("unknown", "its /proc entry went away")
    if second.state in ("T", "t"):
        return Verdict("stopped", f"stopped (state {second.state})")
    ran, waited = second.cpu_ns - first.cpu_ns, second.wait_ns - first.wait_ns
    seen = f"{ran / 1e6:.1f} ms on a CPU and {waited / 1e6:.1f} ms waiting for one in {window_s:.2f}s"
    if ran > MOVED_NS or waited > MOVED_NS or first.runnable or second.runnable:
        # (a thread in state R wants a CPU: found in CI, a silent rank killed as "still" with
        # 1.4 ms on a CPU and 1.1 ms waiting for one in the look, state R)
        return Verdict("moving", seen)
    return Verdict("still", f"still: {seen} (state {second.state})")


def kill_unless_moving(
    sid: int, pid: int | None, *, send: Callable[[dict[str, Any]], None], kill: Callable[[int], None]
) -> None:
    """The agent's side of ``kill ... unless_moving``: on a thread of its own, judge process ``sid``
    (``pid``; None: not running here), ``send`` the verdict (``judged``), then ``kill(sid)`` if it
    is hung -- the verdict first, so the coordinator hears it before the exit."""

    def run() -> None:
        verdict = judge(pid) if pid is not None else Verdict("unknown", "not running")
        send(JudgedMsg(spawn_id=sid, hung=verdict.hung, detail=verdict.detail).encode())
        if verdict.hung:
            kill(sid)

    threading.Thread(target=run, name=f"nonstop-agent-judge-{sid}", daemon=True).start()
