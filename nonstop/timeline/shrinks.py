"""Waits for a spare and shrinks, read from the log: failed ranks no process could play make the
job wait (``elastic_wait``), until a spare plays them (a ``generation``) or the job goes on without
them (``shrink``). Grows are boundary swaps (:mod:`nonstop.timeline.swaps`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from nonstop import events as ev
from nonstop.timeline.model import ElasticResize, ElasticWait, Generation
from nonstop.timeline.swaps import first_generation

__all__ = ["Shrinks"]


@dataclass
class Shrinks:
    """The waits and shrinks of a log, in time order; :meth:`finish` ties them to the generations."""

    waits: list[ElasticWait] = field(default_factory=list)
    shrinks: list[ElasticResize] = field(default_factory=list)
    wait: ElasticWait | None = None  # open: no decision yet

    def event(self, e: ev.ElasticWait | ev.Shrink, t: float) -> None:
        if isinstance(e, ev.ElasticWait):
            ranks = tuple(sorted(set(e.ranks)))
            if self.wait is None:
                self.wait = ElasticWait(ranks, t, t, e.wait_s)
            else:  # a re-plan that waits on: the same wait, from its first event
                self.wait = replace(self.wait, ranks=tuple(sorted({*self.wait.ranks, *ranks})))
            return
        start = self.wait.start if self.wait is not None else t
        self.decided(t, "shrink")
        shrunk = ElasticResize(
            kind="shrink",
            t=t,
            start=start,
            end=t,
            old_world_size=e.old_world_size,
            world_size=e.world_size,
            outcome="unfinished",
            reason=e.reason,
            dropped=tuple(sorted(set(e.dropped))),
            renumbered=e.renumbered_ranks,
        )
        self.shrinks.append(shrunk)

    def decided(self, t: float, outcome: str) -> None:
        """The open wait ends at ``t`` (a shrink, a generation, the job's failure, the log's end)."""
        if self.wait is not None:
            self.waits.append(replace(self.wait, end=max(t, self.wait.start), outcome=outcome))
            self.wait = None

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> tuple[list[ElasticResize], tuple[ElasticWait, ...]]:
        """Close the open wait at ``end`` (or at the job's failure); find each shrink's generation
        (the first decided at or after it) and when that smaller world trained again."""
        stop = end if failed_at is None else failed_at
        self.decided(stop, "unfinished" if failed_at is None else "failed")
        out: list[ElasticResize] = []
        for z in self.shrinks:
            g = first_generation(generations, z.t, end)
            trains = [
                x.training_start for x in generations if x.t >= z.t - 1e-9 and x.training_start is not None
            ]
            z = (
                replace(z, end=max(min(trains), z.t), outcome="done")
                if trains
                else replace(z, end=max(stop, z.t))
            )
            out.append(replace(z, generation=g.number if g is not None else None))
        return out, tuple(sorted(self.waits, key=lambda w: w.start))
