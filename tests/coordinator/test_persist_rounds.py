"""Persist rounds across nodes (coordinator/persistence.py), with fake nodes answering in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nonstop.control.channel import Message
from nonstop.coordinator import persistence
from nonstop.coordinator.persistence import ClusterPersister
from nonstop.snapshot.codec import CodecConfig, Encoder, segments_for
from nonstop.snapshot.durable import DurableStore, step_dir
from tests.durable_fakes import WORLD, RankData, full_ckpt


def _rounds(tmp_path: Path, every: int = 0, timeout_s: float = 30.0) -> tuple[ClusterPersister, list[Any]]:
    events: list[Any] = []
    rounds = ClusterPersister(
        durable=DurableStore(tmp_path, keep=5),
        codec=CodecConfig(),
        every=every,
        timeout_s=timeout_s,
        emit=lambda e: events.append((e.kind, e.fields())),
    )
    return rounds, events


def _answer(msg: Message, ranks: list[RankData]) -> Message:
    """What a node's agent answers: its ranks written with DurableStore.contribute."""
    part = DurableStore(str(msg["url"])).contribute(int(msg["step"]), int(msg["world_size"]), "zstd")
    enc = Encoder(CodecConfig())
    try:
        for r in msg["ranks"]:
            meta, data, entries = ranks[r]
            part.add_rank(r, meta, len(data), enc.encode(bytes(data), segments_for(entries, len(data))), None)
    finally:
        enc.close()
    return {"t": "persisted", "id": msg["id"], "ok": True, "records": [part.record(r) for r in msg["ranks"]]}


def test_a_round_commits_when_every_node_has_answered(tmp_path: Path) -> None:
    rounds, events = _rounds(tmp_path, every=4)
    sent: dict[str, Message] = {}
    rounds.attach(lambda node, msg: sent.__setitem__(node, msg) is None)
    assert not rounds.wanted(3) and rounds.wanted(4)
    ranks = full_ckpt(4)
    assert rounds.start(4, {"0": [0, 2], "1": [1]})
    assert sent["0"]["ranks"] == [0, 2] and sent["1"]["ranks"] == [1]
    rounds.on_reply("1", _answer(sent["1"], ranks))
    assert rounds.round is not None and DurableStore(tmp_path).steps() == []  # not before node 0
    rounds.on_reply("1", _answer(sent["1"], ranks))  # a duplicate answer is ignored
    rounds.on_reply("0", _answer(sent["0"], ranks))
    assert rounds.round is None and rounds.last_step == 4 and rounds.last_error is None
    loaded = DurableStore(tmp_path).load()
    assert loaded.step == 4 and [bytes(loaded.data(r)) for r in range(WORLD)] == [
        bytes(d) for _, d, _ in ranks
    ]
    assert events[-1][0] == "persist" and events[-1][1]["nodes"] == ["0", "1"]
    ticket = rounds.request()
    assert not rounds.wait(ticket, 0)
    assert not rounds.wanted(4) and rounds.wait(ticket, 0)  # nothing newer: the request is answered


@pytest.mark.parametrize("how", ["error", "lost", "timeout", "bad record", "unreachable"])
def test_a_failed_round_commits_nothing_and_answers_its_requests(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(persistence, "RETRY_S", 0.0)
    rounds, events = _rounds(tmp_path, timeout_s=0.0 if how == "timeout" else 30.0)
    sent: dict[str, Message] = {}
    rounds.attach(lambda node, msg: how != "unreachable" and sent.__setitem__(node, msg) is None)
    ticket = rounds.request()
    assert rounds.wanted(7)
    ranks = full_ckpt(7)
    started = rounds.start(7, {"0": [0, 1], "1": [2]})
    assert started is (how != "unreachable")
    if started:
        rounds.on_reply("0", _answer(sent["0"], ranks))
        if how == "error":
            rounds.on_reply("1", {"t": "persisted", "id": sent["1"]["id"], "ok": False, "error": "disk full"})
        elif how == "lost":
            rounds.check({"0"})
        elif how == "timeout":
            rounds.check({"0", "1"})
        else:
            good = _answer(sent["1"], ranks)
            rounds.on_reply("1", {**good, "records": [{**good["records"][0], "file_len": 1}]})
    assert rounds.round is None and rounds.last_step is None and rounds.wait(ticket, 0)
    assert rounds.last_error and events[-1][0] == "persist_failed"
    assert DurableStore(tmp_path).steps() == [] and not (tmp_path / step_dir(7)).exists()
    assert not rounds.wanted(7)  # the request was answered (with the error) ...
    rounds.request()
    assert rounds.wanted(7)  # ... and a new one is tried at once (RETRY_S is 0 here)
