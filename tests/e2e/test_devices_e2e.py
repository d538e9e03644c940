"""Every process on a device of its own, on a real 2-node local job with fake devices
(``NONSTOP_FAKE_DEVICES=3`` per node: 2 ranks + 1 hot spare fill each node; gloo, rank 1
SIGKILLed): before the script's first line every process -- the spares too -- finds
``LOCAL_RANK`` = ``NONSTOP_DEVICE``, an index in range and distinct on its node, and nonstop's
NCCL settings; the spare that takes rank 1 keeps ITS OWN device; survivors keep theirs; the
spare started after the kill gets the device the killed rank freed. (Refusing a process on a
full node: tests/devices/test_devices.py, the agent's side and ``nonstop run``'s exit 2.)"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from tests.envdump import run_env_dump_job

pytestmark = pytest.mark.slow

KEYS = ("RANK", "LOCAL_RANK", "NONSTOP_DEVICE", "NONSTOP_DEVICE_TYPE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_every_process_keeps_its_own_device_through_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NONSTOP_FAKE_DEVICES", "3")  # every node of the job (they inherit it)
    start, _, done = run_env_dump_job(tmp_path, KEYS)
    for sid, e in start.items():  # set by the agent before the script's first line, spares too
        assert e["LOCAL_RANK"] == e["NONSTOP_DEVICE"] and e["LOCAL_RANK"] in ("0", "1", "2"), (sid, e)
        assert e["NONSTOP_DEVICE_TYPE"] == "cuda" and e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", e
    by_node: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
    for sid, e in sorted(start.items()):
        by_node[e["node"]].append((sid, e))
    first = {node: es[:3] for node, es in by_node.items()}  # the processes the job started with
    for node, es in first.items():  # 2 ranks and a spare: the node's 3 devices, one each
        assert sorted(e["LOCAL_RANK"] for _, e in es) == ["0", "1", "2"], (node, es)
        assert sorted(e["role"] for _, e in es) == ["spare", "worker", "worker"], (node, es)

    # at the end: every rank's process kept the device it was spawned with
    assert sorted(int(e["RANK"]) for e in done.values()) == [0, 1, 2, 3]
    for sid, e in done.items():
        assert e["LOCAL_RANK"] == e["NONSTOP_DEVICE"] == start[sid]["LOCAL_RANK"], (sid, e, start[sid])
        assert e["device"] == "cpu"  # fake devices: the index is LOCAL_RANK's, the compute the CPU's
    (taker_sid,) = [sid for sid, e in done.items() if e["role"] == "spare"]
    taker = done[taker_sid]
    assert taker["RANK"] == "1"
    assert all(e["RANK"] is None for e in start.values() if e["role"] == "spare")  # no rank yet
    (killed,) = [sid for sid, e in start.items() if e["RANK"] == "1"]  # the process launched as rank 1
    assert killed not in done
    if start[killed]["node"] == taker["node"]:  # the spare kept its device, not the killed rank's
        assert taker["LOCAL_RANK"] != start[killed]["LOCAL_RANK"]
    # processes started after the kill (a new spare) took a free device of their node
    assert sum(len(es) for es in by_node.values()) > 6, by_node  # one was (the spares kept at 1)
    for es in by_node.values():
        for sid, e in es[3:]:
            assert e["role"] == "spare" and e["LOCAL_RANK"] in ("0", "1", "2"), (sid, e)
            alive = {done[s]["LOCAL_RANK"] for s, x in es[:3] if s in done}
            assert e["LOCAL_RANK"] not in alive, (sid, e, alive)
