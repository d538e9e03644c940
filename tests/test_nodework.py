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

from nonstop.runtime.nodework import NodeWork


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
