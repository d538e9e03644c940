"""`nonstop timeline`: the event log as a data model, a text summary and a picture."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from nonstop.errors import UsageError
from nonstop.timeline import (
    STAGE_ORDER,
    Timeline,
    build_timeline,
    load_events,
    load_timeline,
    render_timeline,
    timeline_text,
)
from tests.timeline_fakes import PNG_MAGIC, STAGES, T0, Log, elastic_log


def _ranks(tl: Timeline, rank: int, phase: str = "train") -> list[Any]:
    return [i for i in tl.intervals if i.rank == rank and i.phase == phase]


# -- the model ----------------------------------------------------------------------------------------
def test_intervals_split_at_recoveries() -> None:
    log = Log()
    done = log.fail(10.0, [1])
    tl = build_timeline(log.end(20.0).events)
    assert (tl.job_id, tl.world_size, tl.nodes, tl.outcome) == ("abc123", 3, ("0",), "done")
    start = 5.0 + STAGES["launch"] + STAGES["restore"] + STAGES["rebuild"]  # g1 trains after rebuild
    old, new = _ranks(tl, 1)
    assert (old.spawn_id, old.generation, old.end_reason) == (1, 1, "kill")
    assert (old.start, old.end) == pytest.approx((start, 10.0))  # failed at the fault, not the detection
    assert (new.spawn_id, new.generation, new.end_reason) == (3, 2, "finish")
    assert new.end == pytest.approx(20.0)
    assert new.start == pytest.approx(done - STAGES["resume"])  # trains again when rebuild ends
    a, b = _ranks(tl, 0)  # a survivor: same process, training stops for the recovery
    assert a.spawn_id == b.spawn_id == 0
    assert a.end == pytest.approx(10.1) and a.end_reason == "recovery"  # stopped at the detection
    assert b.start > a.end
    (starting,) = _ranks(tl, 0, "start")  # spawned at 0.03, trains from g1
    assert starting.start == pytest.approx(0.03) and starting.end == pytest.approx(start)
    assert [g.number for g in tl.generations] == [1, 2]
    assert tl.generations[1].cause == (1,) and tl.generations[1].members[1] == 3
    (f,) = tl.failures
    assert (f.kind, f.rank, f.step, f.node) == ("kill", 1, 10, "0") and f.t == pytest.approx(10.0)
    assert f.detected == pytest.approx(10.1)


def test_recovery_stages_are_laid_end_to_end_and_sum_to_mttr() -> None:
    log = Log()
    done = log.fail(10.0, [2], kind="hang", detect=1.0)
    tl = build_timeline(log.end(20.0).events)
    (r,) = tl.recoveries
    assert r.complete and (r.kind, r.rank, r.generation, r.lost_steps) == ("hang", 2, 2, 1)
    assert [s.stage for s in r.stages] == list(STAGE_ORDER)
    assert r.start == pytest.approx(10.0) and r.end == pytest.approx(done)
    assert sum(r.stage_seconds.values()) == pytest.approx(r.mttr_s)
    for a, b in zip(r.stages, r.stages[1:], strict=False):
        assert a.end == pytest.approx(b.start)
    assert r.stage_seconds["detect"] == pytest.approx(1.0)
    assert r.stage_seconds["restore"] == pytest.approx(STAGES["restore"])
    text = timeline_text(tl)
    assert "hang rank 2" in text and "restore 200ms" in text and "MTTR 1.68s" in text
    assert text.splitlines()[0].startswith(
        "job abc123: 3 ranks on 1 node, done after 21.0s; 1 failure (1 hang)"
    )


def test_failures_repaired_together_share_lost_steps_and_a_node_loss_ends_the_node() -> None:
    log = Log(nodes=3, per_node=2)
    log.add(14.9, "node_lost", node="1", reason="lease expired", quarantined=False)
    log.fail(14.9, [2, 3], kind="node", detect=0.0)
    log.add(30.0, "coordinator_resumed", address="x", generation=2, state="running", nodes=[], lost=[])
    log.add(31.0, "replicated", step=40, seconds=0.1)
    log.add(32.0, "persist", step=40, raw_bytes=1, stored_bytes=1, seconds=0.2, full=True)
    log.add(33.0, "restore_from_durable", step=40, url="file:///x", seconds=1.5)
    tl = build_timeline(log.end(40.0).events)
    assert tl.nodes == ("0", "1", "2") and tl.world_size == 6
    assert len(tl.failures) == 2 and {f.node for f in tl.failures} == {"1"}
    assert len(tl.recoveries) == 2 and {r.generation for r in tl.recoveries} == {2}
    assert tl.lost_steps == 1  # one reconfiguration, not one per failure
    for rank in (2, 3):
        old, new = _ranks(tl, rank)
        assert old.end == pytest.approx(14.9) and old.end_reason == "node" and old.node == "1"
        assert new.node != "1"  # replaced by a spare on another node
    spans = {s.node: s for s in tl.node_spans}
    assert spans["1"].end == pytest.approx(14.9) and spans["1"].end_reason == "lost"
    assert spans["0"].end == pytest.approx(41.0)
    (lost,) = [m for m in tl.node_marks if m.kind == "lost"]
    assert (lost.node, lost.detail) == ("1", "lease expired")
    (coord,) = tl.coordinator_marks
    assert (coord.kind, coord.detail) == ("resumed", "g2")
    assert [(m.kind, m.step) for m in tl.tier_marks] == [
        ("replicated", 40),
        ("persist", 40),
        ("restore_durable", 40),
    ]
    text = timeline_text(tl)
    assert "node      1 lost: lease expired" in text and "coordinator restarted, resumed g2" in text
    assert "restored step 40 from the durable tier" in text


def test_unknown_events_are_kept() -> None:
    log = Log()
    log.add(8.0, "migration_requested", rank=1, stage="copy", to_node="1")
    log.add(8.5, "migration_refused", rank=1, stage="switch")
    log.add(8.7, "catchup", rank=2, step=5, ok=True, delta=True)  # no migration of rank 2 is open
    log.add(9.0, "something_new", detail={"x": 1})
    tl = build_timeline(log.end(12.0).events)
    assert [(o.event, o.rank, o.stage) for o in tl.other] == [
        ("migration_requested", 1, "copy"),
        ("migration_refused", 1, "switch"),
        ("catchup", 2, None),
        ("something_new", None, None),
    ]
    assert tl.migrations == ()
    assert tl.other[0].t == pytest.approx(8.0) and tl.other[0].fields["to_node"] == "1"


def test_a_reused_job_dir_shows_its_last_job() -> None:
    first = Log().end(12.0).events
    second = Log()
    second.fail(10.0, [2])
    second.add(15.0, "job_start", job_id="abc123")  # a restarted coordinator: the same job
    second.add(15.1, "coordinator_resumed", generation=2)
    later = [{**e, "ts": e["ts"] + 100.0} for e in second.end(20.0).events]
    for e in later:
        if e["event"] == "job_start":
            e["job_id"] = "def456"
    leads = {"ts": T0 + 99.0, "event": "coordinator_leads", "address": "x"}  # before its job_start
    tl = build_timeline([*first, leads, *later])
    assert (tl.job_id, tl.earlier_jobs) == ("def456", 1) and tl.begin == pytest.approx(-1.0)
    assert len(tl.failures) == 1 and [m.kind for m in tl.coordinator_marks] == ["leads", "resumed"]
    assert tl.end == pytest.approx(21.0) and tl.outcome == "done"
    assert "(the log's last job; 1 earlier)" in timeline_text(tl)
    killed = [e for e in first if e["event"] != "job_end"]  # no job_end: cut at the next job_start
    assert build_timeline([*killed, leads, *later]).begin == 0.0


def test_empty_log() -> None:
    tl = build_timeline([])
    assert tl == Timeline() and tl.ranks == () and tl.lost_steps == 0
    assert timeline_text(tl).startswith("job ?: 0 ranks")


def test_partial_log_of_a_job_killed_mid_recovery() -> None:
    log = Log()
    log.fail(10.0, [1])
    events = log.end(20.0).events
    cut = next(i for i, e in enumerate(events) if e["event"] == "stage" and e["generation"] == 2) + 2
    tl = build_timeline(events[:cut])  # g2 launched and restored, then the log stops
    assert tl.outcome is None and tl.end == pytest.approx(10.1 + 0.01 + 0.02 + 0.2)
    (r,) = tl.recoveries
    assert not r.complete and r.mttr_s is None and r.rank == 1 and r.generation == 2
    assert [s.stage for s in r.stages] == ["detect", "plan", "launch", "restore"]
    assert r.end == pytest.approx(tl.end)
    assert all(i.end <= tl.end for i in tl.intervals)
    assert "| unfinished" in timeline_text(tl) and "no job_end" in timeline_text(tl)
    for n in range(len(events) + 1):  # every prefix of a log is a valid log
        timeline_text(build_timeline(events[:n]))


def test_failure_of_a_starting_job_is_not_an_unfinished_recovery() -> None:
    log = Log()
    log.add(3.0, "failure", kind="exit", rank=0, spawn_id=0, detail="exit code 1", step=0, detect_s=None)
    tl = build_timeline(log.end(10.0).events)  # the coordinator just starts it again; g1 trains
    assert len(tl.failures) == 1 and tl.recoveries == ()
    (starting,) = _ranks(tl, 0, "start")
    assert starting.end == pytest.approx(3.0) and starting.end_reason == "exit"


def test_failed_job() -> None:
    log = Log(nodes=2, per_node=1, spares=0)
    log.add(9.0, "failure", kind="node", rank=1, spawn_id=1, detail="node 1 lost", step=3, detect_s=None)
    log.add(9.5, "job_failed", error="no step is snapshotted for every rank")
    log.add(10.0, "job_end", state="failed", error="no step is snapshotted for every rank")
    tl = build_timeline(log.events)
    assert tl.outcome == "failed" and tl.error == "no step is snapshotted for every rank"
    assert tl.failed_at == pytest.approx(9.5)
    (r,) = tl.recoveries
    assert not r.complete and r.end == pytest.approx(9.5)
    assert {i.end_reason for i in _ranks(tl, 0)} == {"recovery"}
    assert "failed: no step is snapshotted" in timeline_text(tl)


# -- elastic resizes and live migrations --------------------------------------------------------------
def _line(text: str, head: str) -> str:
    """The one summary line whose kind column is ``head``."""
    (line,) = [x for x in text.splitlines()[1:] if x[11:].startswith(head)]
    return line


def test_a_shrink_then_a_grow_are_resizes_with_their_sizes_times_and_durations() -> None:
    log = Log(per_node=3, spares=0)
    back = log.shrink(10.0, [1], wait=5.0)  # rank 1 has no spare: wait 5 s, then go on with 2
    grown = log.grow(25.0, prepare=1.2)  # a spare appeared: back to 3
    tl = build_timeline(log.end(40.0).events)
    shrink, grow = tl.resizes
    assert (shrink.kind, shrink.old_world_size, shrink.world_size, shrink.label) == (
        "shrink",
        3,
        2,
        "shrink 3→2",
    )
    assert shrink.dropped == (1,) and shrink.renumbered == {2: 1} and shrink.generation == 2
    assert shrink.reason == "no spare for 1 rank(s) after 5.00s" and shrink.outcome == "done"
    assert shrink.start == pytest.approx(10.1) and shrink.t == pytest.approx(15.1)  # waited from detection
    trains = 15.1 + STAGES["plan"] + STAGES["launch"] + STAGES["restore"] + STAGES["rebuild"]
    assert shrink.end == pytest.approx(trains) == tl.generations[1].training_start
    assert [(s.stage, s.seconds) for s in shrink.stages] == [
        ("wait", pytest.approx(5.0)),
        ("swap", pytest.approx(trains - 15.1)),
    ]
    assert (grow.kind, grow.old_world_size, grow.world_size, grow.label) == ("grow", 2, 3, "grow 2→3")
    assert (grow.prepare_step, grow.boundary, grow.generation, grow.outcome) == (50, 60, 3, "done")
    assert grow.new_ranks == (2,) and grow.joiners == {3: "0"} and grow.resized
    assert (grow.start, grow.paused, grow.t, grow.end) == pytest.approx((25.0, 26.2, 26.5, grown))
    assert grow.seconds == pytest.approx(grown - 25.0) and grow.took_s == pytest.approx(grow.seconds)
    assert [s.stage for s in grow.stages] == ["prepare", "swap"]
    assert grow.stages[0].seconds == pytest.approx(1.2) and grow.stages[1].end == pytest.approx(grown)
    # the process that played rank 2 plays rank 1 after the shrink; the joiner plays rank 2 after the grow
    assert [(i.spawn_id, i.generation) for i in _ranks(tl, 1)] == [(1, 1), (2, 2), (2, 3)]
    assert _ranks(tl, 1)[1].start == pytest.approx(trains)
    assert [(i.spawn_id, i.generation) for i in _ranks(tl, 2)] == [(2, 1), (3, 3)]
    assert _ranks(tl, 2)[0].end == pytest.approx(10.1)  # stopped for the recovery, then renumbered
    assert tl.ranks == (0, 1, 2) and tl.world_size == 3
    (r,) = tl.recoveries
    assert r.generation == 2 and r.end == pytest.approx(back)

    text = timeline_text(tl)
    assert text.splitlines()[0].startswith("job abc123: 3 ranks on 1 node (world 3->2->3), done after 41.0s")
    assert text.splitlines()[0].endswith("1 shrink, 1 grow")
    assert _line(text, "shrink").startswith(
        "   15.10s  shrink    g2 3 -> 2 ranks, dropped rank 1, renumbered 2->1"
    )
    again = f"training again {(trains - 15.1) * 1000:.0f}ms later"
    assert _line(text, "shrink").endswith(f"(no spare for 1 rank(s) after 5.00s) | waited 5.00s, {again}")
    assert _line(text, "grow").startswith("   25.00s  grow      g3 2 -> 3 ranks at boundary 60:")
    assert "prepare 1.20s (step 50), swap" in _line(text, "grow")
    assert _line(text, "grow").endswith(f"| {grown - 25.0:.2f}s")


def test_waits_for_a_spare_end_at_the_shrink_or_at_the_generation_a_spare_plays() -> None:
    log = Log(per_node=3, spares=0)
    log.shrink(10.0, [1], wait=5.0)
    tl = build_timeline(log.end(30.0).events)
    (w,) = tl.waits
    assert (w.ranks, w.wait_s, w.outcome) == ((1,), 5.0, "shrink")
    assert (w.start, w.end, w.seconds) == pytest.approx((10.1, 15.1, 5.0))
    assert _line(timeline_text(tl), "wait") == (
        "   10.10s  wait      rank 1 has no spare: waits up to 5.00s | shrank after 5.00s"
    )

    log = Log(spares=2)
    log.fail(10.0, [1, 2], wait=2.0)  # a spare came after 2 s (of up to 3)
    tl = build_timeline(log.end(30.0).events)
    (w,) = tl.waits
    assert (w.ranks, w.outcome, w.wait_s) == ((1, 2), "replaced", 3.0) and tl.resizes == ()
    assert w.start == pytest.approx(10.1) and w.end == pytest.approx(tl.generations[1].t)
    assert w.seconds == pytest.approx(2.0 + STAGES["plan"])
    assert "ranks 1, 2 have no spare: waits up to 3.00s | a spare took over after 2.01s" in timeline_text(tl)

    events = Log().add(10.0, "failure", kind="kill", rank=1, spawn_id=1, step=3, detect_s=0.0).events
    events.append({"ts": T0 + 10.0, "event": "elastic_wait", "ranks": [1], "wait_s": 60.0})
    events.append({"ts": T0 + 12.0, "event": "replicated", "step": 3})  # the log stops here
    (w,) = build_timeline(events).waits
    assert w.outcome == "unfinished" and w.end == pytest.approx(12.0)
    assert "| still waiting (the log ends)" in timeline_text(build_timeline(events))
    failed = [*events, {"ts": T0 + 13.0, "event": "job_failed", "error": "x"}]
    (w,) = build_timeline(failed).waits
    assert w.outcome == "failed" and w.end == pytest.approx(13.0)


def test_an_aborted_grow_changes_no_size() -> None:
    log = Log(per_node=3, spares=0)
    log.shrink(10.0, [1])
    aborted = log.grow(25.0, prepare=1.2, abort="spare 3 exited while preparing")
    tl = build_timeline(log.end(40.0).events)
    assert [z.kind for z in tl.resizes] == ["shrink", "grow"]
    grow = tl.resizes[1]
    assert (grow.kind, grow.outcome, grow.label) == ("grow", "aborted", "grow 2→3 aborted")
    assert grow.error == "spare 3 exited while preparing" and grow.generation is None and not grow.resized
    assert grow.t == grow.end == pytest.approx(aborted) and grow.start == pytest.approx(25.0)
    assert [(s.stage, s.start, s.end) for s in grow.stages] == [
        ("prepare", 25.0, pytest.approx(26.2)),
        ("swap", pytest.approx(26.2), pytest.approx(aborted)),
    ]
    assert [g.number for g in tl.generations] == [1, 2]  # nothing swapped in
    text = timeline_text(tl)
    assert "(world 3->2)" in text.splitlines()[0] and text.splitlines()[0].endswith(
        "1 shrink, 1 aborted grow"
    )
    assert _line(text, "grow") == (
        "   25.00s  grow      2 -> 3 ranks aborted at boundary 60 after 1.50s: spare 3 exited while preparing"
    )
    # a log that stops during the prepare: the grow is unfinished, at the log's end
    events = log.events
    cut = next(i for i, e in enumerate(events) if e["event"] == "grow_pause") + 1
    tl = build_timeline(events[:cut])
    (_, grow) = tl.resizes
    assert grow.outcome == "unfinished" and grow.end == pytest.approx(tl.end) and grow.paused == tl.end
    assert "| unfinished (the log ends)" in _line(timeline_text(tl), "grow")


def test_catchup_rounds_belong_to_their_migration() -> None:
    log = Log(nodes=2, per_node=2)
    first = log.migrate(10.0, 1, "1", catchups=(True, False), swap_delta=True)
    log.add(20.5, "catchup", rank=3, step=44, ok=True, delta=True)  # no migration of rank 3 is open
    second = log.migrate(20.0, 2, "0", catchups=(True,), swap_delta=False)
    log.add(30.0, "migration_start", rank=0, source="0", target="1", joiner=9, step=50, reason="preempt")
    log.add(31.0, "catchup", rank=0, step=51, ok=False, delta=True, error="base 50 missing")
    log.add(31.5, "migration_aborted", rank=0, phase="prepare", error="joiner 9 exited")
    tl = build_timeline(log.end(40.0).events)
    a, b, c = tl.migrations
    assert (a.rank, a.source, a.target, a.reason, a.outcome) == (1, "0", "1", "drain", "done")
    assert [(x.kind, x.step) for x in a.catchups] == [("delta", 42), ("whole", 43)]
    assert (a.rounds, a.swap_delta, a.boundary, a.prepare_step) == (2, True, 48, 40)
    assert (a.start, a.paused, a.end) == pytest.approx((10.0, 11.8, first))
    prepare, swap = a.stages
    assert all(prepare.start < x.t <= prepare.end for x in a.catchups)  # within the prepare stage
    assert (swap.start, swap.end) == pytest.approx((11.8, first))
    assert a.generation == 2 and tl.generations[1].members[1] == a.joiner
    assert [(x.kind, x.step, x.wire_bytes) for x in b.catchups] == [("delta", 42, 100)]
    assert (b.rank, b.rounds, b.swap_delta, b.generation) == (2, 1, False, 3) and b.end == pytest.approx(
        second
    )
    assert (c.rank, c.outcome, c.phase, c.error, c.generation) == (
        0,
        "aborted",
        "prepare",
        "joiner 9 exited",
        None,
    )
    assert [(x.kind, x.error) for x in c.catchups] == [("failed", "base 50 missing")] and len(c.stages) == 1
    assert [(o.event, o.rank) for o in tl.other] == [("catchup", 3)]
    # after the swap the joiner plays the rank, on the target node
    after = [i for i in _ranks(tl, 1) if i.start >= first - STAGES["resume"] - 1e-6]
    assert {(i.spawn_id, i.node) for i in after} == {(a.joiner, "1")}

    text = timeline_text(tl)
    assert _line(text, "migrate   rank 1").startswith(
        "   10.00s  migrate   rank 1 node 0 -> 1 (drain) at boundary 48: prepare 1.80s, swap"
    )
    assert "2 catch-up rounds (delta, whole), swap fetched a delta |" in _line(text, "migrate   rank 1")
    assert "1 catch-up round (delta), swap fetched the whole step |" in _line(text, "migrate   rank 2")
    assert _line(text, "migrate   rank 0") == (
        "   30.00s  migrate   rank 0 node 0 -> 1 (preempt) aborted in prepare after 1.50s: joiner 9 exited"
    )
    assert text.splitlines()[0].endswith("3 migrations")


def test_every_prefix_of_an_elastic_log_is_a_valid_log() -> None:
    events = elastic_log().events
    for n in range(len(events) + 1):
        tl = build_timeline(events[:n])
        timeline_text(tl)
        assert all(x.end >= x.start for x in (*tl.resizes, *tl.waits, *tl.migrations))


def test_render_resizes_waits_and_catchups(tmp_path: Path) -> None:
    tl = build_timeline(elastic_log().events)
    assert [z.label for z in tl.resizes] == ["shrink 4→3", "grow 3→4 aborted", "grow 3→4"]
    png = render_timeline(tl, tmp_path / "elastic.png")
    _check_png(png)
    assert png.stat().st_size > 10_000
    svg = render_timeline(tl, tmp_path / "elastic.svg")
    _check_svg(svg)
    text = svg.read_text()  # matplotlib writes each text as a comment next to its glyphs
    for shown in (
        "shrink 4→3",
        "grow 3→4 aborted",
        "grow 3→4",
        "was rank 2",
        "moved to node 1, 2 catch-ups",
        "waiting for a spare",
        "prepare (move, grow)",
        "catch-up (delta)",
        "catch-up (whole step)",
    ):
        assert f"<!-- {shown} -->" in text, shown
    plain = render_timeline(build_timeline(Log().end(12.0).events), tmp_path / "plain.svg").read_text()
    assert "shrink" not in plain and "catch-up" not in plain  # nothing elastic: no lane, no legend entry


# -- reading ------------------------------------------------------------------------------------------
def test_load_finds_the_log_in_a_job_dir_and_drops_a_torn_last_line(tmp_path: Path) -> None:
    events = Log().end(12.0).events
    text = "".join(json.dumps(e) + "\n" for e in events)
    (tmp_path / "job" / "run").mkdir(parents=True)
    (tmp_path / "job" / "run" / "events.jsonl").write_text(text + '{"ts": 1700000013.0, "event": "fini')
    assert load_events(tmp_path / "job") == events  # a demo's job dir: <dir>/run/events.jsonl
    (tmp_path / "job" / "events.jsonl").write_text(text)
    assert load_timeline(tmp_path / "job").outcome == "done"
    assert load_events(tmp_path / "job" / "events.jsonl") == events
    (tmp_path / "empty.jsonl").write_text("")
    assert load_timeline(tmp_path / "empty.jsonl") == Timeline()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "does not exist"),
        ("dir", "no events.jsonl"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not UTF-8"),
        ("hello\nworld\n", "line 1 is not JSON"),
        ('{"a": 1}\n{"b": 2}\n', "entry 1 has no 'ts' and 'event'"),
        ("[1, 2]\n", "entry 1 has no"),
        ('{"ts": 1, "event": "x"}\nnot json\n{"ts": 2, "event": "y"}\n', "line 2 is not JSON"),
    ],
)
def test_load_rejects_what_is_not_an_event_log(tmp_path: Path, content: str | bytes | None, why: str) -> None:
    path = tmp_path / "events.jsonl"
    if content == "dir":
        path = tmp_path
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match=why):
        load_timeline(path)


# -- pictures -----------------------------------------------------------------------------------------
def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC


def _check_svg(path: Path) -> None:
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")


def test_render_synthetic_logs(tmp_path: Path) -> None:
    log = Log(nodes=2, per_node=2)
    log.fail(10.0, [1])
    log.fail(20.0, [3], kind="hang", detect=1.0)
    log.add(25.0, "migration_start", rank=0, stage="copy")
    log.add(26.0, "persist", step=30, seconds=0.3)
    tl = build_timeline(log.end(40.0).events)
    render_timeline(tl, tmp_path / "a.png")
    _check_png(tmp_path / "a.png")
    render_timeline(tl, tmp_path / "sub" / "a.svg")
    _check_svg(tmp_path / "sub" / "a.svg")
    render_timeline(build_timeline([]), tmp_path / "empty.png")
    _check_png(tmp_path / "empty.png")
    with pytest.raises(UsageError, match=r"ending in \.png"):
        render_timeline(tl, tmp_path / "a.jpg")


def test_render_a_long_job_with_many_ranks(tmp_path: Path) -> None:
    """Ten minutes, 32 ranks on 8 nodes, a failure a minute, replication every second."""
    log = Log(nodes=8, per_node=4, start=20.0)
    for i in range(1, 10):
        t = 60.0 * i
        if i == 5:
            log.add(t, "node_lost", node="5", reason="its agent's connection closed")
            log.fail(t, [20, 21, 22, 23], kind="node", step=500, detect=0.2)
        else:
            log.fail(t, [(7 * i) % 32], kind=("kill", "hang", "exit", "error")[i % 4], step=100 * i)
    for s in range(25, 600):
        log.add(float(s) + 0.5, "replicated", step=s)
    tl = build_timeline(log.end(600.0).events)
    assert len(tl.failures) == 12 and len(tl.recoveries) == 12 and tl.lost_steps == 9
    assert {i.node for i in tl.intervals if i.rank in (20, 21, 22, 23) and i.start > 300} <= {
        "0",
        "1",
        "2",
        "3",
    }
    render_timeline(tl, tmp_path / "long.png")
    _check_png(tmp_path / "long.png")


@pytest.mark.slow
def test_render_the_log_of_a_real_job(tmp_path: Path) -> None:
    from tests.conftest import run_demo_job

    run = run_demo_job(tmp_path / "job", faults=("kill:rank=1,step=5",))
    tl = load_timeline(tmp_path / "job")
    assert tl.outcome == "done" and tl.world_size == 3 and tl.job_id == run.job_id
    (f,) = tl.failures
    assert (f.kind, f.rank) == ("kill", 1)
    (r,) = tl.recoveries
    assert r.complete and r.rank == 1 and r.mttr_s is not None and r.mttr_s > 0
    assert sum(r.stage_seconds.values()) == pytest.approx(r.mttr_s, abs=1e-6)
    assert len({i.spawn_id for i in tl.intervals if i.rank == 1 and i.phase == "train"}) == 2
    assert "kill rank 1" in timeline_text(tl)
    render_timeline(tl, tmp_path / "t.png")
    render_timeline(tl, tmp_path / "t.svg")
    _check_png(tmp_path / "t.png")
    _check_svg(tmp_path / "t.svg")


def test_cli_draws_a_job_dirs_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nonstop.cli import main

    log = Log(nodes=2, per_node=1)
    log.fail(10.0, [1])
    job = tmp_path / "job"
    job.mkdir()
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log.end(20.0).events))
    assert main(["timeline", str(job)]) == 0
    out = capsys.readouterr().out
    assert "recovery" in out and str(job / "timeline.png") in out
    _check_png(job / "timeline.png")
    assert main(["timeline", str(job / "events.jsonl"), "--text-only"]) == 0
    assert main(["timeline", str(tmp_path / "nowhere")]) == 2  # a clear one-line error
    assert "nonstop: error:" in capsys.readouterr().err
