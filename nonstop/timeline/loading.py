"""From a job's event log to the :class:`~nonstop.timeline.model.Timeline`.

* :func:`load_events` reads and checks a log (a file, or a job dir that holds one); a missing,
  unreadable or non-event file is a :class:`~nonstop.errors.UsageError`.
* :func:`build_timeline` decodes the lines into typed events (:func:`nonstop.events.decode`)
  and reads them in time order: ranks (:mod:`.ranks`), failures and recoveries, generations and
  their stages, nodes, the coordinator, the tiers, waits and shrinks (:mod:`.shrinks`), migrations
  and grows (:mod:`.swaps`), and every event with no row of its own.

All times are **seconds since the job started** (the first ``job_start`` event, or the first event
when there is none). Logs of jobs that are still running or were killed mid-way (no ``job_end``, a
recovery that never finished, a torn last line) are valid input: what is open at the end of the log
ends at the last event. A log's header line (its format's version) is not an event of the job.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop import events as ev
from nonstop.errors import UsageError
from nonstop.events.log import read_events
from nonstop.timeline.model import (
    STAGE_ORDER,
    FailureMark,
    Generation,
    Mark,
    NodeSpan,
    OtherEvent,
    Recovery,
    StageSpan,
    Timeline,
)
from nonstop.timeline.ranks import RankBuilder
from nonstop.timeline.shrinks import Shrinks
from nonstop.timeline.swaps import GROW_EVENTS, MIGRATION_EVENTS, Grows, Migrations

__all__ = ["EVENTS_FILE", "build_timeline", "load_events", "load_timeline"]

EVENTS_FILE = "events.jsonl"
# Events shown only through what follows them (no row, no "other events" tick).
SILENT = (ev.JobStart, ev.Spawned, ev.Connect, ev.ProcessExited, ev.HangDetected)
TIER_MARKS: dict[type[ev.Event], str] = {
    ev.Replicated: "replicated",
    ev.ReplicationFailed: "replication_failed",
    ev.Persist: "persist",
    ev.PersistFailed: "persist_failed",
    ev.RestoreFromDurable: "restore_durable",
    ev.DurableInstallFailed: "durable_failed",
    ev.DurableUnavailable: "durable_failed",
}


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


def _is_time(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _checked(events: list[Any], p: Path) -> list[dict[str, Any]]:
    for n, e in enumerate(events, 1):
        ts = e.get("ts") if isinstance(e, dict) else None
        if not (isinstance(e, dict) and isinstance(e.get("event"), str) and _is_time(ts)):
            raise UsageError(f"{p} is not a nonstop event log (entry {n} has no 'ts' and 'event')")
    return events


def load_timeline(path: Path) -> Timeline:
    """:func:`build_timeline` of :func:`load_events` ``(path)`` (same errors)."""
    return build_timeline(load_events(path))


# -- building -----------------------------------------------------------------------------------------
Stamped = tuple[float, ev.Event]  # an event and its unix time


def _decoded(events: Iterable[Mapping[str, Any] | ev.Event]) -> list[Stamped]:
    """The job's events (not the log's header) with a time, sorted by it (stably)."""
    out = []
    for x in events:
        e = x if isinstance(x, ev.Event) else ev.decode(x)
        if e.ts is not None and not isinstance(e, ev.LogHeader):
            out.append((e.ts, e))
    return sorted(out, key=lambda p: p[0])


def _last_job(evs: list[Stamped]) -> tuple[list[Stamped], int]:
    """The events of the last job in a log (sorted by time) and how many jobs came before it.

    A job begins at its first ``job_start`` (a restarted coordinator logs another one with the same
    ``job_id``). Events logged between the previous job's ``job_end`` and that ``job_start`` belong
    to it; when the previous job has no ``job_end`` (killed), its first ``job_start`` is the cut.
    """
    starts = {i: e.job_id for i, (_, e) in enumerate(evs) if isinstance(e, ev.JobStart)}
    if not starts:
        return evs, 0
    last_id = starts[max(starts)]
    first = next(i for i, job in starts.items() if job == last_id)
    before = [i for i in starts if i < first]
    if not before:
        return evs, 0
    ends = [i for i in range(before[-1], first) if isinstance(evs[i][1], ev.JobEnd)]
    cut = ends[-1] + 1 if ends else first
    return evs[cut:], len({starts[i] for i in before})


def _stage_spans(stages: Mapping[str, float], start: float) -> tuple[StageSpan, ...]:
    keys = [s for s in STAGE_ORDER if s in stages] + [s for s in stages if s not in STAGE_ORDER]
    out, t = [], start
    for k in keys:
        sec = max(stages[k], 0.0)
        out.append(StageSpan(k, t, t + sec))
        t += sec
    return tuple(out)


def _node_key(name: str) -> tuple[int, int, str]:
    """Nodes in natural order: "2" before "10", numbers before names."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


@dataclass
class _Gen:
    """A ``generation`` event as read: its number (the event's, else the next) and membership."""

    number: int
    t: float
    e: ev.NewGeneration
    members: dict[int, int]
    nodes: dict[int, str]


@dataclass
class _Reader:
    """What the events read so far say; :meth:`timeline` closes what is open at the log's end."""

    ranks: RankBuilder = field(default_factory=RankBuilder)
    node_order: list[str] = field(default_factory=list)
    failures: list[FailureMark] = field(default_factory=list)
    pending: list[FailureMark] = field(default_factory=list)  # failures without their recovery yet
    recoveries: list[Recovery] = field(default_factory=list)
    gens: list[_Gen] = field(default_factory=list)
    stage_spans: dict[int, list[StageSpan]] = field(default_factory=dict)
    training_start: dict[int, float] = field(default_factory=dict)
    node_state: dict[str, tuple[str, float]] = field(default_factory=dict)  # node -> (state, since)
    node_spans: list[NodeSpan] = field(default_factory=list)
    node_marks: list[Mark] = field(default_factory=list)
    coord_marks: list[Mark] = field(default_factory=list)
    tier_marks: list[Mark] = field(default_factory=list)
    shrinks: Shrinks = field(default_factory=Shrinks)
    grows: Grows = field(default_factory=Grows)
    moves: Migrations = field(default_factory=Migrations)
    other: list[OtherEvent] = field(default_factory=list)
    injected: dict[tuple[int | None, int | None], float] = field(default_factory=dict)  # -> fault time
    outcome: str | None = None
    error: str | None = None
    finished_at: float | None = None
    failed_at: float | None = None
    resumed_at: list[float] = field(default_factory=list)  # ends of 'resume': trains fully again

    def see_node(self, node: str | None) -> str | None:
        if node is not None and node not in self.node_order:
            self.node_order.append(node)
        return node

    def node_to(self, node: str, state: str | None, t: float, reason: str) -> None:
        cur = self.node_state.pop(node, None)
        if cur is not None:
            self.node_spans.append(NodeSpan(node, cur[1], max(t, cur[1]), cur[0], reason))
        if state is not None:
            self.node_state[node] = (state, t)

    def event(self, e: ev.Event, t: float) -> None:
        if isinstance(e, SILENT):
            return
        if isinstance(
            e, ev.NodesJoined | ev.NodeJoin | ev.NodeLost | ev.NodeDisconnected | ev.NodeReconnected
        ):
            self.node(e, t)
        elif isinstance(e, ev.CoordinatorLeads):
            self.coord_marks.append(Mark(t, "leads", detail=e.address))
        elif isinstance(e, ev.CoordinatorResumed):
            detail = f"g{e.generation}" if e.generation is not None else e.address
            self.coord_marks.append(Mark(t, "resumed", detail=detail))
        elif isinstance(e, ev.Spawn):
            node = self.see_node(e.node)
            if e.spawn_id is not None and e.rank is not None and e.role == "worker":
                self.ranks.spawned(e.spawn_id, e.rank, node, t)
        elif isinstance(e, ev.SpareTakesOver):
            if e.rank is not None and e.spawn_id is not None:
                self.ranks.takes_over(e.rank, e.spawn_id)
        elif isinstance(e, ev.NewGeneration):
            self.generation(e, t)
        elif isinstance(e, ev.ReconfigurationStage):
            self.stage(e, t)
        elif isinstance(e, ev.FaultInjected):
            self.injected[(e.rank, e.spawn_id)] = t
        elif isinstance(e, ev.Failure):
            self.failure(e, t)
        elif isinstance(e, ev.Recovery):
            self.recovery(e, t)
        elif type(e) in TIER_MARKS:
            self.tier(e, t)
        elif isinstance(e, ev.Finish | ev.JobDone | ev.JobFailed | ev.JobEnd):
            self.job(e, t)
        elif isinstance(e, ev.ElasticWait | ev.Shrink):
            self.shrinks.event(e, t)
        elif isinstance(e, GROW_EVENTS):
            self.grows.event(e, t)
        elif not (isinstance(e, MIGRATION_EVENTS) and self.moves.event(e, t)):
            fields = e.fields()  # unknown, or a catch-up outside any migration: an "other event"
            rank, stage = ev.as_int(fields.get("rank")), ev.as_str(fields.get("stage"))
            self.other.append(OtherEvent(t, e.event, rank, stage, fields))

    def node(
        self,
        e: ev.NodesJoined | ev.NodeJoin | ev.NodeLost | ev.NodeDisconnected | ev.NodeReconnected,
        t: float,
    ) -> None:
        if isinstance(e, ev.NodesJoined):
            for n in e.nodes:
                self.see_node(n)
            return
        node = self.see_node(e.node)
        if node is None:
            return
        if isinstance(e, ev.NodeJoin):
            rejoin = e.rejoin or node in self.node_state or any(s.node == node for s in self.node_spans)
            self.node_to(node, "up", t, "rejoin")
            self.node_marks.append(Mark(t, "rejoin" if rejoin else "join", node))
        elif isinstance(e, ev.NodeLost):
            self.node_to(node, None, t, "lost")
            reason = e.reason
            if e.quarantined:
                reason = f"{reason} (quarantined)" if reason else "quarantined"
            self.node_marks.append(Mark(t, "lost", node, detail=reason))
        else:
            down = isinstance(e, ev.NodeDisconnected)
            self.node_to(node, "disconnected" if down else "up", t, "disconnected" if down else "reconnected")
            self.node_marks.append(Mark(t, "disconnected" if down else "reconnected", node))

    def generation(self, e: ev.NewGeneration, t: float) -> None:
        b = self.ranks
        g = e.generation or b.generation + 1
        # a new membership without a failure (or before its failure event): training stops
        for rank in sorted(b.open):
            b.close(rank, t, "recovery")
        b.generation = g
        members, nodes = e.members_by_rank, e.nodes_by_rank
        for n in nodes.values():
            self.see_node(n)
        b.members, b.rank_node = dict(members), dict(nodes)
        self.shrinks.decided(t, "replaced")  # a wait a shrink did not end: spares took its ranks
        self.gens.append(_Gen(g, t, e, members, nodes))

    def stage(self, e: ev.ReconfigurationStage, t: float) -> None:
        b = self.ranks
        g = e.generation or b.generation
        sec = max(e.seconds or 0.0, 0.0)
        self.stage_spans.setdefault(g, []).append(StageSpan(e.stage, t - sec, t))
        if e.stage == "rebuild" and g == b.generation:
            self.training_start.setdefault(g, t)
            b.train(t)
        elif e.stage == "resume":
            if g == b.generation and g not in self.training_start:  # no rebuild stage seen
                self.training_start[g] = t - sec
                b.train(t - sec)
            self.resumed_at.append(t)

    def failure(self, e: ev.Failure, t: float) -> None:
        b = self.ranks
        rank, sid, kind = e.rank, e.spawn_id, e.failure_kind or "?"
        fault_t = t - e.detect_s if e.detect_s is not None else self.injected.get((rank, sid), t)
        fault_t = min(fault_t, t)
        node = b.rank_node.get(rank) if rank is not None else None
        if sid is not None and sid in b.spawned_for and node is None:
            node = b.spawned_for[sid][1]
        f = FailureMark(
            t=fault_t, detected=t, kind=kind, rank=rank, step=e.step, spawn_id=sid, node=node, detail=e.detail
        )
        self.failures.append(f)
        self.pending.append(f)
        if rank is not None:
            b.fail(rank, fault_t, t, kind)
            b.died_starting(rank, sid, fault_t, kind)

    def recovery(self, e: ev.Recovery, t: float) -> None:
        total = sum(max(v, 0.0) for v in e.stages.values())
        start = t - (e.mttr_s if e.mttr_s is not None else total)
        kind = e.failure_kind or "?"
        for i, f in enumerate(self.pending):
            if f.rank == e.rank and f.kind == kind:
                del self.pending[i]
                break
        tier = next((x.e.tier for x in self.gens if x.number == e.generation and x.e.tier), None)
        self.recoveries.append(
            Recovery(
                generation=e.generation,
                kind=kind,
                rank=e.rank,
                step=e.step,
                start=start,
                end=t,
                stages=_stage_spans(e.stages, start),
                complete=True,
                mttr_s=e.mttr_s,
                training_again_s=e.training_again_s,
                lost_steps=e.lost_steps,
                restore_step=e.restore_step,
                replacement=e.replacement,
                tier=tier,
                detail=e.detail,
            )
        )

    def tier(self, e: ev.Event, t: float) -> None:
        node = step = None
        detail = ""
        if isinstance(e, ev.ReplicationFailed | ev.PersistFailed | ev.DurableUnavailable):
            detail = e.error or ""
        if isinstance(e, ev.DurableInstallFailed):
            detail = str(e.errors or "")
        if isinstance(e, ev.RestoreFromDurable):
            detail = f"{e.seconds:.2f}s" if e.seconds is not None else ""
        if isinstance(e, ev.ReplicationFailed):
            node = e.node
        if isinstance(
            e,
            ev.Replicated
            | ev.ReplicationFailed
            | ev.Persist
            | ev.RestoreFromDurable
            | ev.DurableInstallFailed,
        ):
            step = e.step
        self.tier_marks.append(Mark(t, TIER_MARKS[type(e)], node, step, detail))

    def job(self, e: ev.Finish | ev.JobDone | ev.JobFailed | ev.JobEnd, t: float) -> None:
        if isinstance(e, ev.Finish):
            self.finished_at = t
            self.ranks.close_all(t, "finish")
        elif isinstance(e, ev.JobDone):
            self.ranks.close_all(t, "finish")
        elif isinstance(e, ev.JobFailed):
            self.failed_at, self.error = t, e.error
            self.ranks.close_all(t, "failed")
        else:
            self.outcome, self.error = e.state, e.error or self.error
            self.ranks.close_all(t, "end")

    def generations(self) -> tuple[Generation, ...]:
        return tuple(
            Generation(
                number=x.number,
                t=x.t,
                cause=tuple(x.e.cause),
                tier=x.e.tier,
                restore_step=x.e.restore_step,
                members=x.members,
                nodes=x.nodes,
                stages=tuple(self.stage_spans.get(x.number, [])),
                training_start=self.training_start.get(x.number),
            )
            for x in self.gens
        )


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


def build_timeline(events: Iterable[Mapping[str, Any] | ev.Event]) -> Timeline:
    """The :class:`Timeline` of an event log (lines as :func:`load_events` returns them, or typed
    events, in any order: they are sorted by ``ts``, stably). Pure: no I/O, no matplotlib.

    Never raises on the content of a well-formed log (missing fields decode to their defaults,
    unknown events become :class:`OtherEvent`); an empty log gives an empty Timeline.
    """
    evs = _decoded(events)
    if not evs:
        return Timeline()
    evs, earlier = _last_job(evs)
    head = next((e for _, e in evs if isinstance(e, ev.JobStart)), None)
    t0 = head.ts if head is not None and head.ts is not None else evs[0][0]
    r = _Reader()
    for ts, e in evs:
        r.event(e, ts - t0)

    end = evs[-1][0] - t0
    r.ranks.close_all(end, "log_end")
    for node in list(r.node_state):
        r.node_to(node, None, end, "log_end")
    generations = r.generations()
    recoveries = list(r.recoveries)
    # failures the log never reports a recovery for: unfinished when nothing trained again after
    # them (a job killed mid-recovery); handled without a record otherwise (died while starting)
    for f in r.pending:
        if not any(x > f.detected for x in r.resumed_at):
            recoveries.append(_unfinished(f, generations, end if r.failed_at is None else r.failed_at))
    shrinks, waits = r.shrinks.finish(end, r.failed_at, generations)
    grows = r.grows.finish(end, r.failed_at, generations)
    world = len(generations[0].members) if generations else 0
    if world == 0 and head is not None and head.nnodes is not None and head.nproc is not None:
        world = head.nnodes * head.nproc
    return Timeline(
        job_id=head.job_id if head is not None else None,
        earlier_jobs=earlier,
        begin=min(evs[0][0] - t0, 0.0),
        t0=t0,
        end=end,
        world_size=world,
        nodes=tuple(sorted(r.node_order, key=_node_key)),
        spares=head.spares if head is not None else None,
        outcome=r.outcome,
        error=r.error,
        events=len(evs),
        intervals=tuple(sorted(r.ranks.intervals, key=lambda i: (i.rank, i.start, i.phase != "start"))),
        failures=tuple(r.failures),
        recoveries=tuple(sorted(recoveries, key=lambda x: x.start)),
        generations=generations,
        node_spans=tuple(r.node_spans),
        node_marks=tuple(r.node_marks),
        coordinator_marks=tuple(r.coord_marks),
        tier_marks=tuple(r.tier_marks),
        migrations=r.moves.finish(end, r.failed_at, generations),
        resizes=tuple(sorted([*shrinks, *grows], key=lambda z: z.start)),
        waits=waits,
        other=tuple(r.other),
        training_start=min(r.training_start.values(), default=None),
        finished_at=r.finished_at,
        failed_at=r.failed_at,
    )
