"""The timeline as a trace: Chrome's Trace Event Format, which ui.perfetto.dev and chrome://tracing
open (the JSON torch.profiler writes).

:func:`timeline_trace` turns a :class:`~nonstop.timeline.model.Timeline` into the trace's JSON
object, :func:`write_trace` writes it, :func:`check_trace` says what in a trace breaks the format's
rules (the tests' and anyone's check of a file before a viewer sees it).

What the picture shows, as tracks:

* one **process per node** (``node 0``, ``node 1``, ...; ``ranks (node unknown)`` for what the
  log places on no node): an ``agent`` thread (the node up or disconnected, joins, losses) and
  one thread per rank played there (``rank 1``: a slice per period a process trains as that rank,
  ``train g2``, or starts, ``start``; an instant per failure, named by its kind). A rank moved to
  another node continues on that node's track.
* a **job** process: ``recovery`` (a slice per recovery, MTTR long, with its stages nested),
  ``generations`` (an instant ``gN`` per membership and its stage events nested in a ``gN``
  slice), ``moves`` (migrations with ``prepare``/``swap`` and their catch-up rounds, shrinks,
  grows, waits for a spare), ``tiers`` (replicated, persisted, durable restores),
  ``coordinator`` (a restarted coordinator), ``other events``; counters ``world size``,
  ``failures`` (cumulative), ``lost steps`` (cumulative), ``durable step``, ``replicated step``.

Slices that would overlap without nesting on one track (several recoveries repaired by one
generation share their stages) are laid on extra lanes: ``recovery (2)``, ``rank 1 (2)``.

Times: ``ts`` and ``dur`` in whole microseconds since the earliest event of the log (the
timeline's ``begin``; ``otherData.t0_unix`` is the job's start as unix time, ``ts_origin_s`` where
``ts`` 0 lies relative to it). Events are in time order; within a time a longer slice comes first,
so a parent precedes the slices nested in it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.timeline.model import StageSpan, Timeline

__all__ = ["check_trace", "timeline_trace", "tracks", "write_trace"]

JOB_PID = 0
# the job process's tracks, in display order
JOB_TRACKS = ("recovery", "generations", "moves", "tiers", "coordinator", "other events")


def _us(t: float, origin: float) -> int:
    return round((t - origin) * 1_000_000)


@dataclass
class _Lane:
    tid: int
    busy_until: int = -1


@dataclass
class _Builder:
    """The trace's events and the tracks they use (pid -> name, (pid, tid) -> name)."""

    origin: float
    events: list[tuple[int, int, int, dict[str, Any]]] = field(default_factory=list)  # ts, -dur, seq
    processes: dict[int, str] = field(default_factory=dict)
    threads: dict[tuple[int, int], str] = field(default_factory=dict)
    lanes: dict[tuple[int, str], list[_Lane]] = field(default_factory=dict)
    next_tid: dict[int, int] = field(default_factory=dict)

    def process(self, pid: int, name: str) -> None:
        self.processes.setdefault(pid, name)

    def lane(self, pid: int, track: str, start: int | None = None, end: int | None = None) -> int:
        """The tid of a lane of ``track`` in process ``pid`` free from ``start`` (its first lane
        when ``start`` is None: instants); the lane is then busy until ``end``."""
        lanes = self.lanes.setdefault((pid, track), [])
        chosen = None
        if start is None:
            chosen = lanes[0] if lanes else None
        else:
            chosen = next((x for x in lanes if x.busy_until <= start), None)
        if chosen is None:
            tid = self.next_tid.get(pid, 1)
            self.next_tid[pid] = tid + 1
            chosen = _Lane(tid)
            lanes.append(chosen)
            self.threads[(pid, tid)] = track if len(lanes) == 1 else f"{track} ({len(lanes)})"
        if end is not None:
            chosen.busy_until = max(chosen.busy_until, end)
        return chosen.tid

    def add(self, ev: dict[str, Any]) -> None:
        self.events.append((ev["ts"], -ev.get("dur", 0), len(self.events), ev))

    def slice(
        self,
        pid: int,
        track: str,
        name: str,
        start: float,
        end: float,
        *,
        cat: str,
        args: Mapping[str, Any] | None = None,
        children: Sequence[StageSpan] = (),
        child_cat: str = "stage",
    ) -> int:
        """A complete event (``ph`` X) on a free lane of ``track``, with ``children`` nested in it
        (clamped into it and laid one after another; an empty one left out); returns the lane's tid."""
        ts, stop = _us(start, self.origin), _us(end, self.origin)
        stop = max(stop, ts)
        tid = self.lane(pid, track, ts, stop)
        self.add(_x(name, cat, pid, tid, ts, stop - ts, args))
        at = ts
        for c in children:
            cs = min(max(_us(c.start, self.origin), at), stop)
            ce = min(max(_us(c.end, self.origin), cs), stop)
            if ce == cs:
                continue  # an empty stage would look nested in the next one (the parent's args list it)
            self.add(_x(c.stage, child_cat, pid, tid, cs, ce - cs, {"seconds": round(c.seconds, 6)}))
            at = ce
        return tid

    def instant(
        self,
        pid: int,
        tid: int,
        name: str,
        t: float,
        *,
        cat: str,
        scope: str = "t",
        args: Mapping[str, Any] | None = None,
    ) -> None:
        ev: dict[str, Any] = {"name": name, "cat": cat, "ph": "i", "s": scope}
        ev.update(pid=pid, tid=tid, ts=_us(t, self.origin))
        if args:
            ev["args"] = _clean(args)
        self.add(ev)

    def counter(self, name: str, t: float, value: float) -> None:
        self.add(
            {
                "name": name,
                "ph": "C",
                "pid": JOB_PID,
                "tid": 0,
                "ts": _us(t, self.origin),
                "args": {"value": value},
            }
        )

    def metadata(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for pid, name in sorted(self.processes.items()):
            out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
            out.append(
                {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
            )
        for (pid, tid), name in sorted(self.threads.items()):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            out.append(
                {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
            )
        return out

    def trace_events(self) -> list[dict[str, Any]]:
        return [*self.metadata(), *(ev for *_, ev in sorted(self.events, key=lambda x: x[:3]))]


def _clean(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` without None values, JSON-safe (anything else as its text)."""
    return {
        k: v if isinstance(v, str | int | float | bool | list | dict) else str(v)
        for k, v in args.items()
        if v is not None
    }


def _x(
    name: str, cat: str, pid: int, tid: int, ts: int, dur: int, args: Mapping[str, Any] | None
) -> dict[str, Any]:
    ev: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur}
    if args:
        ev["args"] = _clean(args)
    return ev


def timeline_trace(tl: Timeline) -> dict[str, Any]:
    """The trace of ``tl``: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``
    (see the module docstring for its tracks). Pure; never raises on a Timeline that
    :func:`~nonstop.timeline.loading.build_timeline` built."""
    b = _Builder(origin=tl.begin)
    b.process(JOB_PID, f"job {tl.job_id}" if tl.job_id else "job")
    for name in JOB_TRACKS:  # the job's tracks exist (and keep their order) even when empty
        b.lane(JOB_PID, name)
    node_pid = {n: i + 1 for i, n in enumerate(tl.nodes)}
    unknown_pid = len(tl.nodes) + 1

    def pid_of(node: str | None) -> int:
        pid = node_pid.get(node, unknown_pid) if node is not None else unknown_pid
        b.process(pid, f"node {node}" if pid != unknown_pid else "ranks (node unknown)")
        return pid

    for n in tl.nodes:
        pid_of(n)
        b.lane(node_pid[n], "agent")
    _ranks(b, tl, pid_of)
    _nodes(b, tl, pid_of)
    _recoveries(b, tl)
    _generations(b, tl)
    _moves(b, tl)
    _marks(b, tl)
    return {
        "traceEvents": b.trace_events(),
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "nonstop timeline",
            "job_id": tl.job_id or "",
            "t0_unix": tl.t0,
            "ts_origin_s": tl.begin,
            "outcome": tl.outcome or "",
        },
    }


def _ranks(b: _Builder, tl: Timeline, pid_of: Any) -> None:
    for i in tl.intervals:
        name = f"train g{i.generation}" if i.phase == "train" else i.phase
        args: dict[str, Any] = {
            "rank": i.rank,
            "spawn_id": i.spawn_id,
            "node": i.node,
            "generation": i.generation,
            "end_reason": i.end_reason,
        }
        b.slice(pid_of(i.node), f"rank {i.rank}", name, i.start, i.end, cat="rank", args=args)
    for n, f in enumerate(sorted(tl.failures, key=lambda f: f.detected), 1):
        pid = pid_of(f.node)
        tid = b.lane(pid, f"rank {f.rank}" if f.rank is not None else "agent")
        args = {
            "rank": f.rank,
            "step": f.step,
            "spawn_id": f.spawn_id,
            "detected_s": round(f.detected, 6),
            "detail": f.detail,
        }
        b.instant(pid, tid, f"{f.kind} rank {f.rank}", f.t, cat="failure", args=args)
        b.counter("failures", f.detected, n)


def _nodes(b: _Builder, tl: Timeline, pid_of: Any) -> None:
    for s in tl.node_spans:
        pid = pid_of(s.node)
        b.slice(pid, "agent", s.state, s.start, s.end, cat="node", args={"end_reason": s.end_reason})
    for m in tl.node_marks:
        pid = pid_of(m.node)
        b.instant(pid, b.lane(pid, "agent"), m.kind, m.t, cat="node", args={"detail": m.detail or None})


def _recoveries(b: _Builder, tl: Timeline) -> None:
    lost = 0
    for r in tl.recoveries:
        args: dict[str, Any] = {
            "rank": r.rank,
            "step": r.step,
            "generation": r.generation,
            "mttr_s": r.mttr_s,
            "training_again_s": r.training_again_s,
            "lost_steps": r.lost_steps,
            "restore_step": r.restore_step,
            "replacement": r.replacement,
            "tier": r.tier,
            "complete": r.complete,
            "detail": r.detail or None,
            "stages": {k: round(v, 6) for k, v in r.stage_seconds.items()},
        }
        name = f"recover {r.kind} rank {r.rank}" + ("" if r.complete else " (unfinished)")
        b.slice(JOB_PID, "recovery", name, r.start, r.end, cat="recovery", args=args, children=r.stages)
    seen: set[object] = set()
    for i, r in enumerate(sorted(tl.recoveries, key=lambda r: r.end)):
        key = r.generation if r.generation is not None else ("r", i)
        if r.lost_steps is not None and key not in seen:  # one reconfiguration's lost steps once
            seen.add(key)
            lost += r.lost_steps
            b.counter("lost steps", r.end, lost)


def _generations(b: _Builder, tl: Timeline) -> None:
    for g in tl.generations:
        args: dict[str, Any] = {
            "cause": list(g.cause),
            "tier": g.tier,
            "restore_step": g.restore_step,
            "world_size": len(g.members),
            "members": {str(k): v for k, v in g.members.items()},
        }
        b.instant(JOB_PID, b.lane(JOB_PID, "generations"), f"g{g.number}", g.t, cat="generation", args=args)
        if g.members:
            b.counter("world size", g.t, len(g.members))
        if g.stages:
            stages = sorted(g.stages, key=lambda s: s.start)
            start, end = min(stages[0].start, g.t), max(s.end for s in stages)
            b.slice(JOB_PID, "generations", f"g{g.number}", start, end, cat="generation", children=stages)
    for z in tl.resizes:
        if z.resized and z.world_size is not None:
            b.counter("world size", z.t, z.world_size)


def _moves(b: _Builder, tl: Timeline) -> None:
    for m in tl.migrations:
        args: dict[str, Any] = {
            "rank": m.rank,
            "source": m.source,
            "target": m.target,
            "reason": m.reason or None,
            "boundary": m.boundary,
            "outcome": m.outcome,
            "catchup_rounds": m.rounds,
            "pause_ratio": m.pause_ratio,
            "error": m.error or None,
        }
        name = f"migrate rank {m.rank} {m.source}→{m.target}"
        tid = b.slice(JOB_PID, "moves", name, m.start, m.end, cat="migration", args=args, children=m.stages)
        for c in m.catchups:
            cargs = {
                "rank": c.rank,
                "step": c.step,
                "raw_bytes": c.raw_bytes,
                "wire_bytes": c.wire_bytes,
                "seconds": c.seconds,
                "error": c.error or None,
            }
            b.instant(JOB_PID, tid, f"catch-up {c.kind}", c.t, cat="migration", args=cargs)
    for z in tl.resizes:
        args = {
            "old_world_size": z.old_world_size,
            "world_size": z.world_size,
            "outcome": z.outcome,
            "reason": z.reason or None,
            "dropped": list(z.dropped),
            "boundary": z.boundary,
            "error": z.error or None,
        }
        b.slice(JOB_PID, "moves", z.label, z.start, z.end, cat=z.kind, args=args, children=z.stages)
    for w in tl.waits:
        args = {"ranks": list(w.ranks), "wait_s": w.wait_s, "outcome": w.outcome}
        name = f"wait for a spare: ranks {', '.join(map(str, w.ranks))}"
        b.slice(JOB_PID, "moves", name, w.start, w.end, cat="wait", args=args)


def _marks(b: _Builder, tl: Timeline) -> None:
    tiers = b.lane(JOB_PID, "tiers")
    for m in tl.tier_marks:
        name = m.kind if m.step is None else f"{m.kind} {m.step}"
        b.instant(
            JOB_PID,
            tiers,
            name,
            m.t,
            cat="tier",
            args={"node": m.node, "step": m.step, "detail": m.detail or None},
        )
        if m.step is not None and m.kind in ("persist", "replicated"):
            b.counter("durable step" if m.kind == "persist" else "replicated step", m.t, m.step)
    coord = b.lane(JOB_PID, "coordinator")
    for m in tl.coordinator_marks:
        b.instant(JOB_PID, coord, m.kind, m.t, cat="coordinator", args={"detail": m.detail or None})
    other = b.lane(JOB_PID, "other events")
    for o in tl.other:
        b.instant(JOB_PID, other, o.event, o.t, cat="other", args=dict(o.fields))
    gens = b.lane(JOB_PID, "generations")
    if tl.finished_at is not None:
        b.instant(JOB_PID, gens, "finish", tl.finished_at, cat="job", scope="g")
    if tl.failed_at is not None:
        b.instant(JOB_PID, gens, "job failed", tl.failed_at, cat="job", scope="g", args={"error": tl.error})


def write_trace(tl: Timeline, out: Path) -> Path:
    """Write :func:`timeline_trace` of ``tl`` to ``out`` (JSON; parent dirs created); return ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(timeline_trace(tl), separators=(",", ":"), default=str), encoding="utf-8")
    return out


# -- checking ------------------------------------------------------------------------------------------
PHASES = {"X", "i", "I", "C", "M", "B", "E"}


def check_trace(trace: Mapping[str, Any]) -> list[str]:
    """What in ``trace`` (a JSON object) breaks the Trace Event Format's rules, as one line each
    (empty: none): ``traceEvents`` a list of objects with ``name``, ``ph``, ``pid``, ``tid``, and
    ``ts`` (a number; not needed by metadata ``M``); ``dur`` >= 0 on ``X``; an instant's scope
    ``s`` in g/p/t; a counter's ``args`` numbers; ``ts`` never going back on one track
    (pid, tid; a counter: pid and name); slices on one track nested or disjoint, never crossing."""
    problems: list[str] = []
    evs = trace.get("traceEvents") if isinstance(trace, Mapping) else None
    if not isinstance(evs, list):
        return ["no 'traceEvents' list"]
    last: dict[object, float] = {}
    open_: dict[object, list[float]] = {}  # track -> ends of the slices open on it
    for n, e in enumerate(evs):
        where = f"event {n}"
        if not isinstance(e, Mapping):
            problems.append(f"{where} is not an object")
            continue
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in e]
        ph = e.get("ph")
        if ph != "M" and not _is_num(e.get("ts")):
            missing.append("ts")
        if missing:
            problems.append(f"{where} lacks {', '.join(missing)}")
            continue
        if ph not in PHASES:
            problems.append(f"{where} has an unknown phase {ph!r}")
            continue
        if ph == "M":
            continue
        ts = float(e["ts"])  # checked above
        track: object = (e["pid"], "C", e["name"]) if ph == "C" else (e["pid"], e["tid"])
        if ts < last.get(track, float("-inf")):
            problems.append(f"{where} ({e['name']}) goes back in time on track {track}")
        last[track] = ts
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, int | float) or isinstance(dur, bool) or dur < 0:
                problems.append(f"{where} ({e['name']}) has no duration >= 0")
                continue
            stack = open_.setdefault(track, [])
            while stack and stack[-1] <= ts:
                stack.pop()
            if stack and ts + dur > stack[-1]:
                problems.append(f"{where} ({e['name']}) crosses the end of the slice it starts in")
            stack.append(ts + dur)
        elif ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where} ({e['name']}) has an unknown scope {e.get('s')!r}")
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, Mapping) or not args or not all(_is_num(v) for v in args.values()):
                problems.append(f"{where} ({e['name']}) is a counter without numeric args")
    return problems


def _is_num(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def tracks(trace: Mapping[str, Any]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> thread name, from the trace's metadata."""
    evs: Iterable[Mapping[str, Any]] = trace.get("traceEvents", [])
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in evs
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
