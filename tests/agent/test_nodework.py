"""A node agent's data path keeps a recovery's commands apart from replication: a replication
round waiting on a holder that went silent (a partition drops packets, no reset: it waits out its
ack timeout) must not hold back an inventory or an install, or the recovery plans without this
node's memory and restores older state from disk (found by ``nonstop chaos``: 3 committed steps
lost after a partition)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.agent.data_path import NodeWork


def test_an_inventory_is_answered_while_a_replication_round_waits_on_a_silent_holder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silent = threading.Event()
    sent: list[dict[str, Any]] = []
    replicated: list[int] = []

    def replicate(self: NodeWork, msg: dict[str, Any]) -> None:
        silent.wait(30.0)  # the holder says nothing
        replicated.append(int(msg["step"]))

    monkeypatch.setattr(NodeWork, "_replicate", replicate)
    monkeypatch.setattr(NodeWork, "_inventory", lambda self, rid: {"t": "inventory", "id": rid})
    fake: Any = object()
    work = NodeWork(
        node="1", job_id="j", shm_dir=tmp_path, secret=b"x" * 32, agent=fake, data=fake,
        local=fake, replica=fake, replicator=fake, send=sent.append,
    )  # fmt: skip
    work.start()
    try:
        work.submit({"t": "replicate", "step": 5})
        work.submit({"t": "inventory", "id": 7})
        deadline = time.monotonic() + 10.0
        while not sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sent == [{"t": "inventory", "id": 7}] and replicated == []
    finally:
        silent.set()
        work.stop()
    deadline = time.monotonic() + 10.0
    while not replicated and time.monotonic() < deadline:
        time.sleep(0.01)
    assert replicated == [5]  # the round itself still ran, in order


class _SilentReplicator:
    """Blocks in ``replicate`` like a round waiting on a silent holder, until ``abandon``."""

    def __init__(self) -> None:
        self.freed = threading.Event()
        self.calls: list[tuple[int, int]] = []

    def replicate(self, rank: int, step: int, holders: list[str]) -> Any:
        from nonstop.replica.peer import FetchError, ReplicaStats

        self.calls.append((rank, step))
        if step == 5 and not self.freed.wait(30.0):
            raise AssertionError("never abandoned")
        if step == 5:
            raise FetchError(f"replicating rank {rank} step {step}: connection closed")
        return ReplicaStats(raw_bytes=10, wire_bytes=5)

    def abandon(self) -> None:
        self.freed.set()


def test_a_newer_round_supersedes_one_stuck_on_a_silent_holder() -> None:
    """Found by ``nonstop chaos`` (partition): after a node was cut off, the coordinator gave up on
    the round in flight and sent a new one to the surviving holders, but the node's replication
    thread waited out the 60 s ack timeout of the old one first -- the committed step stood
    still for a minute. The new round now abandons the old at once, the old round's other ranks
    are skipped, and no stale failure (which would fail the new round of the same step) is sent."""
    sent: list[dict[str, Any]] = []
    rep = _SilentReplicator()
    fake: Any = object()
    work = NodeWork(
        node="0", job_id="j", shm_dir=Path("/nonexistent"), secret=b"x" * 32, agent=fake, data=fake,
        local=fake, replica=fake, replicator=rep, send=sent.append,
    )  # fmt: skip
    work.start()
    try:
        work.submit({"t": "replicate", "step": 5, "ranks": {"0": ["cut:1"], "3": ["cut:1"]}})
        deadline = time.monotonic() + 10.0
        while not rep.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        work.submit({"t": "replicate", "step": 6, "ranks": {"0": ["alive:2"], "3": ["alive:2"]}})
        deadline = time.monotonic() + 10.0
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rep.freed.is_set()
        assert rep.calls == [(0, 5), (0, 6), (3, 6)]  # rank 3 of the abandoned round: skipped
        assert [(m["step"], m["rank"], m["ok"]) for m in sent] == [(6, 0, True), (6, 3, True)]
    finally:
        rep.freed.set()
        work.stop()
