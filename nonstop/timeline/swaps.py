"""Boundary swaps, read from the log: live migrations and grows are one protocol (prepare while the
job trains, pause every rank at a boundary step, swap in a new generation), so one builder reads
both. :class:`SwapBuilder` keeps the open swaps and closes them; :class:`Migrations` and
:class:`Grows` feed it their kind's typed events and give :class:`MigrationSpan` and grow
:class:`ElasticResize` records.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from nonstop import events as ev
from nonstop.timeline.model import CatchupMark, ElasticResize, Generation, MigrationSpan

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["MIGRATION_EVENTS", "Grows", "Migrations", "SwapBuilder", "first_generation"]

S = TypeVar("S", bound="DataclassInstance")

MIGRATION_EVENTS = (ev.MigrationStart, ev.Catchup, ev.MigrationPause, ev.MigrationDone, ev.MigrationAborted)
GROW_EVENTS = (ev.GrowStart, ev.GrowPause, ev.Grow, ev.GrowDone, ev.GrowAborted)


def first_generation(generations: Sequence[Generation], lo: float, hi: float) -> Generation | None:
    """The first generation decided in ``[lo, hi]``."""
    return next((g for g in generations if lo - 1e-9 <= g.t <= hi + 1e-9), None)


@dataclass
class _Open(Generic[S]):
    span: S  # a MigrationSpan or an ElasticResize: start, end, paused, boundary, outcome, generation
    swapped: float | None = None  # when the swap was logged (a grow's 'grow' event)


class SwapBuilder(Generic[S]):
    """The swaps of one kind, each open under a key (a migration's rank; the one grow) from its
    start event to its end (done, aborted, or unfinished when another start, the log's end or the
    job's failure comes first).

    ``swap_logged``: the kind logs its swap as an event (a grow's ``grow``), and its generation is
    the first decided after it; otherwise (a migration) the swap is the generation decided between
    the pause and the end, unless the swap was aborted."""

    def __init__(self, *, swap_logged: bool) -> None:
        self.swap_logged = swap_logged
        self.open: dict[Hashable, _Open[S]] = {}
        self.done: list[_Open[S]] = []

    def get(self, key: Hashable) -> S | None:
        o = self.open.get(key)
        return o.span if o is not None else None

    def start(self, key: Hashable, t: float, span: S) -> None:
        """A swap starts at ``t`` (one still open under ``key``, whose end the log lacks, is over)."""
        self.close(key, t, "unfinished")
        self.open[key] = _Open(span)

    def step(self, key: Hashable, boundary: int | None, implied: Callable[[], S]) -> None:
        """A later event of the swap under ``key``: ``implied()`` is the swap when its start is not in
        the log (it began no later than this); ``boundary``, when the event gives one, is its boundary."""
        o = self.open.get(key)
        if o is None:
            o = self.open[key] = _Open(implied())
        if boundary is not None:
            o.span = replace(o.span, boundary=boundary)

    def update(self, key: Hashable, **changes: Any) -> None:
        o = self.open[key]
        o.span = replace(o.span, **changes)

    def pause(self, key: Hashable, t: float) -> None:
        """Every rank pauses at the boundary from ``t``."""
        self.update(key, paused=t)

    def swap(self, key: Hashable, at: float, **changes: Any) -> None:
        """The swap was logged at ``at``."""
        self.open[key].swapped = at
        self.update(key, **changes)

    def close(self, key: Hashable, t: float, outcome: str, **changes: Any) -> None:
        o = self.open.pop(key, None)
        if o is not None:
            span: Any = replace(o.span, **changes)
            self.done.append(_Open(replace(span, end=max(t, span.start), outcome=outcome), o.swapped))

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> list[tuple[S, float | None]]:
        """Every swap (those still open end at ``end``, or at the job's failure) with its generation,
        and when its swap was logged."""
        for key in list(self.open):
            self.close(key, end if failed_at is None else failed_at, "unfinished")
        out = []
        for o in self.done:
            s: Any = o.span
            g = None
            if self.swap_logged and o.swapped is not None:
                g = first_generation(generations, o.swapped, end)
            elif not self.swap_logged and s.paused is not None and s.outcome != "aborted":
                g = first_generation(generations, s.paused, s.end)  # an aborted one swapped nobody in
            out.append((replace(o.span, generation=g.number if g is not None else None), o.swapped))
        return out


class Migrations:
    """Live migrations (:data:`MIGRATION_EVENTS`), one open per rank, each with the ``catchup``
    events of its rank while it was open."""

    def __init__(self) -> None:
        self.swaps: SwapBuilder[MigrationSpan] = SwapBuilder(swap_logged=False)

    def event(self, e: ev.Event, t: float) -> bool:
        """Take one event; False for one that belongs to no migration (a stray ``catchup``)."""
        if isinstance(e, ev.MigrationStart):
            span = MigrationSpan(
                rank=e.rank,
                start=t,
                end=t,
                source=e.source,
                target=e.target,
                reason=e.reason,
                joiner=e.joiner,
                prepare_step=e.step,
            )
            self.swaps.start(e.rank, t, span)
            return True
        if isinstance(e, ev.Catchup):
            m = self.swaps.get(e.rank)
            if m is None:
                return False
            c = CatchupMark(
                t=t,
                rank=e.rank,
                step=e.step,
                ok=e.ok,
                delta=e.delta,
                raw_bytes=e.raw_bytes,
                wire_bytes=e.wire_bytes,
                seconds=e.seconds,
                capped=e.capped,
                error=e.error or "",
            )
            self.swaps.update(e.rank, catchups=(*m.catchups, c))
            return True
        if not isinstance(e, ev.MigrationPause | ev.MigrationDone | ev.MigrationAborted):
            return False
        took = sum(max(v, 0.0) for v in e.stages.values()) if isinstance(e, ev.MigrationDone) else 0.0
        rank = e.rank
        boundary = None if isinstance(e, ev.MigrationAborted) else e.boundary
        self.swaps.step(rank, boundary, lambda: MigrationSpan(rank=rank, start=t - took, end=t))
        if isinstance(e, ev.MigrationPause):
            self.swaps.pause(rank, t)
        elif isinstance(e, ev.MigrationDone):
            m = self.swaps.get(rank)
            assert m is not None
            self.swaps.close(
                rank,
                t,
                "done",
                source=e.source or m.source,
                target=e.target or m.target,
                reason=m.reason or e.reason,
                catchup_rounds=e.catchup_rounds,
                swap_delta=e.swap_delta,
                pause_ratio=e.pause_ratio,
            )
        else:
            self.swaps.close(rank, t, "aborted", phase=e.phase, error=e.error)
        return True

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> tuple[MigrationSpan, ...]:
        spans = [m for m, _ in self.swaps.finish(end, failed_at, generations)]
        return tuple(sorted(spans, key=lambda m: m.start))


class Grows:
    """Grows (:data:`GROW_EVENTS`): one open at a time, its mark (``t``) at its swap, or at its end
    when it never swapped."""

    KEY = "grow"

    def __init__(self) -> None:
        self.swaps: SwapBuilder[ElasticResize] = SwapBuilder(swap_logged=True)

    def event(self, e: ev.Event, t: float) -> None:
        key = self.KEY
        if isinstance(e, ev.GrowStart):
            span = ElasticResize(
                kind="grow",
                t=t,
                start=t,
                end=t,
                old_world_size=e.world_size,
                world_size=e.new_world_size,
                outcome="unfinished",
                prepare_step=e.prepare_step,
                joiners=e.joiners_by_spawn_id,
            )
            self.swaps.start(key, t, span)
            return
        if not isinstance(e, ev.GrowPause | ev.Grow | ev.GrowDone | ev.GrowAborted):
            return
        prepare_s = e.prepare_s if isinstance(e, ev.GrowPause) else None
        began = t - max(prepare_s, 0.0) if prepare_s is not None else t
        self.swaps.step(
            key, e.boundary, lambda: ElasticResize(kind="grow", t=t, start=began, end=t, outcome="unfinished")
        )
        if isinstance(e, ev.GrowPause):
            self.swaps.pause(key, t)
        elif isinstance(e, ev.Grow):
            z = self.swaps.get(key)
            assert z is not None
            self.swaps.swap(
                key,
                t,
                t=t,
                old_world_size=e.old_world_size if e.old_world_size is not None else z.old_world_size,
                world_size=e.world_size if e.world_size is not None else z.world_size,
            )
        elif isinstance(e, ev.GrowDone):
            self.swaps.close(key, t, "done", took_s=e.seconds)
        else:
            self.swaps.close(key, t, "aborted", error=e.error)

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> list[ElasticResize]:
        return [
            z if swapped is not None else replace(z, t=z.end)
            for z, swapped in self.swaps.finish(end, failed_at, generations)
        ]
