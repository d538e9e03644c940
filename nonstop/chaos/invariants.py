"""What must hold through every fault of a chaos soak, checked from what the driver observed (pure).

* **No rank runs twice**: a process that played a rank and no longer does (it was replaced, its node
  was fenced, lost, drained or cut off) must be gone -- dead, or stopped (SIGSTOP: it runs nothing)
  -- within ``grace_s`` of the driver first seeing it replaced; one still running then means two
  processes may have played that rank at once.
* **The committed step never goes back**, except to a durable checkpoint when memory was lost (a
  ``restore_from_durable`` between the two observations).
* **No committed step is lost**: a recovery from memory restores at least the committed step the
  driver saw before the fault; one from the durable tier (memory lost on purpose) at least the
  newest checkpoint that was intact before the fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["Invariants", "Observation", "lost_steps"]


@dataclass(frozen=True)
class Observation:
    """One look at the job: when (the driver's clock), the rank -> pid of its members (the
    coordinator's status), which pids of the job's workers are running (alive, not stopped), and
    which members' processes have connected (``connected``; None: all of them). A member that
    never connected never played its rank: a cold process a hot spare took the rank from before
    it came up waits as a spare, which is no rank running twice."""

    t: float
    members: Mapping[int, int]
    running: frozenset[int]
    connected: frozenset[int] | None = None


def lost_steps(*, restore_step: int, expected_min: int | None) -> int:
    """Committed steps a recovery lost: how far it restored below what it had to keep."""
    if expected_min is None:
        return 0
    return max(0, expected_min - restore_step)


@dataclass
class Invariants:
    """Accumulates observations of one job; ``violations`` says what broke, one line each."""

    grace_s: float = 10.0
    violations: list[str] = field(default_factory=list)
    lost: int = 0
    _rank_of: dict[int, int] = field(default_factory=dict)  # pid -> the rank it last played
    _left_at: dict[int, float] = field(default_factory=dict)  # pid -> when seen replaced
    _flagged: set[int] = field(default_factory=set)
    _committed: int | None = None

    # -- no rank runs twice ------------------------------------------------------------------------
    def observe(self, obs: Observation, *, fault: str = "") -> None:
        members = {pid: rank for rank, pid in obs.members.items()}
        for pid, rank in members.items():
            if obs.connected is None or pid in obs.connected or pid in self._rank_of:
                self._rank_of[pid] = rank
            self._left_at.pop(pid, None)
        for pid, rank in self._rank_of.items():
            if pid in members:
                continue
            left = self._left_at.setdefault(pid, obs.t)
            if pid in obs.running and obs.t - left > self.grace_s and pid not in self._flagged:
                self._flagged.add(pid)
                now = obs.members.get(rank)
                self.violations.append(
                    f"{fault}rank {rank} runs twice: pid {pid} played it and still runs "
                    f"{obs.t - left:.1f}s after pid {now} took it"
                )

    def pids_replaced(self) -> list[int]:
        """Pids that played a rank and no longer do (to be checked for being gone)."""
        return sorted(self._left_at)

    # -- the committed step ------------------------------------------------------------------------
    def committed(self, step: int | None, *, durable_restore: bool = False, fault: str = "") -> None:
        """The committed step observed now; ``durable_restore``: memory was lost since the last
        observation and the job restored a durable checkpoint (it may go back, to that)."""
        if step is None:
            return
        if self._committed is not None and step < self._committed and not durable_restore:
            self.violations.append(f"{fault}the committed step went back from {self._committed} to {step}")
        if self._committed is None or step > self._committed or durable_restore:
            self._committed = step

    @property
    def last_committed(self) -> int | None:
        return self._committed

    # -- no committed step lost --------------------------------------------------------------------
    def recovery(self, *, restore_step: int, expected_min: int | None, tier: str, fault: str = "") -> int:
        """A recovery restored ``restore_step`` from ``tier``; it had to keep ``expected_min``."""
        n = lost_steps(restore_step=restore_step, expected_min=expected_min)
        if n:
            self.lost += n
            self.violations.append(
                f"{fault}{n} committed step(s) lost: restored step {restore_step} from {tier}, "
                f"but step {expected_min} was committed"
            )
        return n


def leaks(segments: Iterable[str], processes: Iterable[int]) -> list[str]:
    """One line per leaked shared-memory segment and process (none must be left)."""
    out = [f"shared-memory segment left: {s}" for s in sorted(segments)]
    out += [f"process left: pid {p}" for p in sorted(processes)]
    return out
