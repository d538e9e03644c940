"""Who played each rank when: the :class:`RankInterval` records of a log, built as its events are
read (a process spawned for a rank starts, its generation trains, a failure or the end stops it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.timeline.model import RankInterval

__all__ = ["OpenRank", "RankBuilder"]


@dataclass
class OpenRank:
    """A rank's interval not closed yet (training, or its process starting)."""

    rank: int
    spawn_id: int | None
    node: str | None
    generation: int
    start: float
    phase: str = "train"


@dataclass
class RankBuilder:
    """The rank intervals so far, and what is open: who plays each rank (``members``, on
    ``rank_node``) in ``generation``, which ranks train, which processes are starting."""

    intervals: list[RankInterval] = field(default_factory=list)
    open: dict[int, OpenRank] = field(default_factory=dict)
    members: dict[int, int] = field(default_factory=dict)
    rank_node: dict[int, str] = field(default_factory=dict)
    spawned_for: dict[int, tuple[int, str | None, float]] = field(
        default_factory=dict
    )  # sid -> rank, node, t
    started: dict[int, OpenRank] = field(default_factory=dict)  # rank -> its new process starting
    trained: set[int] = field(default_factory=set)  # spawn ids that have trained
    generation: int = 0

    def close(self, rank: int, t: float, reason: str) -> None:
        o = self.open.pop(rank, None)
        if o is not None:
            self.intervals.append(
                RankInterval(
                    rank=o.rank,
                    spawn_id=o.spawn_id,
                    node=o.node,
                    generation=o.generation,
                    start=o.start,
                    end=max(t, o.start),
                    phase=o.phase,
                    end_reason=reason,
                )
            )

    def close_all(self, t: float, reason: str) -> None:
        for rank in sorted(self.open):
            self.close(rank, t, reason)
        for rank in sorted(self.started):
            o = self.started.pop(rank)
            self.intervals.append(
                RankInterval(
                    rank=rank,
                    spawn_id=o.spawn_id,
                    node=o.node,
                    generation=o.generation,
                    start=o.start,
                    end=max(t, o.start),
                    phase="start",
                    end_reason=reason,
                )
            )

    def train(self, t: float) -> None:
        """The current generation trains from ``t``: open an interval for every member."""
        for rank, sid in sorted(self.members.items()):
            if rank in self.open:
                continue
            st = self.started.get(rank)
            if st is not None and st.spawn_id == sid:
                del self.started[rank]
                if sid not in self.trained:
                    self.intervals.append(
                        RankInterval(
                            rank=rank,
                            spawn_id=sid,
                            node=st.node,
                            generation=self.generation,
                            start=st.start,
                            end=max(t, st.start),
                            phase="start",
                            end_reason="trains",
                        )
                    )
            self.trained.add(sid)
            self.open[rank] = OpenRank(rank, sid, self.rank_node.get(rank), self.generation, t)

    def fail(self, rank: int, fault_t: float, detected: float, kind: str) -> None:
        """``rank`` failed at ``fault_t`` (declared at ``detected``): its interval ends at the
        fault; every other rank's at the detection (training stops for the recovery)."""
        if rank in self.open:
            self.close(rank, fault_t, kind)
        else:  # closed already at this detection by another rank's failure: end it at its fault
            for j in range(len(self.intervals) - 1, -1, -1):
                iv = self.intervals[j]
                if iv.rank == rank and iv.phase == "train":
                    if iv.end_reason == "recovery" and iv.end >= fault_t - 1e-9 and iv.end <= detected:
                        self.intervals[j] = RankInterval(
                            rank=iv.rank,
                            spawn_id=iv.spawn_id,
                            node=iv.node,
                            generation=iv.generation,
                            start=iv.start,
                            end=max(fault_t, iv.start),
                            phase=iv.phase,
                            end_reason=kind,
                        )
                    break
        for other in sorted(self.open):
            self.close(other, detected, "recovery")

    def spawned(self, sid: int, rank: int, node: str | None, t: float) -> None:
        """A process ``sid`` spawned at ``t`` to play ``rank``: it starts unless the rank trains."""
        self.spawned_for[sid] = (rank, node, t)
        if rank not in self.open:
            self.started[rank] = OpenRank(rank, sid, node, self.generation, t, phase="start")

    def takes_over(self, rank: int, sid: int) -> None:
        """A hot spare ``sid`` plays ``rank``; a cold process starting for it lost the race."""
        self.members[rank] = sid
        st = self.started.get(rank)
        if st is not None and st.spawn_id != sid:
            del self.started[rank]

    def died_starting(self, rank: int, sid: int | None, fault_t: float, kind: str) -> None:
        """``sid`` failed while it was starting to play ``rank``: its start ends at the fault."""
        st = self.started.get(rank)
        if st is not None and st.spawn_id == sid:
            self.started.pop(rank)
            self.intervals.append(
                RankInterval(
                    rank, sid, st.node, st.generation, st.start, max(fault_t, st.start), "start", kind
                )
            )
