"""Typed events (events.py): the log's lines as they were, read back tolerantly, and every
kind a writer logs has its class."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest

import nonstop
from nonstop import events as ev
from nonstop.events.log import EventLog, read_events
from nonstop.timeline import build_timeline, load_timeline

SOURCE = Path(nonstop.__file__).parent


def _sample(tp: Any, i: int) -> Any:
    """A JSON value of field type ``tp`` (not null, not empty), varied by ``i``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)), i)
    if origin is list:
        return [_sample(typing.get_args(tp)[0], i), _sample(typing.get_args(tp)[0], i + 1)]
    if origin is dict:
        return {str(i): _sample(typing.get_args(tp)[1], i + 2)}
    if tp is Any:
        return {"rounds": i, "ratio": 0.5}
    return {bool: True, int: 10 + i, float: 0.25 + i, str: f"text{i}"}[tp]


def _line_fields(cls: type[ev.Event]) -> dict[str, Any]:
    """Every line field of ``cls`` (optional ones included) with a sample value, by JSON key."""
    hints = typing.get_type_hints(cls)
    out = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.name not in ("ts", "extra"):
            out[f.metadata.get("json", f.name)] = _sample(hints[f.name], i)
    return out


@pytest.mark.parametrize("kind", sorted(ev.REGISTRY))
def test_every_kind_round_trips_through_its_json_line(kind: str) -> None:
    fields = _line_fields(ev.REGISTRY[kind])
    event = dataclasses.replace(ev.from_fields(kind, fields), ts=1_700_000_000.5)
    line = event.to_json()
    assert line == {"ts": 1_700_000_000.5, "event": kind, **fields}  # the line as writers log it
    back = ev.decode(json.loads(json.dumps(line)))
    assert type(back) is ev.REGISTRY[kind] and back == event and back.to_json() == line


def test_an_optional_field_a_writer_does_not_pass_is_not_in_the_line() -> None:
    assert ev.from_fields("refused", {"peer": "p", "reason": "bad secret"}).to_json() == {
        "event": "refused",
        "peer": "p",
        "reason": "bad secret",
    }
    with_node = ev.Refused(peer="p", node="1", reason="fenced")
    assert with_node.to_json() == {"event": "refused", "peer": "p", "node": "1", "reason": "fenced"}
    fetched = {"node": "0", "rank": 1, "ok": True, "seconds": 0.1, "error": None}
    assert "early" not in ev.from_fields("fetched", fetched).to_json()
    assert ev.from_fields("fetched", {**fetched, "early": True}).to_json()["early"] is True


def test_decode_is_tolerant() -> None:
    unknown = {"ts": 5.0, "event": "something_new", "x": [1]}
    got = ev.decode(unknown)
    assert isinstance(got, ev.UnknownEvent) and (got.event, got.ts, got.raw) == (
        "something_new",
        5.0,
        unknown,
    )
    assert got.to_json() == unknown
    # an older line lacking fields: their defaults; a value of the wrong type: its default too
    old = ev.decode({"ts": 1, "event": "catchup", "rank": "3", "step": "x", "delta": True})
    assert isinstance(old, ev.Catchup)
    assert (old.ts, old.rank, old.step, old.ok, old.delta, old.capped, old.error) == (
        1.0,
        3,
        None,
        True,
        True,
        False,
        None,
    )
    spawn = ev.decode({"ts": 1, "event": "spawn", "spawn_id": 4, "rank": None, "node": 1})
    assert isinstance(spawn, ev.Spawn) and (spawn.role, spawn.node) == ("worker", "1")
    failure = ev.decode({"ts": 1, "event": "failure", "rank": True})
    assert isinstance(failure, ev.Failure) and (failure.failure_kind, failure.rank, failure.detail) == (
        "?",
        None,
        "",
    )
    # keys a class does not know are kept, and written back
    newer = {"ts": 2.0, "event": "node_lost", "node": "1", "reason": "r", "quarantined": False, "zone": "b"}
    lost = ev.decode(newer)
    assert isinstance(lost, ev.NodeLost) and lost.extra == {"zone": "b"} and lost.to_json() == newer
    gen = ev.decode(
        {"ts": 3, "event": "generation", "members": {"0": 5, "1": "x", "y": 2}, "nodes": {"0": "a"}}
    )
    assert isinstance(gen, ev.NewGeneration)
    assert (
        gen.members_by_rank
        == {
            0: 5,
        }
        and gen.nodes_by_rank == {0: "a"}
        and gen.cause == []
    )


def test_emitting_a_wrong_field_or_kind_raises(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(TypeError, match="has no field 'nod'"):
        log.emit("node_lost", nod="1", reason="lease expired", quarantined=False)
    with pytest.raises(TypeError, match="quarantined"):
        log.emit("node_lost", node="1", reason="lease expired")  # a field left out
    with pytest.raises(TypeError, match="unknown event kind 'node_gone'"):
        log.emit("node_gone", node="1")
    with pytest.raises(TypeError, match="has no field 'ts'"):
        log.emit("node_released", node="1", ts=3.0)
    with pytest.raises(TypeError, match="not both"):
        log.emit(ev.NodeReleased(node="1"), node="2")  # type: ignore[call-arg]
    log.emit("node_lost", node="1", reason="lease expired", quarantined=True)
    log.emit(ev.NodeLost(node="2", reason="agent exited", quarantined=False))
    log.close()
    header, *lines = read_events(tmp_path / "events.jsonl")
    assert header["event"] == "eventlog" and header["version"] == ev.VERSION
    assert [(x["event"], x["node"], x["quarantined"]) for x in lines] == [
        ("node_lost", "1", True),
        ("node_lost", "2", False),
    ]
    assert all(isinstance(x["ts"], float) for x in lines)


def test_the_header_is_written_once_and_a_log_without_one_reads_the_same(tmp_path: Path) -> None:
    lines = [
        {"ts": 100.0, "event": "job_start", "job_id": "j", "nnodes": 1, "nproc": 2, "spares": 0},
        {
            "ts": 100.5,
            "event": "generation",
            "generation": 1,
            "members": {"0": 0, "1": 1},
            "nodes": {"0": "0", "1": "0"},
        },
        {"ts": 101.0, "event": "stage", "generation": 1, "stage": "rebuild", "seconds": 0.2},
        {"ts": 103.0, "event": "job_end", "state": "done", "error": None},
    ]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(x) + "\n" for x in lines))
    new = tmp_path / "new.jsonl"
    log = EventLog(new)
    for x in lines:
        log.emit(ev.decode(x))
    log.close()
    EventLog(new).close()  # reopened (a restarted coordinator): no second header
    got = read_events(new)
    assert [x["event"] for x in got] == ["eventlog", "job_start", "generation", "stage", "job_end"]
    assert got[1:] == [ev.decode(x).to_json() for x in lines]
    assert load_timeline(old) == load_timeline(new) == build_timeline(lines)
    assert load_timeline(new).events == 4 and load_timeline(new).world_size == 2


def _emit_kinds(text: str) -> list[str]:
    """Kinds still logged by name: the persister's callback and the swap machine's Emit actions
    (everything else constructs the typed classes, which mypy checks)."""
    return re.findall(r"(?:_emit\(\s*|Emit\(\s*kind=)\"(\w+)\"", text)


def test_every_kind_logged_in_the_source_is_registered() -> None:
    found: dict[str, list[str]] = {}
    typed = 0
    for path in sorted(SOURCE.rglob("*.py")):
        text = path.read_text()
        typed += len(re.findall(r"emit\(\s*ev\.[A-Z]\w*\(", text))
        for kind in _emit_kinds(text):
            found.setdefault(kind, []).append(path.name)
    assert typed >= 40, "the coordinator's modules log typed events"
    assert len(found) >= 6, "the scan finds the by-name kinds"
    unregistered = {k: v for k, v in found.items() if k not in ev.REGISTRY}
    assert unregistered == {}, f"kinds logged but not in events.py: {unregistered}"
    assert _emit_kinds('self._emit(\n    "persist_failed", error=x)') == ["persist_failed"]


def test_the_fields_of_every_emit_call_are_those_of_its_kind() -> None:
    """A call ``_emit("kind", a=...)`` (the persister's callback) names only fields of the kind's
    class and, unless it expands ``**more``, every field the class requires."""
    checked = 0
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("emit", "_emit") or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            cls = ev.REGISTRY[first.value]
            keys = {
                f.metadata.get("json", f.name): f
                for f in dataclasses.fields(cls)
                if f.name not in ("ts", "extra")
            }
            named = {k.arg for k in node.keywords if k.arg is not None}
            where = f"{path.name}:{node.lineno} {first.value}"
            assert named <= set(keys), f"{where}: no field {sorted(named - set(keys))}"
            if all(k.arg is not None for k in node.keywords):
                required = {
                    k
                    for k, f in keys.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                }
                assert required <= named, f"{where}: misses {sorted(required - named)}"
            checked += 1
    assert checked >= 2


def test_renamed_events_keep_their_kinds_and_first_names() -> None:
    """Issue 46: one name per vocabulary. The ``exit`` and ``stage`` events are ProcessExited and
    ReconfigurationStage (not the wire's ExitMsg, the failures' ProcessEnd, the policy's Stage);
    their kinds, so events.jsonl, are what they were, and the first names still import."""
    from nonstop import events
    from nonstop.events import job, recovery

    assert events.REGISTRY["exit"] is events.ProcessExited is events.Exit is job.Exit
    assert events.REGISTRY["stage"] is events.ReconfigurationStage is events.Stage is recovery.Stage
    line = events.ReconfigurationStage(generation=2, stage="restore", seconds=0.5).to_json()
    assert line == {"event": "stage", "generation": 2, "stage": "restore", "seconds": 0.5}
