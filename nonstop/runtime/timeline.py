"""``nonstop timeline``: a job's event log (``<job_dir>/events.jsonl``) as a picture and as text.

Three steps, each usable on its own:

* :func:`load_events` reads and checks an event log (a file, or a job dir that holds one);
  a missing, unreadable or non-event file is a :class:`~nonstop.errors.UsageError`.
* :func:`build_timeline` turns the events into a :class:`Timeline`: a pure data model
  (no matplotlib) of what each rank did when, failures, recoveries with their stages,
  node and coordinator events, the storage tiers, generations, live migrations with their
  catch-up rounds, elastic resizes (shrink, grow) and waits for a spare, and every event it
  does not know (kept, so new kinds show up without code changes).
* :func:`render_timeline` draws a :class:`Timeline` (PNG, SVG or PDF by the file's
  extension); :func:`timeline_text` writes a compact summary for a terminal.

All times in the model are **seconds since the job started** (the first ``job_start``
event, or the first event when there is none). Logs of jobs that are still running or
were killed mid-way (no ``job_end``, a recovery that never finished, a torn last line)
are valid input: what is open at the end of the log ends at the last event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError
from nonstop.runtime.eventlog import read_events

__all__ = [
    "FORMATS",
    "STAGE_ORDER",
    "CatchupMark",
    "ElasticResize",
    "ElasticWait",
    "FailureMark",
    "Generation",
    "Mark",
    "MigrationSpan",
    "NodeSpan",
    "OtherEvent",
    "RankInterval",
    "Recovery",
    "StageSpan",
    "Timeline",
    "build_timeline",
    "load_events",
    "load_timeline",
    "render_timeline",
    "timeline_text",
]

EVENTS_FILE = "events.jsonl"
FORMATS = (".png", ".svg", ".pdf")
# The stages of a recovery in the order they happen (runtime/recovery.py); a recovery record's
# stages that are not listed here (a future stage) follow in the record's own order.
STAGE_ORDER = ("detect", "replan", "plan", "launch", "restore", "rebuild", "resume")
# Elastic resizes (runtime/elastic.py, the coordinator's _shrink and grow) and live migrations
# (runtime/migration.py): an ElasticWait / ElasticResize, and a MigrationSpan with its CatchupMarks.
ELASTIC_EVENTS = ("elastic_wait", "shrink", "grow_start", "grow_pause", "grow", "grow_done", "grow_aborted")
MIGRATION_EVENTS = ("migration_start", "catchup", "migration_pause", "migration_done", "migration_aborted")
# Events whose meaning the model knows; every other event becomes an OtherEvent.
KNOWN_EVENTS = frozenset(
    {
        "job_start",
        "job_end",
        "job_done",
        "job_failed",
        "finish",
        "nodes_joined",
        "node_join",
        "node_lost",
        "node_disconnected",
        "node_reconnected",
        "coordinator_leads",
        "coordinator_resumed",
        "spawn",
        "spawned",
        "connect",
        "exit",
        "spare_takes_over",
        "generation",
        "stage",
        "failure",
        "recovery",
        "fault_injected",
        "hang_detected",
        "replicated",
        "replication_failed",
        "persist",
        "persist_failed",
        "restore_from_durable",
        "durable_install_failed",
        "durable_unavailable",
        *ELASTIC_EVENTS,
        *MIGRATION_EVENTS,
    }
)
TIER_EVENTS = {
    "replicated": "replicated",
    "replication_failed": "replication_failed",
    "persist": "persist",
    "persist_failed": "persist_failed",
    "restore_from_durable": "restore_durable",
    "durable_install_failed": "durable_failed",
    "durable_unavailable": "durable_failed",
}


# -- the model ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankInterval:
    """A period in which one process plays one rank.

    ``phase`` is ``"train"`` (the rank trains in ``generation``: from the moment the
    generation trains again, the end of its ``rebuild`` stage, until a failure or the end)
    or ``"start"`` (a process spawned for this rank is starting: spawn until it first
    trains). ``end_reason``: the failure kind when this rank's process failed,
    ``"recovery"`` when another rank's failure stopped training, ``"finish"``, ``"failed"``
    (the job failed), ``"end"`` (``job_end``), ``"log_end"`` (the log stops here),
    ``"trains"`` (a ``start`` interval that ended in training).
    """

    rank: int
    spawn_id: int | None
    node: str | None
    generation: int
    start: float
    end: float
    phase: str = "train"
    end_reason: str = "log_end"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FailureMark:
    """A failed rank. ``t`` is when the fault happened (injected or, when unknown, detected),
    ``detected`` when the coordinator declared it; ``step`` is the rank's last step."""

    t: float
    detected: float
    kind: str
    rank: int | None
    step: int | None
    spawn_id: int | None = None
    node: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class StageSpan:
    """One stage of a recovery (or of the job's start), from ``start`` to ``end`` seconds."""

    stage: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Recovery:
    """The recovery of one failure: one ``recovery`` event (``complete``), or one reconstructed
    from the failure and the ``stage`` events after it when the log ends before the recovery
    does (``complete`` False, ``end`` the log's end or the job's failure, ``mttr_s`` None).

    ``stages`` are laid end to end from ``start`` (the fault) in :data:`STAGE_ORDER`; for a
    complete recovery their seconds add up to ``mttr_s``. Several failures that one
    reconfiguration repaired share a ``generation`` (and, but for ``detect``, their stages).
    """

    generation: int | None
    kind: str
    rank: int | None
    step: int | None
    start: float
    end: float
    stages: tuple[StageSpan, ...]
    complete: bool = True
    mttr_s: float | None = None
    training_again_s: float | None = None
    lost_steps: int | None = None
    restore_step: int | None = None
    replacement: str | None = None
    tier: str | None = None
    detail: str = ""

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Seconds per stage (a stage listed twice is summed)."""
        out: dict[str, float] = {}
        for s in self.stages:
            out[s.stage] = out.get(s.stage, 0.0) + s.seconds
        return out


@dataclass(frozen=True)
class Generation:
    """A membership (``generation`` event): when it was decided (``t``), why (``cause``: the
    failed ranks), where it restored from, who plays each rank, its ``stage`` events, and when it
    started training (end of ``rebuild``; None if it never did)."""

    number: int
    t: float
    cause: tuple[int, ...] = ()
    tier: str | None = None
    restore_step: int | None = None
    members: Mapping[int, int] = field(default_factory=dict)
    nodes: Mapping[int, str] = field(default_factory=dict)
    stages: tuple[StageSpan, ...] = ()
    training_start: float | None = None


@dataclass(frozen=True)
class NodeSpan:
    """A node's agent ``up`` (joined, connected) or ``disconnected`` (its channel dropped and
    it has not reconnected or been declared lost yet) from ``start`` to ``end``."""

    node: str
    start: float
    end: float
    state: str = "up"
    end_reason: str = "log_end"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Mark:
    """A point event on the node, coordinator or tier rows.

    ``kind``: nodes ``join``, ``rejoin``, ``lost``, ``disconnected``, ``reconnected``;
    coordinator ``leads``, ``resumed``; tiers ``replicated``, ``replication_failed``,
    ``persist``, ``persist_failed``, ``restore_durable``, ``durable_failed``.
    """

    t: float
    kind: str
    node: str | None = None
    step: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class CatchupMark:
    """One catch-up fetch of a migration (a ``catchup`` event): at ``t`` the target node holds
    ``step`` of ``rank``, fetched as a ``delta`` against the step it held or whole, in ``seconds``;
    ``ok`` False: the fetch failed (``error``; the swap then fetches the whole step). ``capped``:
    the transfer ran under a bandwidth cap (no measure of an uncapped swap)."""

    t: float
    rank: int | None
    step: int | None
    ok: bool = True
    delta: bool = False
    raw_bytes: int | None = None
    wire_bytes: int | None = None
    seconds: float | None = None
    capped: bool = False
    error: str = ""

    @property
    def kind(self) -> str:
        """``"delta"``, ``"whole"`` or ``"failed"``."""
        return "failed" if not self.ok else "delta" if self.delta else "whole"


@dataclass(frozen=True)
class MigrationSpan:
    """A live migration of ``rank`` from node ``source`` to ``target`` (runtime/migration.py), from
    ``migration_start`` (``start``) to ``migration_done`` or ``migration_aborted`` (``end``).

    ``outcome``: ``"done"``, ``"aborted"`` (``phase``: the phase it was aborted in, ``error``) or
    ``"unfinished"`` (neither came: ``end`` is the log's end, or the job's failure). Its
    :attr:`stages`: ``prepare`` from ``start`` to ``paused`` (``migration_pause``; the target
    fetches the step, the joiner restores it, the catch-up rounds run while the job trains),
    then ``swap`` from ``paused`` to ``end`` (every rank runs to ``boundary``; the new
    ``generation`` plays the joiner in the rank). ``catchups``: this rank's ``catchup`` events
    while it was open, in time order. ``catchup_rounds`` and ``swap_delta`` (the swap fetched the
    boundary as a delta) are ``migration_done``'s; None when it did not say.
    """

    rank: int | None
    start: float
    end: float
    source: str | None = None
    target: str | None = None
    reason: str = ""
    joiner: int | None = None
    prepare_step: int | None = None
    boundary: int | None = None
    paused: float | None = None
    generation: int | None = None
    outcome: str = "unfinished"
    phase: str | None = None
    catchups: tuple[CatchupMark, ...] = ()
    catchup_rounds: int | None = None
    swap_delta: bool | None = None
    pause_ratio: float | None = None
    error: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def rounds(self) -> int:
        """Catch-up rounds: ``migration_done``'s count, else the ``catchup`` events seen."""
        return self.catchup_rounds if self.catchup_rounds is not None else len(self.catchups)

    @property
    def stages(self) -> tuple[StageSpan, ...]:
        """``prepare`` (to ``paused``, or to ``end`` when it never paused), then ``swap``."""
        return _prepare_then_swap(self.start, self.paused, self.end)


@dataclass(frozen=True)
class ElasticWait:
    """Failed ``ranks`` (numbered as before any shrink) that no process could play: the job
    stopped and waited up to ``wait_s`` seconds for a spare (``elastic_wait``; several of them
    before one decision are one wait), from ``start`` to ``end``. ``outcome``: ``"shrink"`` (a
    ``shrink`` dropped them), ``"replaced"`` (a ``generation`` gave them processes), ``"failed"``
    (the job failed: ``end`` is its failure) or ``"unfinished"`` (``end``: the log's end)."""

    ranks: tuple[int, ...]
    start: float
    end: float
    wait_s: float | None = None
    outcome: str = "unfinished"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class ElasticResize:
    """A change of the world size from ``old_world_size`` to ``world_size`` (runtime/elastic.py).

    ``kind`` ``"shrink"``: failed ranks had no spare; ``t`` is the ``shrink`` event, ``start`` the
    start of the :class:`ElasticWait` it ended (``t`` when there was none), ``end`` when the smaller
    ``generation`` trained again (end of its rebuild; ``outcome`` ``"unfinished"`` and the log's end,
    or the job's failure, when it never did). ``dropped``: old rank numbers; ``renumbered``: old ->
    new number of every rank that plays on under another number; ``reason``: why it shrank.

    ``kind`` ``"grow"``: idle spares joined as ranks ``old_world_size..world_size-1``. ``start`` is
    ``grow_start`` (the joiners fetch ``prepare_step`` and restore it while the job trains),
    ``paused`` ``grow_pause`` (every rank runs to ``boundary``), ``t`` the ``grow`` event (the new
    ``generation``), ``end`` ``grow_done`` (``outcome`` ``"done"``), ``grow_aborted`` (``"aborted"``,
    ``error``; ``t`` is then the abort) or the log's end (``"unfinished"``). ``joiners``: spawn id ->
    node. :attr:`seconds` is ``grow_done``'s own measure when it gave one.
    """

    kind: str
    t: float
    start: float
    end: float
    old_world_size: int | None = None
    world_size: int | None = None
    generation: int | None = None
    outcome: str = "done"
    reason: str = ""
    dropped: tuple[int, ...] = ()
    renumbered: Mapping[int, int] = field(default_factory=dict)
    paused: float | None = None
    prepare_step: int | None = None
    boundary: int | None = None
    joiners: Mapping[int, str] = field(default_factory=dict)
    error: str = ""
    took_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.took_s if self.took_s is not None else self.end - self.start

    @property
    def resized(self) -> bool:
        """Whether the world size changed: a shrink, or a grow that swapped its joiners in."""
        return self.kind == "shrink" or self.outcome == "done" or self.generation is not None

    @property
    def sizes(self) -> str:
        """``"3→2"`` (``?`` for a size the log does not give)."""

        def n(x: int | None) -> str:
            return "?" if x is None else str(x)

        return f"{n(self.old_world_size)}→{n(self.world_size)}"

    @property
    def label(self) -> str:
        """``"shrink 3→2"``, ``"grow 2→3"``, ``"grow 2→3 aborted"``."""
        return f"{self.kind} {self.sizes}" + (f" {self.outcome}" if self.outcome == "aborted" else "")

    @property
    def new_ranks(self) -> tuple[int, ...]:
        """A grow's joining ranks (none for a shrink, or when the sizes are unknown)."""
        if self.kind != "grow" or self.old_world_size is None or self.world_size is None:
            return ()
        return tuple(range(self.old_world_size, self.world_size))

    @property
    def stages(self) -> tuple[StageSpan, ...]:
        """A grow's ``prepare`` (to ``paused``, or to ``end`` when it never paused) and ``swap``;
        a shrink's ``wait`` (``start`` to ``t``, when it waited) and ``swap`` (``t`` to ``end``)."""
        if self.kind == "shrink":
            out = [StageSpan("wait", self.start, self.t)] if self.t > self.start else []
            return (*out, StageSpan("swap", self.t, max(self.end, self.t)))
        return _prepare_then_swap(self.start, self.paused, self.end)


def _prepare_then_swap(start: float, paused: float | None, end: float) -> tuple[StageSpan, ...]:
    """A migration's or a grow's stages: ``prepare`` from ``start`` to ``paused`` (to ``end`` when
    it never paused), then ``swap`` to ``end``."""
    if paused is None:
        return (StageSpan("prepare", start, max(end, start)),)
    paused = max(paused, start)
    return (StageSpan("prepare", start, paused), StageSpan("swap", paused, max(end, paused)))


@dataclass(frozen=True)
class OtherEvent:
    """An event the model has no row for (drawn as a tick on the "other events" row)."""

    t: float
    event: str
    rank: int | None = None
    stage: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Timeline:
    """Everything :func:`render_timeline` and :func:`timeline_text` show, times in seconds since
    ``t0`` (unix time of the job's start). ``outcome`` is ``job_end``'s state (None: the log has
    no ``job_end``: the job is running or was killed); ``begin`` is the first event's time (0, or
    less for events logged before ``job_start``), ``end`` the last one's. A job dir reused by
    several jobs holds all their logs: the model is the last job's, ``earlier_jobs`` counts the
    others (a coordinator restarted within a job logs ``job_start`` again: same job).
    ``world_size`` is the first generation's; ``resizes`` (time order) change it."""

    job_id: str | None = None
    earlier_jobs: int = 0
    t0: float = 0.0
    begin: float = 0.0
    end: float = 0.0
    world_size: int = 0
    nodes: tuple[str, ...] = ()
    spares: int | None = None
    outcome: str | None = None
    error: str | None = None
    events: int = 0
    intervals: tuple[RankInterval, ...] = ()
    failures: tuple[FailureMark, ...] = ()
    recoveries: tuple[Recovery, ...] = ()
    generations: tuple[Generation, ...] = ()
    node_spans: tuple[NodeSpan, ...] = ()
    node_marks: tuple[Mark, ...] = ()
    coordinator_marks: tuple[Mark, ...] = ()
    tier_marks: tuple[Mark, ...] = ()
    migrations: tuple[MigrationSpan, ...] = ()
    resizes: tuple[ElasticResize, ...] = ()
    waits: tuple[ElasticWait, ...] = ()
    other: tuple[OtherEvent, ...] = ()
    training_start: float | None = None
    finished_at: float | None = None
    failed_at: float | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank seen (``0 .. world_size-1`` plus any other rank an event names)."""
        seen = set(range(self.world_size)) | {i.rank for i in self.intervals}
        seen |= {f.rank for f in self.failures if f.rank is not None}
        seen |= {m.rank for m in self.migrations if m.rank is not None}
        seen |= {r for z in self.resizes for r in z.new_ranks} | {r for w in self.waits for r in w.ranks}
        return tuple(sorted(seen))

    @property
    def lost_steps(self) -> int:
        """Steps recomputed after restores, summed over reconfigurations (not over failures:
        the failures one reconfiguration repaired share its lost steps)."""
        by_gen: dict[object, int] = {}
        for i, r in enumerate(self.recoveries):
            if r.lost_steps is not None:
                by_gen[r.generation if r.generation is not None else ("r", i)] = r.lost_steps
        return sum(by_gen.values())


# -- reading ------------------------------------------------------------------------------------------
def _events_path(path: Path) -> Path:
    if path.is_dir():
        for candidate in (path / EVENTS_FILE, path / "run" / EVENTS_FILE):  # run/: `nonstop demo`'s job
            if candidate.is_file():
                return candidate
        raise UsageError(f"no {EVENTS_FILE} in {path}: pass a job dir or its {EVENTS_FILE}")
    if not path.exists():
        raise UsageError(f"{path} does not exist: pass a job dir or its {EVENTS_FILE}")
    return path


def load_events(path: Path) -> list[dict[str, Any]]:
    """The events of the log at ``path`` (an ``events.jsonl``, or a job dir holding one, or
    holding ``run/events.jsonl`` as ``nonstop demo`` writes it), in file order.

    A torn last line (the writer died mid-line) is dropped. Raises :class:`UsageError` (one
    line) when the path is missing or unreadable, or when it is not an event log: a line that
    is not JSON (but the last), or a JSON line that is not an object with ``ts`` and ``event``.
    """
    p = _events_path(path)
    try:
        return _checked(read_events(p), p)
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass  # a torn tail, or not a log at all: find out which, line by line
    except OSError as e:
        raise UsageError(f"cannot read {p}: {e.strerror or e}") from e
    try:
        lines = p.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"{p} is not a nonstop event log (not UTF-8 text)") from e
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    events: list[dict[str, Any]] = []
    for i, (n, line) in enumerate(numbered):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(numbered) - 1 and events:
                break  # torn last line of a crashed writer
            raise UsageError(f"{p} is not a nonstop event log (line {n} is not JSON)") from e
    return _checked(events, p)


def _checked(events: list[Any], p: Path) -> list[dict[str, Any]]:
    for n, e in enumerate(events, 1):
        if not (isinstance(e, dict) and isinstance(e.get("event"), str) and _num(e.get("ts")) is not None):
            raise UsageError(f"{p} is not a nonstop event log (entry {n} has no 'ts' and 'event')")
    return events


def load_timeline(path: Path) -> Timeline:
    """:func:`build_timeline` of :func:`load_events` ``(path)`` (same errors)."""
    return build_timeline(load_events(path))


# -- building -----------------------------------------------------------------------------------------
def _num(x: object) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x)


def _int(x: object) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.lstrip("-").isdigit():
        return int(x)
    return None


def _str(x: object) -> str | None:
    return None if x is None else str(x)


@dataclass
class _Open:
    rank: int
    spawn_id: int | None
    node: str | None
    generation: int
    start: float
    phase: str = "train"


@dataclass
class _Builder:
    intervals: list[RankInterval] = field(default_factory=list)
    open: dict[int, _Open] = field(default_factory=dict)
    members: dict[int, int] = field(default_factory=dict)
    rank_node: dict[int, str] = field(default_factory=dict)
    spawned_for: dict[int, tuple[int, str | None, float]] = field(
        default_factory=dict
    )  # sid -> rank, node, t
    started: dict[int, _Open] = field(default_factory=dict)  # rank -> its new process starting
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
            self.open[rank] = _Open(rank, sid, self.rank_node.get(rank), self.generation, t)

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


def _ranks_of(x: object) -> tuple[int, ...]:
    return tuple(sorted({r for v in x if (r := _int(v)) is not None})) if isinstance(x, list) else ()


def _int_map(x: object) -> dict[int, int]:
    if not isinstance(x, Mapping):
        return {}
    return {k: v for a, b in x.items() if (k := _int(a)) is not None and (v := _int(b)) is not None}


def _first_generation(generations: Sequence[Generation], lo: float, hi: float) -> Generation | None:
    """The first generation decided in ``[lo, hi]``."""
    return next((g for g in generations if lo - 1e-9 <= g.t <= hi + 1e-9), None)


@dataclass
class _ElasticBuilder:
    """The elastic events of a log (:data:`ELASTIC_EVENTS`), in time order, as :class:`ElasticWait`
    and :class:`ElasticResize` records; :meth:`finish` ties them to the generations."""

    waits: list[ElasticWait] = field(default_factory=list)
    resizes: list[tuple[ElasticResize, bool]] = field(default_factory=list)  # and: the size changed
    wait: ElasticWait | None = None  # open: no decision yet
    grow: ElasticResize | None = None  # open: no grow_done / grow_aborted yet
    swapped: bool = False  # the open grow's 'grow' event came

    def event(self, name: str, e: Mapping[str, Any], t: float) -> None:
        if name == "elastic_wait":
            ranks, wait_s = _ranks_of(e.get("ranks")), _num(e.get("wait_s"))
            if self.wait is None:
                self.wait = ElasticWait(ranks, t, t, wait_s)
            else:  # a re-plan that waits on: the same wait, from its first event
                self.wait = replace(self.wait, ranks=tuple(sorted({*self.wait.ranks, *ranks})))
        elif name == "shrink":
            start = self.wait.start if self.wait is not None else t
            self.decided(t, "shrink")
            shrunk = ElasticResize(
                kind="shrink",
                t=t,
                start=start,
                end=t,
                old_world_size=_int(e.get("old_world_size")),
                world_size=_int(e.get("world_size")),
                outcome="unfinished",
                reason=str(e.get("reason") or ""),
                dropped=_ranks_of(e.get("dropped")),
                renumbered=_int_map(e.get("renumbered")),
            )
            self.resizes.append((shrunk, True))
        elif name == "grow_start":
            self.close_grow(t, "unfinished")  # a grow_start without an end before it: a torn log
            joiners = e.get("joiners") if isinstance(e.get("joiners"), Mapping) else {}
            assert isinstance(joiners, Mapping)
            self.grow = ElasticResize(
                kind="grow",
                t=t,
                start=t,
                end=t,
                old_world_size=_int(e.get("world_size")),
                world_size=_int(e.get("new_world_size")),
                outcome="unfinished",
                prepare_step=_int(e.get("prepare_step")),
                joiners={k: str(v) for a, v in joiners.items() if (k := _int(a)) is not None},
            )
            self.swapped = False
        else:  # grow_pause, grow, grow_done, grow_aborted
            z = self.grow
            if z is None:  # its grow_start is not in the log: it began no later than this
                z = ElasticResize(kind="grow", t=t, start=t, end=t, outcome="unfinished")
                prepare_s = _num(e.get("prepare_s")) if name == "grow_pause" else None
                if prepare_s is not None:
                    z = replace(z, start=t - max(prepare_s, 0.0))
            boundary = _int(e.get("boundary"))
            z = replace(z, boundary=boundary if boundary is not None else z.boundary)
            if name == "grow_pause":
                self.grow = replace(z, paused=t)
            elif name == "grow":
                old, new = _int(e.get("old_world_size")), _int(e.get("world_size"))
                self.grow = replace(
                    z,
                    t=t,
                    old_world_size=old if old is not None else z.old_world_size,
                    world_size=new if new is not None else z.world_size,
                )
                self.swapped = True
            elif name == "grow_done":
                self.grow = replace(z, took_s=_num(e.get("seconds")))
                self.close_grow(t, "done")
            else:
                self.grow = replace(z, error=str(e.get("error") or ""))
                self.close_grow(t, "aborted")

    def decided(self, t: float, outcome: str) -> None:
        """The open wait ends at ``t`` (a shrink, a generation, the job's failure, the log's end)."""
        if self.wait is not None:
            self.waits.append(replace(self.wait, end=max(t, self.wait.start), outcome=outcome))
            self.wait = None

    def close_grow(self, t: float, outcome: str) -> None:
        """The open grow ends at ``t``; its mark is at its swap, or here when it never swapped."""
        z = self.grow
        if z is not None:
            end = max(t, z.start)
            self.resizes.append(
                (replace(z, t=z.t if self.swapped else end, end=end, outcome=outcome), self.swapped)
            )
            self.grow = None

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> tuple[tuple[ElasticResize, ...], tuple[ElasticWait, ...]]:
        """Close what is open at ``end`` (or at the job's failure); find each resize's generation
        (the first decided at or after its ``t``) and when a shrunk generation trained again."""
        stop = end if failed_at is None else failed_at
        self.decided(stop, "unfinished" if failed_at is None else "failed")
        self.close_grow(stop, "unfinished")
        out: list[ElasticResize] = []
        for z, changed in self.resizes:
            g = _first_generation(generations, z.t, end) if changed else None
            if z.kind == "shrink":
                trains = [
                    x.training_start
                    for x in generations
                    if x.t >= z.t - 1e-9 and x.training_start is not None
                ]
                z = (
                    replace(z, end=max(min(trains), z.t), outcome="done")
                    if trains
                    else replace(z, end=max(stop, z.t))
                )
            out.append(replace(z, generation=g.number if g is not None else None))
        return tuple(sorted(out, key=lambda z: z.start)), tuple(sorted(self.waits, key=lambda w: w.start))


@dataclass
class _MoveBuilder:
    """The live migrations of a log (:data:`MIGRATION_EVENTS`) as :class:`MigrationSpan` records,
    each with the ``catchup`` events of its rank while it was open."""

    done: list[MigrationSpan] = field(default_factory=list)
    open: dict[int | None, MigrationSpan] = field(default_factory=dict)  # rank -> its migration

    def event(self, name: str, e: Mapping[str, Any], t: float) -> bool:
        """Take one event; False for one that belongs to no migration (a stray ``catchup``)."""
        rank = _int(e.get("rank"))
        m = self.open.get(rank)
        if name == "migration_start":
            if m is not None:  # started again without an end: a torn log
                self.close(rank, t, "unfinished")
            self.open[rank] = MigrationSpan(
                rank=rank,
                start=t,
                end=t,
                source=_str(e.get("source")),
                target=_str(e.get("target")),
                reason=str(e.get("reason") or ""),
                joiner=_int(e.get("joiner")),
                prepare_step=_int(e.get("step")),
            )
            return True
        if name == "catchup":
            if m is None:
                return False
            c = CatchupMark(
                t=t,
                rank=rank,
                step=_int(e.get("step")),
                ok=bool(e.get("ok", True)),
                delta=bool(e.get("delta")),
                raw_bytes=_int(e.get("raw_bytes")),
                wire_bytes=_int(e.get("wire_bytes")),
                seconds=_num(e.get("seconds")),
                capped=bool(e.get("capped")),
                error=str(e.get("error") or ""),
            )
            self.open[rank] = replace(m, catchups=(*m.catchups, c))
            return True
        if m is None:  # its migration_start is not in the log: it began no later than this
            m = MigrationSpan(rank=rank, start=t, end=t)
            if name == "migration_done" and isinstance(e.get("stages"), Mapping):
                m = replace(m, start=t - sum(max(_num(v) or 0.0, 0.0) for v in e["stages"].values()))
        boundary = _int(e.get("boundary"))
        m = replace(m, boundary=boundary if boundary is not None else m.boundary)
        if name == "migration_pause":
            self.open[rank] = replace(m, paused=t)
            return True
        if name == "migration_done":
            rounds = _int(e.get("catchup_rounds"))
            swap_delta = e.get("swap_delta")
            self.open[rank] = replace(
                m,
                source=_str(e.get("source")) or m.source,
                target=_str(e.get("target")) or m.target,
                reason=m.reason or str(e.get("reason") or ""),
                catchup_rounds=rounds,
                swap_delta=swap_delta if isinstance(swap_delta, bool) else None,
                pause_ratio=_num(e.get("pause_ratio")),
            )
            self.close(rank, t, "done")
        else:  # migration_aborted
            self.open[rank] = replace(m, phase=_str(e.get("phase")), error=str(e.get("error") or ""))
            self.close(rank, t, "aborted")
        return True

    def close(self, rank: int | None, t: float, outcome: str) -> None:
        m = self.open.pop(rank, None)
        if m is not None:
            self.done.append(replace(m, end=max(t, m.start), outcome=outcome))

    def finish(
        self, end: float, failed_at: float | None, generations: Sequence[Generation]
    ) -> tuple[MigrationSpan, ...]:
        """Close what is open at ``end`` (or the job's failure); find each swap's generation (the
        first decided between its pause and its end)."""
        for rank in list(self.open):
            self.close(rank, end if failed_at is None else failed_at, "unfinished")
        out = []
        for m in self.done:
            g = None
            if m.paused is not None and m.outcome != "aborted":  # an aborted one swapped nobody in
                g = _first_generation(generations, m.paused, m.end)
            out.append(replace(m, generation=g.number if g is not None else None))
        return tuple(sorted(out, key=lambda m: m.start))


def _last_job(evs: list[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], int]:
    """The events of the last job in a log (sorted by time) and how many jobs came before it.

    A job begins at its first ``job_start`` (a restarted coordinator logs another one with the same
    ``job_id``). Events logged between the previous job's ``job_end`` and that ``job_start`` belong
    to it; when the previous job has no ``job_end`` (killed), its first ``job_start`` is the cut.
    """
    starts = [i for i, e in enumerate(evs) if e.get("event") == "job_start"]
    if not starts:
        return evs, 0
    last_id = evs[starts[-1]].get("job_id")
    first = next(i for i in starts if evs[i].get("job_id") == last_id)
    before = [i for i in starts if i < first]
    if not before:
        return evs, 0
    ends = [i for i in range(before[-1], first) if evs[i].get("event") == "job_end"]
    cut = ends[-1] + 1 if ends else first
    return evs[cut:], len({evs[i].get("job_id") for i in before})


def _stage_spans(stages: Mapping[str, Any], start: float) -> tuple[StageSpan, ...]:
    keys = [s for s in STAGE_ORDER if s in stages] + [s for s in stages if s not in STAGE_ORDER]
    out, t = [], start
    for k in keys:
        sec = _num(stages[k])
        if sec is None:
            continue
        sec = max(sec, 0.0)
        out.append(StageSpan(k, t, t + sec))
        t += sec
    return tuple(out)


def build_timeline(events: Iterable[Mapping[str, Any]]) -> Timeline:
    """The :class:`Timeline` of an event log (events as :func:`load_events` returns them,
    in any order: they are sorted by ``ts``, stably). Pure: no I/O, no matplotlib.

    Never raises on the content of a well-formed log (missing fields default to None,
    unknown events become :class:`OtherEvent`); an empty log gives an empty Timeline.
    """
    evs = sorted(
        (
            e for e in events if _num(e.get("ts")) is not None and e.get("event") != "eventlog"
        ),  # not the header
        key=lambda e: float(e["ts"]),
    )
    if not evs:
        return Timeline()
    evs, earlier = _last_job(evs)
    starts = [e for e in evs if e.get("event") == "job_start"]
    head = starts[0] if starts else evs[0]
    t0 = float(head["ts"])

    def rel(e: Mapping[str, Any]) -> float:
        return float(e["ts"]) - t0

    b = _Builder()
    job_id = _str(head.get("job_id")) if starts else None
    nnodes = _int(head.get("nnodes")) if starts else None
    nproc = _int(head.get("nproc")) if starts else None
    spares = _int(head.get("spares")) if starts else None
    node_order: list[str] = []

    def see_node(n: object) -> str | None:
        s = _str(n)
        if s is not None and s not in node_order:
            node_order.append(s)
        return s

    failures: list[FailureMark] = []
    pending: list[FailureMark] = []  # failures without their recovery record yet
    recoveries: list[Recovery] = []
    gens: list[dict[str, Any]] = []
    stage_spans: dict[int, list[StageSpan]] = {}
    training_start: dict[int, float] = {}
    node_state: dict[str, tuple[str, float]] = {}  # node -> (state, since)
    node_spans: list[NodeSpan] = []
    node_marks: list[Mark] = []
    coord_marks: list[Mark] = []
    tier_marks: list[Mark] = []
    elastic = _ElasticBuilder()
    moves = _MoveBuilder()
    other: list[OtherEvent] = []
    injected: dict[tuple[int | None, int | None], float] = {}  # (rank, spawn_id) -> fault time
    outcome = error = None
    finished_at = failed_at = None
    resumed_at: list[float] = []  # ends of 'resume' stages: a generation that fully trains again

    def node_to(node: str, state: str | None, t: float, reason: str) -> None:
        cur = node_state.pop(node, None)
        if cur is not None:
            node_spans.append(NodeSpan(node, cur[1], max(t, cur[1]), cur[0], reason))
        if state is not None:
            node_state[node] = (state, t)

    for e in evs:
        name = str(e.get("event"))
        t = rel(e)
        if name == "job_start":
            continue
        if name == "nodes_joined":
            for n in e.get("nodes") or []:
                see_node(n)
        elif name == "node_join":
            node = see_node(e.get("node"))
            if node is not None:
                rejoin = (
                    bool(e.get("rejoin")) or node in node_state or any(s.node == node for s in node_spans)
                )
                node_to(node, "up", t, "rejoin")
                node_marks.append(Mark(t, "rejoin" if rejoin else "join", node))
        elif name == "node_lost":
            node = see_node(e.get("node"))
            if node is not None:
                node_to(node, None, t, "lost")
                reason = str(e.get("reason") or "")
                if e.get("quarantined"):
                    reason = f"{reason} (quarantined)" if reason else "quarantined"
                node_marks.append(Mark(t, "lost", node, detail=reason))
        elif name in ("node_disconnected", "node_reconnected"):
            node = see_node(e.get("node"))
            if node is not None:
                down = name == "node_disconnected"
                node_to(node, "disconnected" if down else "up", t, "disconnected" if down else "reconnected")
                node_marks.append(Mark(t, "disconnected" if down else "reconnected", node))
        elif name in ("coordinator_leads", "coordinator_resumed"):
            detail = str(e.get("address") or "")
            g = _int(e.get("generation"))
            if name == "coordinator_resumed" and g is not None:
                detail = f"g{g}"
            coord_marks.append(Mark(t, "leads" if name == "coordinator_leads" else "resumed", detail=detail))
        elif name == "spawn":
            sid, rank = _int(e.get("spawn_id")), _int(e.get("rank"))
            node = see_node(e.get("node"))
            if sid is not None and rank is not None and e.get("role", "worker") == "worker":
                b.spawned_for[sid] = (rank, node, t)
                if rank not in b.open:
                    b.started[rank] = _Open(rank, sid, node, b.generation, t, phase="start")
        elif name == "spare_takes_over":
            rank, sid = _int(e.get("rank")), _int(e.get("spawn_id"))
            if rank is not None and sid is not None:
                b.members[rank] = sid
                st = b.started.get(rank)
                if st is not None and st.spawn_id != sid:
                    del b.started[rank]  # the cold process lost the race; a hot spare plays the rank
        elif name == "generation":
            g = _int(e.get("generation")) or b.generation + 1
            # a new membership without a failure (or before its failure event): training stops
            for rank in sorted(b.open):
                b.close(rank, t, "recovery")
            b.generation = g
            members = {
                r: s
                for k, v in (e.get("members") or {}).items()
                if (r := _int(k)) is not None and (s := _int(v)) is not None
            }
            nodes = {
                r: str(v)
                for k, v in (e.get("nodes") or {}).items()
                if (r := _int(k)) is not None and v is not None
            }
            for n in nodes.values():
                see_node(n)
            b.members, b.rank_node = dict(members), dict(nodes)
            elastic.decided(t, "replaced")  # a wait a shrink did not end: spares took its ranks
            gens.append({**e, "_t": t, "_g": g, "_members": members, "_nodes": nodes})
        elif name == "stage":
            g = _int(e.get("generation")) or b.generation
            sec = max(_num(e.get("seconds")) or 0.0, 0.0)
            st_name = str(e.get("stage"))
            stage_spans.setdefault(g, []).append(StageSpan(st_name, t - sec, t))
            if st_name == "rebuild" and g == b.generation:
                training_start.setdefault(g, t)
                b.train(t)
            elif st_name == "resume":
                if g == b.generation and g not in training_start:  # no rebuild stage seen
                    training_start[g] = t - sec
                    b.train(t - sec)
                resumed_at.append(t)
        elif name == "fault_injected":
            injected[(_int(e.get("rank")), _int(e.get("spawn_id")))] = t
        elif name == "failure":
            rank, sid, kind = _int(e.get("rank")), _int(e.get("spawn_id")), str(e.get("kind") or "?")
            detect_s = _num(e.get("detect_s"))
            fault_t = t - detect_s if detect_s is not None else injected.get((rank, sid), t)
            fault_t = min(fault_t, t)
            node = b.rank_node.get(rank) if rank is not None else None
            if sid is not None and sid in b.spawned_for and node is None:
                node = b.spawned_for[sid][1]
            f = FailureMark(
                t=fault_t,
                detected=t,
                kind=kind,
                rank=rank,
                step=_int(e.get("step")),
                spawn_id=sid,
                node=node,
                detail=str(e.get("detail") or ""),
            )
            failures.append(f)
            pending.append(f)
            if rank is not None:
                b.fail(rank, fault_t, t, kind)
                st = b.started.get(rank)
                if st is not None and st.spawn_id == sid:  # a process that died while starting
                    b.started.pop(rank)
                    b.intervals.append(
                        RankInterval(
                            rank, sid, st.node, st.generation, st.start, max(fault_t, st.start), "start", kind
                        )
                    )
        elif name == "recovery":
            mttr = _num(e.get("mttr_s"))
            stages = e.get("stages") if isinstance(e.get("stages"), Mapping) else {}
            assert isinstance(stages, Mapping)
            total = sum(max(_num(v) or 0.0, 0.0) for v in stages.values())
            start = t - (mttr if mttr is not None else total)
            rank, kind = _int(e.get("rank")), str(e.get("kind") or "?")
            for i, f in enumerate(pending):
                if f.rank == rank and f.kind == kind:
                    del pending[i]
                    break
            g = _int(e.get("generation"))
            tier = next((str(x.get("tier")) for x in gens if x["_g"] == g and x.get("tier")), None)
            recoveries.append(
                Recovery(
                    generation=g,
                    kind=kind,
                    rank=rank,
                    step=_int(e.get("step")),
                    start=start,
                    end=t,
                    stages=_stage_spans(stages, start),
                    complete=True,
                    mttr_s=mttr,
                    training_again_s=_num(e.get("training_again_s")),
                    lost_steps=_int(e.get("lost_steps")),
                    restore_step=_int(e.get("restore_step")),
                    replacement=_str(e.get("replacement")),
                    tier=tier,
                    detail=str(e.get("detail") or ""),
                )
            )
        elif name in TIER_EVENTS:
            detail = str(e.get("error") or e.get("errors") or "")
            if name == "restore_from_durable":
                took = _num(e.get("seconds"))
                detail = f"{took:.2f}s" if took is not None else ""
            tier_marks.append(Mark(t, TIER_EVENTS[name], _str(e.get("node")), _int(e.get("step")), detail))
        elif name == "finish":
            finished_at = t
            b.close_all(t, "finish")
        elif name == "job_done":
            b.close_all(t, "finish")
        elif name == "job_failed":
            failed_at = t
            error = _str(e.get("error"))
            b.close_all(t, "failed")
        elif name == "job_end":
            outcome = _str(e.get("state"))
            error = _str(e.get("error")) or error
            b.close_all(t, "end")
        elif name in ELASTIC_EVENTS:
            elastic.event(name, e, t)
        elif name in MIGRATION_EVENTS and moves.event(name, e, t):
            continue  # taken (not: a catch-up outside any migration, kept as an OtherEvent below)
        elif name in KNOWN_EVENTS and name not in MIGRATION_EVENTS:
            continue  # spawned, connect, exit, hang_detected: shown through what follows them
        else:  # unknown, or a catch-up outside any migration
            fields = {k: v for k, v in e.items() if k not in ("ts", "event")}
            other.append(OtherEvent(t, name, _int(e.get("rank")), _str(e.get("stage")), fields))

    end = rel(evs[-1])
    b.close_all(end, "log_end")
    for node in list(node_state):
        node_to(node, None, end, "log_end")

    generations = tuple(
        Generation(
            number=x["_g"],
            t=x["_t"],
            cause=tuple(c for c in (_int(v) for v in x.get("cause") or []) if c is not None),
            tier=_str(x.get("tier")),
            restore_step=_int(x.get("restore_step")),
            members=x["_members"],
            nodes=x["_nodes"],
            stages=tuple(stage_spans.get(x["_g"], [])),
            training_start=training_start.get(x["_g"]),
        )
        for x in gens
    )
    # failures the log never reports a recovery for: unfinished when nothing trained again after
    # them (a job killed mid-recovery); handled without a record otherwise (died while starting)
    for f in pending:
        if any(r > f.detected for r in resumed_at):
            continue
        recoveries.append(_unfinished(f, generations, end if failed_at is None else failed_at))

    resizes, waits = elastic.finish(end, failed_at, generations)
    migrations = moves.finish(end, failed_at, generations)
    world = len(generations[0].members) if generations else 0
    if world == 0 and nnodes is not None and nproc is not None:
        world = nnodes * nproc
    return Timeline(
        job_id=job_id,
        earlier_jobs=earlier,
        begin=min(rel(evs[0]), 0.0),
        t0=t0,
        end=end,
        world_size=world,
        nodes=tuple(sorted(node_order, key=_node_key)),
        spares=spares,
        outcome=outcome,
        error=error,
        events=len(evs),
        intervals=tuple(sorted(b.intervals, key=lambda i: (i.rank, i.start, i.phase != "start"))),
        failures=tuple(failures),
        recoveries=tuple(sorted(recoveries, key=lambda r: r.start)),
        generations=generations,
        node_spans=tuple(node_spans),
        node_marks=tuple(node_marks),
        coordinator_marks=tuple(coord_marks),
        tier_marks=tuple(tier_marks),
        migrations=migrations,
        resizes=resizes,
        waits=waits,
        other=tuple(other),
        training_start=min(training_start.values(), default=None),
        finished_at=finished_at,
        failed_at=failed_at,
    )


def _node_key(name: str) -> tuple[int, int, str]:
    """Nodes in natural order: "2" before "10", numbers before names."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _unfinished(f: FailureMark, generations: Sequence[Generation], end: float) -> Recovery:
    """A failure's recovery as far as the log shows it: detect, then plan up to the next
    generation event, then that generation's (and later ones') stage events."""
    stages = [StageSpan("detect", f.t, f.detected)]
    after = [g for g in generations if g.t >= f.detected]
    t = f.detected
    if after:
        stages.append(StageSpan("plan", t, max(after[0].t, t)))
        t = max(after[0].t, t)
        for g in after:
            for s in g.stages:
                if s.end > t:
                    stages.append(StageSpan(s.stage, max(s.start, t), s.end))
                    t = s.end
    last = after[-1] if after else None
    return Recovery(
        generation=last.number if last else None,
        kind=f.kind,
        rank=f.rank,
        step=f.step,
        start=f.t,
        end=max(t, end),
        stages=tuple(stages),
        complete=False,
        restore_step=last.restore_step if last else None,
        tier=last.tier if last else None,
        detail=f.detail,
    )


# -- text ---------------------------------------------------------------------------------------------
def _fmt_s(s: float) -> str:
    return f"{s * 1000:.0f}ms" if s < 1.0 else f"{s:.2f}s"


def _unfinished_text(tl: Timeline, end: float, what: str = "recovered") -> str:
    """How a record open at ``end`` (the log's end or the job's failure) ended."""
    if tl.failed_at is not None and end >= tl.failed_at - 1e-6:
        return f"not {what}: job failed"
    return "unfinished (the log ends)"


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in ranks)}"


def _wait_text(tl: Timeline, w: ElasticWait) -> str:
    upto = f" up to {_fmt_s(w.wait_s)}" if w.wait_s is not None else ""
    have = "has" if len(w.ranks) == 1 else "have"
    how = {
        "shrink": f"shrank after {_fmt_s(w.seconds)}",
        "replaced": f"a spare took over after {_fmt_s(w.seconds)}",
        "failed": f"the job failed after {_fmt_s(w.seconds)}",
    }.get(w.outcome, "still waiting (the log ends)")
    return f"wait      {_ranks_text(w.ranks)} {have} no spare: waits{upto} | {how}"


def _resize_text(tl: Timeline, z: ElasticResize) -> str:
    gen = f"g{z.generation} " if z.generation is not None else ""
    sizes = z.sizes.replace("→", " -> ") + " ranks"
    if z.kind == "shrink":
        parts = [f"dropped {_ranks_text(z.dropped)}"] if z.dropped else []
        if z.renumbered:
            parts.append("renumbered " + ", ".join(f"{o}->{n}" for o, n in sorted(z.renumbered.items())))
        head = f"shrink    {gen}{sizes}" + (f", {', '.join(parts)}" if parts else "")
        head += f" ({z.reason})" if z.reason else ""
        tail = [f"waited {_fmt_s(z.t - z.start)}"] if z.t > z.start else []
        if z.outcome == "done":
            tail.append(f"training again {_fmt_s(z.end - z.t)} later")
        else:
            tail.append(_unfinished_text(tl, z.end, "training again"))
        return f"{head} | {', '.join(tail)}"
    at = f" at boundary {z.boundary}" if z.boundary is not None else ""
    prep = z.stages[0]
    prepared = f"prepare {_fmt_s(prep.seconds)}" + (
        f" (step {z.prepare_step})" if z.prepare_step is not None else ""
    )
    if z.outcome == "aborted":
        return f"grow      {sizes} aborted{at} after {_fmt_s(z.end - z.start)}: {z.error or '?'}"[:200]
    if z.outcome == "unfinished":
        return f"grow      {gen}{sizes}{at}: {prepared} | {_unfinished_text(tl, z.end, 'grown')}"
    swap = f", swap {_fmt_s(z.stages[1].seconds)}" if len(z.stages) > 1 else ""
    return f"grow      {gen}{sizes}{at}: {prepared}{swap} | {_fmt_s(z.seconds)}"


def _migration_text(tl: Timeline, m: MigrationSpan) -> str:
    where = f"node {m.source or '?'} -> {m.target or '?'}"
    why = f" ({m.reason})" if m.reason else ""
    at = f" at boundary {m.boundary}" if m.boundary is not None else ""
    head = f"migrate   rank {m.rank} {where}{why}{at}"
    if m.outcome == "aborted":
        phase = f" in {m.phase}" if m.phase else ""
        return f"{head} aborted{phase} after {_fmt_s(m.seconds)}: {m.error or '?'}"[:200]
    parts = [f"{s.stage} {_fmt_s(s.seconds)}" for s in m.stages]
    rounds = f"{m.rounds} catch-up round{'s' if m.rounds != 1 else ''}"
    if m.catchups:
        rounds += f" ({', '.join(c.kind for c in m.catchups)})"
    parts.append(rounds)
    if m.swap_delta is not None:
        parts.append("swap fetched a delta" if m.swap_delta else "swap fetched the whole step")
    tail = f"{_fmt_s(m.seconds)}" if m.outcome == "done" else _unfinished_text(tl, m.end, "moved")
    if m.outcome == "done" and m.pause_ratio is not None:
        tail += f", step gap {m.pause_ratio:.2f}x the median step"
    return f"{head}: {', '.join(parts)} | {tail}"


def _summary(tl: Timeline) -> str:
    nodes = len(tl.nodes)
    where = f"{tl.world_size} rank{'s' if tl.world_size != 1 else ''}"
    if nodes:
        where += f" on {nodes} node{'s' if nodes != 1 else ''}"
    outcome = tl.outcome or "no job_end (running or killed)"
    sizes = [tl.world_size, *(z.world_size for z in tl.resizes if z.resized)]
    if len(sizes) > 1:  # the world sizes it went through
        where += f" (world {'->'.join('?' if n is None else str(n) for n in sizes)})"
    earlier = f" (the log's last job; {tl.earlier_jobs} earlier)" if tl.earlier_jobs else ""
    return f"job {tl.job_id or '?'}{earlier}: {where}, {outcome} after {tl.end:.1f}s"


def _totals(tl: Timeline) -> str:
    kinds: dict[str, int] = {}
    for f in tl.failures:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    k = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    mttrs = [r.mttr_s for r in tl.recoveries if r.mttr_s is not None]
    out = f"{len(tl.failures)} failure{'s' if len(tl.failures) != 1 else ''}" + (f" ({k})" if k else "")
    if mttrs:
        out += f", MTTR mean {_fmt_s(sum(mttrs) / len(mttrs))} max {_fmt_s(max(mttrs))}"
    unfinished = sum(not r.complete for r in tl.recoveries)
    if unfinished:
        out += f", {unfinished} unfinished recover{'ies' if unfinished != 1 else 'y'}"
    out += f", {tl.lost_steps} lost step{'s' if tl.lost_steps != 1 else ''}"
    counts = {
        "migration": len(tl.migrations),
        "shrink": sum(z.kind == "shrink" for z in tl.resizes),
        "grow": sum(z.kind == "grow" and z.resized for z in tl.resizes),
        "aborted grow": sum(z.kind == "grow" and z.outcome == "aborted" for z in tl.resizes),
    }
    for name, n in counts.items():
        if n:
            out += f", {n} {name}{'s' if n != 1 else ''}"
    return out


def timeline_text(timeline: Timeline) -> str:
    """A compact summary for a terminal: a header line (job, ranks, nodes, outcome, totals),
    then one line per failure, recovery (with each stage's seconds and MTTR), node loss,
    coordinator restart, durable restore, wait for a spare, shrink, grow, migration (with its
    catch-up rounds and how the swap fetched) and job failure, in time order: a recovery at its
    end, a shrink at its decision, anything else at its start. No trailing newline."""
    tl = timeline
    lines: list[tuple[float, int, str]] = []
    for f in tl.failures:
        where = f"rank {f.rank}" + (f" (node {f.node})" if f.node is not None else "")
        step = f" after step {f.step}" if f.step is not None else ""
        det = f", detected in {_fmt_s(f.detected - f.t)}" if f.detected > f.t else ""
        detail = f" ({f.detail})" if f.detail else ""
        lines.append((f.t, 0, f"failure   {f.kind} {where}{step}{detail}{det}"))
    for r in tl.recoveries:
        stages = " ".join(
            f"{k} {_fmt_s(v)}" for k, v in r.stage_seconds.items() if k != "replan" or v > 0
        )  # replan: only when a later failure interrupted a reconfiguration
        gen = f"g{r.generation} " if r.generation is not None else ""
        how = []
        if r.replacement:
            how.append(f"-> {r.replacement}")
        if r.restore_step is not None:
            how.append(f"restored step {r.restore_step}" + (f" ({r.tier})" if r.tier else ""))
        head = f"recovery  {gen}{r.kind} rank {r.rank}" + (f" {' '.join(how)}" if how else "")
        if r.complete and r.mttr_s is not None:
            tail = f"| MTTR {_fmt_s(r.mttr_s)}"
            if r.lost_steps is not None:
                tail += f", lost steps {r.lost_steps}"
        else:
            tail = f"| {_unfinished_text(tl, r.end)}"
        lines.append((r.end, 1, f"{head}: {stages} {tail}"))
    for m in tl.node_marks:
        if m.kind == "lost":
            lines.append((m.t, 0, f"node      {m.node} lost" + (f": {m.detail}" if m.detail else "")))
        elif m.kind == "rejoin":
            lines.append((m.t, 0, f"node      {m.node} rejoined"))
    for m in tl.coordinator_marks:
        if m.kind == "resumed":
            lines.append((m.t, 0, f"coord     coordinator restarted, resumed {m.detail}".rstrip()))
    for m in tl.tier_marks:
        if m.kind == "restore_durable":
            lines.append(
                (m.t, 0, f"durable   restored step {m.step} from the durable tier {m.detail}".rstrip())
            )
        elif m.kind in ("persist_failed", "durable_failed"):
            lines.append((m.t, 0, f"durable   {m.kind.replace('_', ' ')}: {m.detail}"[:160]))
    for w in tl.waits:
        lines.append((w.start, 1, _wait_text(tl, w)))
    for z in tl.resizes:
        lines.append((z.t if z.kind == "shrink" else z.start, 1, _resize_text(tl, z)))
    for mv in tl.migrations:
        lines.append((mv.start, 1, _migration_text(tl, mv)))
    if tl.failed_at is not None:
        lines.append((tl.failed_at, 2, f"job       failed: {tl.error or '?'}"))
    out = [f"{_summary(tl)}; {_totals(tl)}"]
    out += [f"{t:8.2f}s  {s}" for t, _, s in sorted(lines, key=lambda x: (x[0], x[1]))]
    return "\n".join(out)


# -- picture ------------------------------------------------------------------------------------------
STAGE_COLORS = {
    "startup": "#d9d9d9",
    "detect": "#e15759",
    "replan": "#9c755f",
    "plan": "#f28e2b",
    "launch": "#edc948",
    "restore": "#59a14f",
    "rebuild": "#4e79a7",
    "resume": "#b07aa1",
}
EXTRA_STAGE_COLORS = ("#76b7b2", "#ff9da7", "#bab0ac", "#86bcb6")
NODE_COLORS = (
    "#80b1d3", "#fdb462", "#b3de69", "#bebada", "#8dd3c7", "#fccde5",
    "#ffed6f", "#e5c494", "#bc80bd", "#ccebc5", "#b3cde3", "#fb8072",
)  # fmt: skip
FAILURE_STYLE = {  # kind -> (marker, color)
    "kill": ("X", "#d62728"),
    "hang": ("D", "#ff7f0e"),
    "exit": ("s", "#9467bd"),
    "error": ("^", "#8c564b"),
    "node": ("v", "#222222"),
}
OTHER_FAILURE_STYLE = ("o", "#7f7f7f")
MOVE_COLORS = {"prepare": "#a0cbe8", "swap": "#ffbe7d"}  # a migration's or a grow's stages
MOVE_STAGE_NAMES = {"prepare": "prepare (move, grow)", "swap": "pause + swap"}
RESIZE_STYLE = {  # kind -> (color, line style, legend name)
    "shrink": ("#b2182b", "-", "shrink"),
    "grow": ("#1a9850", "-", "grow"),
    "aborted": ("#7f7f7f", "--", "grow aborted"),
}
CATCHUP_STYLE = {  # kind -> (marker, color, filled, legend name)
    "delta": ("v", "#1f5fa8", True, "catch-up (delta)"),
    "whole": ("s", "#1f5fa8", False, "catch-up (whole step)"),
    "failed": ("x", "#d62728", False, "catch-up failed"),
}
WAIT_COLOR = "#e8871e"
RENUMBERED_LABELS = 8  # "was rank N" on each renumbered row up to this many; beyond, on the first only
FONT = 7.5  # points, for the labels in the plot
_CHAR_W = 0.58  # a character's width in font sizes (an estimate, for "does it fit")


class _Lanes:
    """Keeps the labels of a row from overlapping: a label is drawn only if its extent (in
    points along x) is free on its row."""

    def __init__(self, pts_per_s: float) -> None:
        self.pts_per_s = pts_per_s
        self.taken: dict[object, list[tuple[float, float]]] = {}

    def width_s(self, text: str, size: float = FONT) -> float:
        return (len(text) * size * _CHAR_W + 2.0) / self.pts_per_s

    def take(self, row: object, x0: float, x1: float) -> bool:
        spans = self.taken.setdefault(row, [])
        if any(a < x1 and x0 < b for a, b in spans):
            return False
        spans.append((x0, x1))
        return True


def _stage_color(stage: str, extra: dict[str, str]) -> str:
    if stage in STAGE_COLORS:
        return STAGE_COLORS[stage]
    if stage not in extra:
        extra[stage] = EXTRA_STAGE_COLORS[len(extra) % len(EXTRA_STAGE_COLORS)]
    return extra[stage]


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _title(tl: Timeline) -> str:
    return f"nonstop timeline: {_summary(tl)}\n{_totals(tl)}"


def render_timeline(timeline: Timeline, out: Path) -> Path:
    """Draw ``timeline`` to ``out`` (format from its extension: .png, .svg or .pdf; parent dirs
    created) and return ``out``. Raises :class:`UsageError` for another extension.

    Rows, top to bottom: one per rank (a bar per period a process trains as that rank, colored
    by node and labelled with its spawn id where it fits; hatched while a new process starts;
    dotted orange while a failed rank waits for a spare; failure markers by kind with the step;
    a migration's, or a grow's joiner's, ``prepare`` and ``swap`` as a strip under the bar, with a
    mark per catch-up round: a filled triangle for a delta, a hollow square for a whole step),
    ``recovery`` (each recovery's stages stacked, MTTR; the job's startup; the stages of a
    generation no failure caused, such as a swap, paler), one per node (up, disconnected,
    join/lost markers), ``coordinator`` (if it restarted), ``tiers`` (replicated steps, persists,
    durable restores) and ``other events`` (every event the model does not know).
    Generations are light vertical lines ``g1, g2, ...``; each shrink and grow a line across the
    rank rows (dashed: an aborted grow) labelled ``shrink 3→2`` / ``grow 2→3`` in a lane above
    them, shaded until the new world trains.
    Labels that would overlap are left out, so long jobs stay readable.
    """
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise UsageError(
            f"cannot draw a timeline as {out.name!r}: use a file name ending in {', '.join(FORMATS)}"
        )
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    from nonstop.sim.metrics import pyplot, save_figure

    plt = pyplot()
    tl = timeline
    rows: list[tuple[object, str]] = [(("rank", r), f"rank {r}") for r in tl.ranks]
    rows.append((("recovery",), "recovery"))
    rows += [(("node", n), f"node {n}") for n in tl.nodes]
    if tl.coordinator_marks:
        rows.append((("coordinator",), "coordinator"))
    if tl.tier_marks:
        rows.append((("tiers",), "tiers"))
    if tl.other:
        rows.append((("other",), "other events"))
    y = {key: i for i, (key, _) in enumerate(rows)}
    n_rows = len(rows)
    row_h = 0.34 if n_rows <= 24 else max(0.12, 10.0 / n_rows)
    lane = 0.2 / row_h if tl.resizes else 0.0  # rows of room above the ranks for the resize labels
    n_ranks = len(tl.ranks)
    width_in = 15.0
    fig, ax = plt.subplots(figsize=(width_in, 1.9 + 0.8 + (n_rows + lane) * row_h))
    span = max(tl.end - tl.begin, 1e-3)
    x_lo, x_hi = tl.begin - 0.01 * span, tl.end + 0.03 * span
    lanes = _Lanes((width_in - 2.0) * 72.0 / (x_hi - x_lo))
    big = row_h >= 0.19  # room for text inside rows
    fs = FONT if row_h >= 0.3 else FONT - 1.0
    pad = 4.0 / lanes.pts_per_s  # a label's distance from its marker, seconds
    node_color = {n: NODE_COLORS[i % len(NODE_COLORS)] for i, n in enumerate(tl.nodes)}

    def ncolor(node: str | None) -> str:
        return node_color.get(node, "#cccccc") if node is not None else "#cccccc"

    def label(
        row: object,
        x: float,
        yy: float,
        text: str,
        *,
        ha: str = "left",
        size: float = 0.0,
        color: str = "black",
        box: bool = False,
        inside: tuple[float, float] | None = None,
    ) -> bool:
        """Draw ``text`` at ``x`` if it fits (inside ``inside``, within the axes, clear of the row's
        other labels); a left-aligned label that would run off the right edge goes left of its
        marker instead. Whether it was drawn."""
        size = size or fs
        w = lanes.width_s(text, size)
        if inside is not None and inside[1] - inside[0] < w:
            return False
        if ha == "left" and x + w > x_hi:
            ha, x = "right", x - 2 * pad
        x0 = x - w / 2 if ha == "center" else x if ha == "left" else x - w
        if x0 < x_lo or x0 + w > x_hi or not lanes.take(row, x0, x0 + w):
            return False
        bbox = {"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.75} if box else None
        ax.text(
            x, yy, text, ha=ha, va="center", fontsize=size, color=color, bbox=bbox, zorder=6, clip_on=True
        )
        return True

    # generations: light vertical lines, labelled on top
    for g in tl.generations:
        ax.axvline(g.t, color="#888888", lw=0.7, alpha=0.45, zorder=0)
        text = f"g{g.number}"
        w = lanes.width_s(text)
        if lanes.take("gen", g.t - w / 2, g.t + w / 2):
            ax.text(
                g.t,
                -0.75 - lane,
                text,
                ha="center",
                va="bottom",
                fontsize=FONT,
                color="#555555",
                clip_on=False,
            )
    if tl.failed_at is not None:
        ax.axvline(tl.failed_at, color="#d62728", lw=1.2, ls="--", zorder=1)
        ax.text(
            tl.failed_at,
            -0.75 - lane,
            " job failed",
            ha="left",
            va="bottom",
            fontsize=FONT,
            color="#d62728",
            clip_on=False,
        )

    # failures first: their labels take the room before the spawn ids do
    kinds_seen: dict[str, tuple[str, str]] = {}
    for f in tl.failures:
        if f.rank is None or ("rank", f.rank) not in y:
            continue
        yy = y[("rank", f.rank)]
        marker, color = FAILURE_STYLE.get(f.kind, OTHER_FAILURE_STYLE)
        kinds_seen[f.kind] = (marker, color)
        if f.detected > f.t:
            ax.plot([f.t, f.detected], [yy, yy], color=color, lw=1.2, alpha=0.8, zorder=4)
        ax.scatter(
            [f.t],
            [yy],
            marker=marker,
            s=70 if big else 30,
            c=color,
            edgecolors="black",
            linewidths=0.6,
            zorder=5,
        )
        text = f"{f.kind} @{f.step}" if f.step is not None else f.kind
        if big:
            label(("rank", f.rank), max(f.t, f.detected) + pad, yy, text, color=color, box=True)

    moves_seen: dict[str, str] = {}

    def strip(yy: float, stages: Sequence[StageSpan], *, aborted: bool) -> None:
        """A migration's or a grow's stages as a thin strip under the rank bar at ``yy`` (hatched
        red when it was aborted)."""
        for s in stages:
            if s.seconds <= 0 or s.stage not in MOVE_COLORS:
                continue
            c = MOVE_COLORS[s.stage]
            moves_seen.setdefault(s.stage, c)
            ax.broken_barh(
                [(s.start, s.seconds)],
                (yy + 0.3, 0.16),
                facecolors=c,
                edgecolors="#d62728" if aborted else c,
                hatch="xxx" if aborted else None,
                linewidth=0.4,
                zorder=3,
            )

    # elastic resizes: a line across the rank rows where the world size changed (dashed: an aborted
    # grow), a faint band until the new world trains, labelled in a lane above the ranks
    resize_seen: dict[str, Any] = {}
    lane_y = -0.55 - lane / 2
    for z in tl.resizes:
        style = z.label.split(" ")[0] if z.outcome != "aborted" else "aborted"
        color, ls, name = RESIZE_STYLE[style]
        resize_seen[name] = Line2D([], [], color=color, lw=1.3, ls=ls)
        ax.vlines([z.t], lane_y + 0.15, n_ranks - 0.5, colors=color, linewidth=1.3, linestyles=ls, zorder=4)
        if z.resized and z.end > z.t:
            ax.fill_between([z.t, z.end], -0.5, n_ranks - 0.5, color=color, alpha=0.08, lw=0, zorder=1)
        label(("resize",), z.t, lane_y, z.label, ha="center", color=color, box=True)
        if z.kind == "grow":  # the joiners' prepare (and swap) under their new ranks' rows
            for nr in z.new_ranks:
                if ("rank", nr) in y:
                    strip(y[("rank", nr)], z.stages, aborted=z.outcome == "aborted")
        elif big:  # a renumbered process on its new row (on the first only, when many were)
            moved = sorted(z.renumbered.items())
            more = f" (+{len(moved) - 1} renumbered)" if len(moved) > RENUMBERED_LABELS else ""
            for old, new in moved if not more else moved[:1]:
                if ("rank", new) in y:
                    text = f"was rank {old}{more}"
                    label(("rank", new), z.t + pad, y[("rank", new)], text, box=True, size=fs - 0.5)

    # live migrations: prepare and swap under the moving rank's row, a mark per catch-up round
    catchup_seen: dict[str, Any] = {}
    for mv in tl.migrations:
        if mv.rank is None or ("rank", mv.rank) not in y:
            continue
        yy = y[("rank", mv.rank)]
        strip(yy, mv.stages, aborted=mv.outcome == "aborted")
        yc = yy + 0.38
        for cu in mv.catchups:
            marker, color, filled, name = CATCHUP_STYLE[cu.kind]
            if cu.seconds is not None and cu.seconds > 0:  # the fetch, up to when it was installed
                ax.plot([cu.t - cu.seconds, cu.t], [yc, yc], color=color, lw=0.8, zorder=4)
            if marker == "x":
                ax.scatter(
                    [cu.t], [yc], marker=marker, s=24 if big else 12, c=color, linewidths=1.0, zorder=5
                )
            else:
                ax.scatter(
                    [cu.t],
                    [yc],
                    marker=marker,
                    s=24 if big else 12,
                    facecolors=color if filled else "white",
                    edgecolors=color,
                    linewidths=0.8,
                    zorder=5,
                )
            catchup_seen[name] = Line2D(
                [], [], marker=marker, color=color, markerfacecolor=color if filled else "white", ls="", ms=5
            )
        if big:
            rounds = f", {mv.rounds} catch-up{'s' if mv.rounds != 1 else ''}" if mv.rounds else ""
            text = {"done": "moved", "aborted": "move aborted"}.get(mv.outcome, "moving")
            text += f" to node {mv.target}{rounds}" if mv.outcome != "aborted" else ""
            label(("rank", mv.rank), mv.end + pad, yy, text, box=True, size=fs - 0.5, color="#333333")

    # waits for a spare: the failed rank's row, until the shrink (or the spare) came
    for wt in tl.waits:
        for wr in wt.ranks:
            if ("rank", wr) not in y:
                continue
            yy = y[("rank", wr)]
            ax.broken_barh(
                [(wt.start, max(wt.seconds, 0.0))],
                (yy - 0.22, 0.44),
                facecolors="white",
                edgecolors=WAIT_COLOR,
                hatch="...",
                linewidth=0.6,
                zorder=2,
            )
            if big:
                label(
                    ("rank", wr),
                    (wt.start + wt.end) / 2,
                    yy,
                    "waits for a spare",
                    ha="center",
                    color=WAIT_COLOR,
                    box=True,
                    size=fs - 0.5,
                    inside=(wt.start, wt.end),
                )

    # ranks
    named: set[tuple[int, int]] = set()
    for iv in tl.intervals:
        yy = y[("rank", iv.rank)]
        color = ncolor(iv.node)
        if iv.phase == "start":
            ax.broken_barh(
                [(iv.start, iv.seconds)],
                (yy - 0.22, 0.44),
                facecolors="white",
                edgecolors=color,
                hatch="////",
                linewidth=0.6,
                zorder=2,
            )
            continue
        ax.broken_barh(
            [(iv.start, max(iv.seconds, 0.0))],
            (yy - 0.3, 0.6),
            facecolors=color,
            edgecolors="#555555",
            linewidth=0.4,
            zorder=2,
        )
        # the spawn id once per process and row (the first bar it fits in): a new id is a new process
        if iv.spawn_id is not None and big and (iv.rank, iv.spawn_id) not in named:
            mid = (iv.start + iv.end) / 2
            text = f"s{iv.spawn_id}"
            if label(
                ("rank", iv.rank), mid, yy, text, ha="center", color="#333333", inside=(iv.start, iv.end)
            ):
                named.add((iv.rank, iv.spawn_id))
    # recovery row: stages stacked per reconfiguration; the startup before the first generation
    yr = y[("recovery",)]
    extra: dict[str, str] = {}
    stages_seen: dict[str, str] = {}

    def draw_stages(stages: Sequence[StageSpan], *, alpha: float = 1.0, hatch: str | None = None) -> None:
        for s in stages:
            if s.seconds <= 0:
                continue
            c = _stage_color(s.stage, extra)
            stages_seen.setdefault(s.stage, c)
            ax.broken_barh(
                [(s.start, s.seconds)],
                (yr - 0.32, 0.64),
                facecolors=c,
                edgecolors=c,
                linewidth=0.3,
                alpha=alpha,
                hatch=hatch,
                zorder=3,
            )

    first = tl.generations[0] if tl.generations else None
    if first is not None and first.t > 0:
        draw_stages([StageSpan("startup", 0.0, first.t)])
        label(("recovery",), first.t / 2, yr, f"startup {first.t:.1f}s", ha="center", inside=(0.0, first.t))
    covered = {r.generation for r in tl.recoveries if r.generation is not None}
    for g in tl.generations:
        if g.number not in covered:
            draw_stages(g.stages, alpha=0.55)
    groups: dict[object, list[Recovery]] = {}
    for i, r in enumerate(tl.recoveries):
        groups.setdefault(r.generation if r.generation is not None else ("r", i), []).append(r)
    for rs in groups.values():
        lead = min(rs, key=lambda r: r.start)
        draw_stages(lead.stages)
        mttrs = [r.mttr_s for r in rs if r.mttr_s is not None]
        if lead.complete:
            text = f"MTTR {_fmt_s(max(mttrs))}" if mttrs else "recovered"
        else:  # what the log does not show: still recovering, or never will (the job failed)
            seen = max((s.end for s in lead.stages), default=lead.start)
            if lead.end > seen:
                ax.broken_barh(
                    [(seen, lead.end - seen)],
                    (yr - 0.32, 0.64),
                    facecolors="white",
                    edgecolors="#d62728",
                    hatch="xxx",
                    linewidth=0.6,
                    zorder=3,
                )
            text = _unfinished_text(tl, lead.end)
        text += f" x{len(rs)}" if len(rs) > 1 else ""
        if big:
            label(("recovery",), lead.end + pad, yr, text, color="#333333")

    # nodes
    for s in tl.node_spans:
        yy = y[("node", s.node)]
        c = ncolor(s.node)
        if s.state == "up":
            ax.broken_barh(
                [(s.start, s.seconds)],
                (yy - 0.18, 0.36),
                facecolors=c,
                edgecolors="#777777",
                linewidth=0.4,
                zorder=2,
            )
        else:
            ax.broken_barh(
                [(s.start, s.seconds)],
                (yy - 0.18, 0.36),
                facecolors="white",
                edgecolors=c,
                linestyle="--",
                linewidth=0.8,
                zorder=2,
            )
    node_style = {
        "join": (">", "#2ca02c", 22),
        "rejoin": (">", "#2ca02c", 40),
        "lost": ("X", "#222222", 70),
        "disconnected": ("|", "#d62728", 50),
        "reconnected": ("|", "#2ca02c", 50),
    }
    for m in tl.node_marks:
        if m.node is None or ("node", m.node) not in y:
            continue
        yy = y[("node", m.node)]
        marker, color, size = node_style.get(m.kind, ("o", "#7f7f7f", 20))
        ax.scatter(
            [m.t],
            [yy],
            marker=marker,
            s=size if big else size / 2,
            c=color,
            zorder=5,
            edgecolors="black" if m.kind == "lost" else None,
            linewidths=0.5,
        )
        if m.kind in ("lost", "rejoin") and big:
            text = f"lost: {_shorten(m.detail, 48)}" if m.kind == "lost" and m.detail else m.kind
            label(("node", m.node), m.t + pad, yy, text, box=True)

    # coordinator
    if tl.coordinator_marks:
        yy = y[("coordinator",)]
        for m in tl.coordinator_marks:
            resumed = m.kind == "resumed"
            ax.scatter(
                [m.t],
                [yy],
                marker="*",
                s=110 if resumed else 45,
                c="#d62728" if resumed else "#2ca02c",
                edgecolors="black",
                linewidths=0.4,
                zorder=5,
            )
            if big:
                text = f"restarted, resumed {m.detail}" if resumed else "leads"
                label(("coordinator",), m.t + pad, yy, text, box=True)

    # tiers
    tier_seen: dict[str, Any] = {}
    if tl.tier_marks:
        yy = y[("tiers",)]
        rep = [m.t for m in tl.tier_marks if m.kind == "replicated"]
        if rep:
            ax.vlines(rep, yy - 0.25, yy + 0.25, colors="#4e79a7", linewidth=0.8, zorder=3)
            tier_seen["replicated (memory)"] = Line2D([], [], color="#4e79a7", marker="|", ls="", ms=8)
        styles = {
            "persist": ("D", "#2b8a3e", 36, "persisted (durable)"),
            "persist_failed": ("x", "#d62728", 40, "persist failed"),
            "replication_failed": ("x", "#ff7f0e", 30, "replication failed"),
            "restore_durable": ("P", "#6a3d9a", 90, "restored from durable"),
            "durable_failed": ("x", "#6a3d9a", 40, "durable restore failed"),
        }
        for m in tl.tier_marks:
            if m.kind not in styles:
                continue
            marker, color, size, name = styles[m.kind]
            ax.scatter(
                [m.t],
                [yy],
                marker=marker,
                s=size if big else size / 2,
                c=color,
                zorder=5,
                edgecolors="black" if marker not in ("x", "|") else None,
                linewidths=0.4,
            )
            tier_seen[name] = Line2D([], [], color=color, marker=marker, ls="", ms=6)
            if big and m.kind in ("persist", "restore_durable") and m.step is not None:
                text = f"restore {m.step}" if m.kind == "restore_durable" else f"step {m.step}"
                label(("tiers",), m.t + pad, yy - 0.02, text, box=True, size=fs - 0.5)
            elif big and m.kind != "persist":
                label(("tiers",), m.t + pad, yy, name, box=True, color=color, size=fs - 0.5)
        if big and rep:
            steps = [m.step for m in tl.tier_marks if m.kind == "replicated" and m.step is not None]
            if steps:  # the last replicated step, once
                last = max(m.t for m in tl.tier_marks if m.kind == "replicated")
                label(
                    ("tiers",),
                    last + pad,
                    yy,
                    f"replicated {max(steps)}",
                    box=True,
                    size=fs - 0.5,
                    color="#4e79a7",
                )

    # other events: ticks, the name at the first of each run of one name
    if tl.other:
        yy = y[("other",)]
        ax.vlines([o.t for o in tl.other], yy - 0.22, yy + 0.22, colors="#7f7f7f", linewidth=0.8, zorder=3)
        prev = None
        for o in tl.other:
            if o.event != prev and big:
                text = (
                    o.event
                    + (f" r{o.rank}" if o.rank is not None else "")
                    + (f" {o.stage}" if o.stage else "")
                )
                label(("other",), o.t + pad, yy, text, size=fs - 0.5, color="#555555")
            prev = o.event

    # axes
    ax.set_ylim(n_rows - 0.5, -0.8 - lane)
    ax.set_yticks(range(n_rows), [name for _, name in rows], fontsize=8 if n_rows <= 40 else 6)
    ax.set_xlim(x_lo, x_hi)
    if span > 180:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v // 60)}:{int(v % 60):02d}"))
        ax.set_xlabel("time since job start (m:ss)")
    else:
        ax.set_xlabel("seconds since job start")
    ax.grid(axis="x", color="#eeeeee", lw=0.6, zorder=0)
    ax.set_axisbelow(True)
    for sp in ("top", "right"):
        ax.spines[sp].set_visible(False)
    if n_ranks:  # a faint separator under the rank rows
        ax.axhline(n_ranks - 0.5, color="#bbbbbb", lw=0.6)

    handles: list[Any] = []
    for n in tl.nodes[:12]:
        handles.append(Patch(facecolor=ncolor(n), edgecolor="#555555", linewidth=0.4, label=f"node {n}"))
    if len(tl.nodes) > 12:
        handles.append(Patch(facecolor="#cccccc", label=f"+{len(tl.nodes) - 12} nodes"))
    if any(i.phase == "start" for i in tl.intervals):
        handles.append(Patch(facecolor="white", edgecolor="#777777", hatch="////", label="process starting"))
    for kind, (marker, color) in kinds_seen.items():
        handles.append(
            Line2D(
                [],
                [],
                marker=marker,
                color=color,
                markeredgecolor="black",
                ls="",
                ms=7,
                label=f"{kind} failure",
            )
        )
    for stage, color in sorted(stages_seen.items(), key=lambda kv: _stage_rank(kv[0])):
        handles.append(Patch(facecolor=color, label=stage))
    if tl.waits:
        handles.append(
            Patch(facecolor="white", edgecolor=WAIT_COLOR, hatch="...", label="waiting for a spare")
        )
    for stage, color in moves_seen.items():
        handles.append(Patch(facecolor=color, label=MOVE_STAGE_NAMES[stage]))
    for name, h in (*resize_seen.items(), *catchup_seen.items(), *tier_seen.items()):
        h.set_label(name)
        handles.append(h)
    if handles:
        height_in = (n_rows + lane) * row_h + 0.2
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.45 / height_in - 0.02),
            ncol=min(len(handles), 9),
            fontsize=7.5,
            frameon=False,
            handlelength=1.6,
            columnspacing=1.2,
        )
    if not tl.events:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center", color="#777777")
    return save_figure(fig, out, _title(tl))


def _stage_rank(stage: str) -> int:
    order = ("startup", *STAGE_ORDER)
    return order.index(stage) if stage in order else len(order)
