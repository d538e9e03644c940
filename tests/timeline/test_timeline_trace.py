"""``nonstop timeline --format trace``: the event log as Chrome-trace / Perfetto JSON.

The trace of a small synthetic log has a fixed shape (its processes, tracks and slices); every
trace -- of synthetic logs, every prefix of one, a real job's log with a kill -- obeys the Trace
Event Format's rules (:func:`check_trace`), and :func:`check_trace` itself catches each broken
rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nonstop.timeline import build_timeline, load_timeline
from nonstop.timeline.trace import check_trace, timeline_trace, tracks
from tests.timeline_fakes import Log, elastic_log


def _shape(trace: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(phase, process, track, name) of every event but the metadata, in file order."""
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    names = tracks(trace)
    return [
        (e["ph"], procs[e["pid"]], e["name"] if e["ph"] == "C" else names[(e["pid"], e["tid"])], e["name"])
        for e in trace["traceEvents"]
        if e["ph"] != "M"
    ]


def test_golden_shape_of_a_small_log_with_a_kill() -> None:
    log = Log(nodes=2, per_node=1)
    log.fail(10.0, [1])
    trace = timeline_trace(build_timeline(log.end(20.0).events))
    assert check_trace(trace) == []
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["job_id"] == "abc123"
    job, n0, n1 = "job abc123", "node 0", "node 1"
    assert _shape(trace) == [
        ("X", n0, "agent", "up"),
        ("X", n1, "agent", "up"),
        ("i", n0, "agent", "join"),
        ("i", n1, "agent", "join"),
        ("X", n0, "rank 0", "start"),
        ("X", n1, "rank 1", "start"),
        ("X", job, "generations", "g1"),
        ("X", job, "generations", "launch"),
        ("i", job, "generations", "g1"),
        ("C", job, "world size", "world size"),
        ("X", job, "generations", "restore"),
        ("X", job, "generations", "rebuild"),
        ("X", n0, "rank 0", "train g1"),
        ("X", n1, "rank 1", "train g1"),
        ("X", job, "generations", "resume"),
        ("X", job, "recovery", "recover kill rank 1"),
        ("X", job, "recovery", "detect"),
        ("i", n1, "rank 1", "kill rank 1"),
        ("X", job, "recovery", "plan"),
        ("C", job, "failures", "failures"),
        ("X", job, "generations", "g2"),
        ("X", job, "recovery", "launch"),
        ("X", job, "generations", "launch"),
        ("i", job, "generations", "g2"),
        ("C", job, "world size", "world size"),
        ("X", job, "recovery", "restore"),
        ("X", job, "generations", "restore"),
        ("X", job, "recovery", "rebuild"),
        ("X", job, "generations", "rebuild"),
        ("X", n0, "rank 0", "train g2"),
        ("X", n1, "rank 1", "train g2"),
        ("X", job, "recovery", "resume"),
        ("X", job, "generations", "resume"),
        ("C", job, "lost steps", "lost steps"),
        ("i", job, "generations", "finish"),
    ]
    evs = trace["traceEvents"]
    (rec,) = [e for e in evs if e["name"] == "recover kill rank 1"]
    assert rec["ts"] == 10_000_000 and rec["dur"] == 780_000  # the fault at 10 s, MTTR 0.78 s
    assert rec["args"]["mttr_s"] == pytest.approx(0.78) and rec["args"]["lost_steps"] == 1
    assert rec["args"]["stages"]["replan"] == 0.0  # an empty stage: in the args, not a slice
    stages = [e for e in evs if e["ph"] == "X" and e["tid"] == rec["tid"] and e["pid"] == rec["pid"]][1:]
    assert [s["name"] for s in stages] == ["detect", "plan", "launch", "restore", "rebuild", "resume"]
    assert sum(s["dur"] for s in stages) == rec["dur"]  # laid end to end, nested in the recovery
    assert all(rec["ts"] <= s["ts"] and s["ts"] + s["dur"] <= rec["ts"] + rec["dur"] for s in stages)
    (kill,) = [e for e in evs if e["name"] == "kill rank 1"]
    assert kill["s"] == "t" and kill["args"]["step"] == 10
    pids = {e["args"]["name"]: e["pid"] for e in evs if e["name"] == "process_name"}
    assert pids == {"job abc123": 0, "node 0": 1, "node 1": 2}
    json.dumps(trace)  # plain JSON


def test_traces_of_an_elastic_log_and_its_every_prefix_are_valid() -> None:
    events = elastic_log().events
    trace = timeline_trace(build_timeline(events))
    assert check_trace(trace) == []
    names = {e["name"] for e in trace["traceEvents"]}
    for shown in ("shrink 4→3", "grow 3→4 aborted", "grow 3→4", "migrate rank 0 0→1", "catch-up delta",
                  "catch-up whole", "prepare", "swap", "wait for a spare: ranks 1"):  # fmt: skip
        assert shown in names, shown
    sizes = [e["args"]["value"] for e in trace["traceEvents"] if e["name"] == "world size"]
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 4
    for n in range(len(events) + 1):
        assert check_trace(timeline_trace(build_timeline(events[:n]))) == [], n


def test_overlapping_recoveries_get_lanes_of_their_own() -> None:
    log = Log(nodes=1, per_node=3, spares=2)
    log.fail(10.0, [0, 2])  # one reconfiguration repairs both: their stages overlap
    trace = timeline_trace(build_timeline(log.end(20.0).events))
    assert check_trace(trace) == []
    lanes = {name for name in tracks(trace).values() if name.startswith("recovery")}
    assert lanes == {"recovery", "recovery (2)"}


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}


@pytest.mark.parametrize(
    ("events", "problem"),
    [
        ([{"ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 1}], "lacks name"),
        ([{"name": "a", "ph": "i", "pid": 0, "tid": 1}], "lacks ts"),
        ([_x("a", 0, -1)], "no duration >= 0"),
        ([_x("a", 5, 1), _x("b", 4, 1)], "goes back in time"),
        ([_x("a", 0, 10), _x("b", 5, 10)], "crosses the end"),
        ([{"name": "a", "ph": "i", "s": "x", "pid": 0, "tid": 1, "ts": 0}], "unknown scope"),
        ([{"name": "a", "ph": "C", "pid": 0, "tid": 0, "ts": 0, "args": {"v": "x"}}], "without numeric args"),
        ([{"name": "a", "ph": "Q", "pid": 0, "tid": 0, "ts": 0}], "unknown phase"),
    ],
)
def test_check_trace_catches_each_broken_rule(events: list[dict[str, Any]], problem: str) -> None:
    (found,) = check_trace({"traceEvents": events})
    assert problem in found
    assert (
        check_trace({"traceEvents": [_x("a", 0, 10), _x("b", 2, 3), _x("c", 10, 1), _x("d", 5, 1, 2)]}) == []
    )
    assert check_trace({}) == ["no 'traceEvents' list"]


def test_cli_writes_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nonstop.cli import main

    log = Log(nodes=2, per_node=1)
    log.fail(10.0, [1])
    job = tmp_path / "job"
    job.mkdir()
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log.end(20.0).events))
    assert main(["timeline", str(job), "--format", "trace"]) == 0
    assert str(job / "timeline.trace.json") in capsys.readouterr().out
    assert check_trace(json.loads((job / "timeline.trace.json").read_text())) == []
    assert main(["timeline", str(job), "--out", str(tmp_path / "t.json")]) == 0  # by the extension
    assert check_trace(json.loads((tmp_path / "t.json").read_text())) == []
    assert not (job / "timeline.png").exists()
    capsys.readouterr()
    assert main(["timeline", str(job), "--format", "trace", "--out", str(tmp_path / "t.png")]) == 2
    assert main(["timeline", str(job), "--format", "svg", "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("nonstop: error:") for line in err)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trace_of_a_real_job_with_a_kill(tmp_path: Path) -> None:
    from tests.conftest import run_demo_job

    run_demo_job(tmp_path / "job", faults=("kill:rank=1,step=5",))
    tl = load_timeline(tmp_path / "job")
    trace = timeline_trace(tl)
    assert check_trace(trace) == []
    evs = trace["traceEvents"]
    (rec,) = [e for e in evs if e["name"] == "recover kill rank 1"]
    mttr = tl.recoveries[0].mttr_s
    assert mttr is not None and rec["dur"] == pytest.approx(mttr * 1e6, abs=1)
    assert [e for e in evs if e["name"] == "kill rank 1" and e["ph"] == "i"]
    trained = {(e["args"]["rank"], e["args"]["spawn_id"]) for e in evs if e.get("cat") == "rank"}
    assert {r for r, _ in trained} == {0, 1, 2} and len({s for r, s in trained if r == 1}) == 2
    assert all(e["ts"] >= 0 for e in evs if e["ph"] != "M")
