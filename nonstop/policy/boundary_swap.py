"""Boundary swaps: a live migration and an elastic grow are one protocol, one state machine.

Both bring hot spares (*joiners*) into the job without rolling anything back::

    prepare ──────────────> pause ──────────────> swap ──────> done
      │ joiners' nodes fetch   │ every rank stops      │ a new generation:
      │ the source rank's      │ after the boundary    │ joiners are members,
      │ committed step; the    │ step S; the joiners'  │ a leaver retires;
      │ joiners restore it and │ nodes fetch S as soon │ paused ranks keep
      │ warm up; a migration's │ as the source rank    │ their live state
      │ target catches up      │ completed it          │
      └────────────> aborted <─┴──────────────────────-┘ (a joiner dies, a failure, a timeout)

* **migration**: one joiner takes rank ``r`` on the target node; the source is ``r`` itself on
  the leaver's node, and the leaver retires at the swap. Before pausing, the target catches up
  (tracked fetches, the first as a compressed delta: :func:`~nonstop.policy.migration.catch_up_to`)
  and the swap fetches the boundary as a delta when deltas measured faster
  (:func:`~nonstop.policy.migration.swap_as_delta`).
* **grow**: joiners take ranks ``W..W'-1``; the source is rank 0 (data-parallel replicas), or
  for a sharded job each joiner's own (:attr:`Joiner.source`): the rank with the same shard and
  TP coordinates in a replica group that stayed, whose shards are the joiner's.

:class:`BoundarySwap` is pure: each ``on_*`` method takes one event (time comes with it, from
the caller) and returns the :class:`Action` s to carry out; it never does I/O. The coordinator's
:class:`~nonstop.coordinator.swaps.Swaps` executes them, and the simulator can replay the same
machine with calibrated durations.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from nonstop.events import Event, from_fields
from nonstop.policy.migration import CatchUp, Transfer, boundary_step, catch_up_to, swap_as_delta

__all__ = [
    "Action",
    "BoundarySwap",
    "Continue",
    "Emit",
    "Fetch",
    "Finished",
    "Joiner",
    "Pause",
    "Prepare",
    "Release",
    "Retire",
    "SwapKind",
    "SwapNow",
    "SwapPhase",
]


class SwapKind(enum.StrEnum):
    MIGRATION = "migration"
    GROW = "grow"


class SwapPhase(enum.StrEnum):
    PREPARE = "prepare"  # joiners' nodes fetch the prepare step; joiners restore it and warm up
    PAUSE = "pause"  # every rank runs to the boundary step and stops
    SWAP = "swap"  # the new generation with the joiners in their ranks
    DONE = "done"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (SwapPhase.DONE, SwapPhase.ABORTED)


@dataclass
class Joiner:
    """A spare brought in: the rank it will play, where, and how far it got."""

    sid: int
    rank: int
    node: str
    told: bool = False  # took the rank in its script (its prepare reconfigure was sent)
    prepared: bool = False  # restored the prepare step and warmed up
    boundary_req: int | None = None  # the boundary's fetch, asked for once the source completed it
    source: tuple[int, str] | None = None  # (rank, node) whose snapshot it restores; None: the swap's


# -- actions (what the executor carries out) -------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Fetch:
    """Joiner ``sid``'s node fetches ``rank``'s snapshot of ``step`` from ``source`` into its
    slots of ``as_rank``. ``purpose``: ``prepare`` | ``catchup`` | ``boundary`` (asked before
    the swap's generation exists; that generation adopts it)."""

    purpose: str
    sid: int
    target: str
    rank: int
    step: int
    source: str
    as_rank: int
    base: int | None = None
    track: bool = False


@dataclass(frozen=True, kw_only=True)
class Prepare:
    """Tell joiner ``sid`` its rank in a world of ``world_size``: it restores ``step`` (which its
    node holds) and warms up while the job trains."""

    sid: int
    rank: int
    world_size: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Pause:
    """Every member stops after step ``at``."""

    at: int


@dataclass(frozen=True, kw_only=True)
class Continue:
    """Members paused at a boundary go on in the same generation."""


@dataclass(frozen=True, kw_only=True)
class Retire:
    """Joiner or leaver ``sid`` leaves the job (it is killed; its exit is no failure);
    ``respawn``: a fresh spare replaces it on its node."""

    sid: int
    respawn: bool


@dataclass(frozen=True, kw_only=True)
class Release:
    """Joiner ``sid`` was never told its rank: it is an idle spare again."""

    sid: int


@dataclass(frozen=True, kw_only=True)
class SwapNow:
    """Open the swap's generation at ``step``: joiners become members (``ranks``: rank ->
    spawn id, node), the world becomes ``world_size``, a leaver retires; each joiner restores
    ``source_rank``'s boundary snapshot fetched from ``source`` (as a delta against ``base``),
    or the one ``sources`` names for its rank (a sharded grow)."""

    step: int
    world_size: int
    ranks: Mapping[int, tuple[int, str]]
    source_rank: int
    source: str
    leaver: int | None
    base: int | None
    fresh: bool  # the new ranks write their slots afresh (a grow)
    sources: Mapping[int, tuple[int, str]] = field(default_factory=dict)  # rank -> (rank, node)


@dataclass(frozen=True, kw_only=True)
class Emit:
    """An event for the job's log: its kind and fields, as the typed event (:meth:`event`) names
    them (the simulator reads ``kind``)."""

    kind: str
    fields: Mapping[str, Any]

    def event(self) -> Event:
        """The typed event (``TypeError`` for a kind or field the log does not have)."""
        return from_fields(self.kind, self.fields)


@dataclass(frozen=True, kw_only=True)
class Finished:
    """The swap ended (``ok``: done; else aborted with ``error``); ``info`` for who asked."""

    ok: bool
    error: str | None
    info: Mapping[str, Any]


Action = Fetch | Prepare | Pause | Continue | Retire | Release | SwapNow | Emit | Finished


@dataclass
class BoundarySwap:
    """One migration or grow (see the module docstring). Times are wall-clock seconds passed in."""

    kind: SwapKind
    joiners: list[Joiner]
    world_size: int  # before the swap
    new_world_size: int
    source_rank: int  # whose snapshot the joiners restore
    source_node: str
    prepare_step: int
    started: float
    reason: str = "grow"  # a migration: "migrate" | "drain" | "preempt"
    leaver_sid: int | None = None
    phase: SwapPhase = SwapPhase.PREPARE
    boundary: int | None = None
    generation: int | None = None  # the swap's, once opened
    paused: dict[int, int] = field(default_factory=dict)  # rank -> step it stopped after
    gaps: dict[int, float] = field(default_factory=dict)  # rank -> seconds between steps S and S+1
    marks: dict[str, float] = field(default_factory=dict)
    catch: CatchUp | None = None  # a migration's catch-up
    swap_mode: str = "auto"  # --swap-transfer
    # the joiners restore their sources' boundary step (False: a grow that reshards every rank
    # from all the old ranks' boundary instead, so no joiner fetches one source's)
    fetch_boundary: bool = True
    error: str | None = None

    def __post_init__(self) -> None:
        self.marks.setdefault("start", self.started)

    # -- views ------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """A migration's rank."""
        return self.joiners[0].rank

    @property
    def target(self) -> str:
        """A migration's target node."""
        return self.joiners[0].node

    def joiner(self, sid: int) -> Joiner | None:
        return next((j for j in self.joiners if j.sid == sid), None)

    def source_of(self, j: Joiner) -> tuple[int, str]:
        """(rank, node) whose snapshots joiner ``j`` restores."""
        return j.source if j.source is not None else (self.source_rank, self.source_node)

    def stage_seconds(self) -> dict[str, float]:
        """Seconds between consecutive marks, named by the later mark."""
        order = sorted(self.marks.items(), key=lambda kv: kv[1])
        return {b[0]: round(b[1] - a[1], 4) for a, b in itertools.pairwise(order)}

    # -- events -----------------------------------------------------------------------------------
    def start(self) -> list[Action]:
        """Begin: every joiner's node fetches the prepare step."""
        track = self.kind is SwapKind.MIGRATION  # the base of the catch-up's deltas
        out: list[Action] = [self._emit_start()]
        out += [
            Fetch(
                purpose="prepare",
                sid=j.sid,
                target=j.node,
                rank=self.source_of(j)[0],
                step=self.prepare_step,
                source=self.source_of(j)[1],
                as_rank=j.rank,
                track=track,
            )
            for j in self.joiners
        ]
        return out

    def on_prepare_fetched(self, sid: int, ok: bool, error: str | None, now: float) -> list[Action]:
        """Joiner ``sid``'s node holds the prepare step (or could not get it)."""
        j = self.joiner(sid)
        if j is None or self.phase is not SwapPhase.PREPARE:
            return []
        if not ok:
            return self.abort(f"fetching step {self.prepare_step} to node {j.node}: {error}")
        if self.kind is SwapKind.MIGRATION:
            self.marks["fetched"] = now
            assert self.catch is not None
            self.catch.held = self.prepare_step
        j.told = True
        return [Prepare(sid=sid, rank=j.rank, world_size=self.new_world_size, step=self.prepare_step)]

    def on_restored(self, sid: int, *, latest: Mapping[int, int], committed: int, now: float) -> list[Action]:
        """Joiner ``sid`` restored the prepare step and warmed up."""
        j = self.joiner(sid)
        if j is None or self.phase is not SwapPhase.PREPARE or j.prepared:
            return []
        j.prepared = True
        if self.kind is SwapKind.MIGRATION:
            self.marks["prepared"] = now
            assert self.catch is not None
            self.catch.ready = True
        return self._maybe_pause(latest=latest, committed=committed, now=now)

    def on_catchup_fetched(
        self,
        ok: bool,
        transfer: Transfer,
        *,
        delta: bool = False,
        capped: bool = False,
        error: str | None = None,
        latest: Mapping[int, int],
        committed: int,
        now: float,
    ) -> list[Action]:
        """A migration's catch-up fetch answered: ``ok`` with what it moved (``transfer``),
        whether as a ``delta`` against the step the target held and under the bandwidth cap
        (``capped``), or failed with ``error``."""
        c = self.catch
        if c is None or self.phase is not SwapPhase.PREPARE:
            return []
        c.catchup_req = None
        c.rounds += 1
        if ok:
            c.held = c.catchup_step
            self.marks["caught_up"] = now
            if capped:
                pass  # it measures the bandwidth cap, not what an uncapped swap would take
            elif delta:
                c.catchups.append(transfer)
            elif transfer.wire_bytes:
                c.full = transfer
        else:
            c.held = None  # the target lost its base: the swap fetches the whole step
        emit = Emit(
            kind="catchup",
            fields={
                "rank": self.rank,
                "step": c.catchup_step,
                "ok": ok,
                "delta": delta,
                "raw_bytes": transfer.raw_bytes if ok else None,
                "wire_bytes": transfer.wire_bytes if ok else None,
                "seconds": transfer.seconds if ok else None,
                "capped": capped,
                "error": error,
            },
        )
        return [emit, *self._maybe_pause(latest=latest, committed=committed, now=now)]

    def on_paused(self, rank: int, step: int, now: float) -> list[Action]:
        """Member ``rank`` stopped after ``step``."""
        if self.phase is not SwapPhase.PAUSE or self.boundary is None:
            return []
        self.paused[rank] = step
        out: list[Action] = []
        ready = [j for j in self.joiners if self.source_of(j)[0] == rank and j.boundary_req is None]
        if step == self.boundary and ready and self.fetch_boundary:
            # the source's step S is complete: the joiners' nodes fetch it while the others finish
            base = self._swap_base()
            out += [
                Fetch(
                    purpose="boundary",
                    sid=j.sid,
                    target=j.node,
                    rank=rank,
                    step=step,
                    source=self.source_of(j)[1],
                    as_rank=j.rank,
                    base=base,
                )
                for j in ready
            ]
        if len(self.paused) < self.world_size:
            return out
        if set(self.paused.values()) != {self.boundary}:
            return [
                *out,
                *self.abort(
                    f"ranks stopped at steps {sorted(set(self.paused.values()))}, not {self.boundary}"
                ),
            ]
        self.marks["paused"] = now
        self.phase = SwapPhase.SWAP
        swap = SwapNow(
            step=self.boundary,
            world_size=self.new_world_size,
            ranks={j.rank: (j.sid, j.node) for j in self.joiners},
            source_rank=self.source_rank,
            source=self.source_node,
            leaver=self.leaver_sid,
            base=self._swap_base(),
            fresh=self.kind is SwapKind.GROW,
            sources={j.rank: self.source_of(j) for j in self.joiners if j.source is not None},
        )
        return [*out, swap]

    def on_step(self, rank: int, step: int, previous: tuple[int, float] | None, now: float) -> None:
        """A step report: the gap each rank saw across the boundary (``previous``: its last
        report, step and monotonic time; ``now`` monotonic too)."""
        b = self.boundary
        if b is not None and previous is not None and step == b + 1 and previous[0] == b:
            self.gaps[rank] = now - previous[1]

    def on_generation_done(self, *, median_step_s: float | None, now: float) -> list[Action]:
        """The swap's generation completed its first step everywhere."""
        if self.phase is not SwapPhase.SWAP:
            return []
        self.marks["resumed"] = now
        gap = max(self.gaps.values(), default=None)
        return self._done(gap=gap, median_step_s=median_step_s, seconds=now - self.started)

    def _done(
        self,
        *,
        gap: float | None,
        median_step_s: float | None,
        seconds: float | None,
        interrupted: str | None = None,
    ) -> list[Action]:
        self.phase = SwapPhase.DONE
        ratio = (gap / median_step_s) if gap is not None and median_step_s else None
        extra = {} if interrupted is None else {"interrupted": interrupted}
        if self.kind is SwapKind.GROW:
            info: dict[str, Any] = {
                "world_size": self.new_world_size,
                "boundary": self.boundary,
                "seconds": seconds,
                "max_step_gap_s": gap,
                "pause_ratio": ratio,
                **extra,
            }
            return [Emit(kind="grow_done", fields=info), Finished(ok=True, error=None, info=info)]
        assert self.catch is not None
        info = {
            "rank": self.rank,
            "source": self.source_node,
            "target": self.target,
            "boundary": self.boundary,
            "stages": self.stage_seconds(),
            "max_step_gap_s": gap,
            "median_step_s": median_step_s,
            "pause_ratio": ratio,
            "reason": self.reason,
            "catchup_rounds": self.catch.rounds,
            "swap_delta": self.catch.swap_delta,
            **extra,
        }
        return [Emit(kind="migration_done", fields=info), Finished(ok=True, error=None, info=info)]

    def tick(self, now: float, timeout_s: float) -> list[Action]:
        """Give up when not swapped within ``timeout_s`` of the start."""
        if self.phase in (SwapPhase.PREPARE, SwapPhase.PAUSE) and now - self.started > timeout_s:
            if self.kind is SwapKind.GROW:
                return self.abort(f"not every rank reached step {self.boundary} within {timeout_s:g}s")
            return self.abort(f"not ready to swap within {timeout_s:g}s")
        return []

    def abort(self, why: str, *, failed: Collection[int] = ()) -> list[Action]:
        """End without swapping: joiners that took their rank are replaced by fresh spares, the
        others are idle again; paused members go on. After the swap (its generation open, the
        joiners members, a leaver retired) there is nothing to undo, and recovery takes over:
        unless a joiner is one of the ``failed`` processes (spawn ids), the swap took effect and
        is reported done, ``interrupted`` by ``why``, its pause not measured."""
        if self.phase.is_terminal:
            return []
        if self.phase is SwapPhase.SWAP and not any(j.sid in failed for j in self.joiners):
            return self._done(gap=None, median_step_s=None, seconds=None, interrupted=why)
        before, self.phase, self.error = self.phase, SwapPhase.ABORTED, why
        out: list[Action] = []
        if before is not SwapPhase.SWAP:
            for j in self.joiners:
                out.append(Retire(sid=j.sid, respawn=True) if j.told else Release(sid=j.sid))
            if self.boundary is not None:
                out.append(Continue())
        if self.kind is SwapKind.GROW:
            out.append(Emit(kind="grow_aborted", fields={"boundary": self.boundary, "error": why}))
        else:
            out.append(
                Emit(kind="migration_aborted", fields={"rank": self.rank, "phase": str(before), "error": why})
            )
        out.append(Finished(ok=False, error=why, info={}))
        return out

    # -- internals --------------------------------------------------------------------------------
    def _emit_start(self) -> Emit:
        if self.kind is SwapKind.GROW:
            return Emit(
                kind="grow_start",
                fields={
                    "world_size": self.world_size,
                    "new_world_size": self.new_world_size,
                    "prepare_step": self.prepare_step,
                    "joiners": {str(j.sid): j.node for j in self.joiners},
                },
            )
        return Emit(
            kind="migration_start",
            fields={
                "rank": self.rank,
                "source": self.source_node,
                "target": self.target,
                "joiner": self.joiners[0].sid,
                "step": self.prepare_step,
                "reason": self.reason,
            },
        )

    def _maybe_pause(self, *, latest: Mapping[int, int], committed: int, now: float) -> list[Action]:
        """Once every joiner is prepared (and a migration's target caught up): pick the boundary."""
        if self.phase is not SwapPhase.PREPARE or not all(j.prepared for j in self.joiners):
            return []
        c = self.catch
        if c is not None:
            if c.catchup_req is not None:
                return []  # a catch-up in flight
            due = catch_up_to(c, committed)
            if due is not None:
                c.catchup_step, as_delta = due
                c.catchup_req = -1  # in flight (the executor's request id is not ours to keep)
                j = self.joiners[0]
                return [
                    Fetch(
                        purpose="catchup",
                        sid=j.sid,
                        target=j.node,
                        rank=self.rank,
                        step=c.catchup_step,
                        source=self.source_node,
                        as_rank=j.rank,
                        base=c.held if as_delta else None,
                        track=True,
                    )
                ]
        self.phase = SwapPhase.PAUSE
        self.boundary = boundary_step(latest)
        if self.kind is SwapKind.GROW:
            emit = Emit(
                kind="grow_pause", fields={"boundary": self.boundary, "prepare_s": now - self.started}
            )
        else:
            emit = Emit(kind="migration_pause", fields={"rank": self.rank, "boundary": self.boundary})
        return [emit, Pause(at=self.boundary)]

    def _swap_base(self) -> int | None:
        """The step a migration's boundary fetch is a delta against (``swap_as_delta``), or None."""
        c = self.catch
        if c is None:
            return None
        c.swap_delta = c.held is not None and swap_as_delta(c.full, c.catchups, self.swap_mode)
        return c.held if c.swap_delta else None
