"""torchrun's worker environment on a real 2-node local job (2 ranks and a hot spare per node, gloo,
rank 1 SIGKILLed): every process launched as a rank finds RANK, LOCAL_RANK (its index on its node),
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*, MASTER_ADDR/PORT and TORCHELASTIC_RESTART_COUNT
before the script starts, and the spare that takes rank 1 reads its own node's values after
``nonstop.init()``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from tests.envdump import run_env_dump_job

pytestmark = pytest.mark.slow

KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
)  # fmt: skip


def test_every_worker_sees_torchruns_environment_on_two_nodes_through_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # launched from inside another job's rank: nothing of its torchrun variables reaches a process
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "9")
    monkeypatch.setenv("LOCAL_RANK", "5")
    start, _, done = run_env_dump_job(tmp_path, KEYS)
    launched = {sid: e for sid, e in start.items() if e["role"] == "worker"}
    assert sorted(int(e["RANK"]) for e in launched.values()) == [0, 1, 2, 3]
    ports = {e["MASTER_PORT"] for e in start.values() if e["role"] == "worker"}
    assert len(ports) == 1 and next(iter(ports)).isdigit()
    for e in launched.values():  # before the script's first line: the start plan
        rank = int(e["RANK"])
        assert e["node"] == str(rank // 2) and e["GROUP_RANK"] == e["node"]
        assert (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(rank % 2), "2")
        assert (e["WORLD_SIZE"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == ("4", e["RANK"], "4")
        assert (e["GROUP_WORLD_SIZE"], e["ROLE_NAME"], e["MASTER_ADDR"]) == ("2", "default", "127.0.0.1")
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert all(e["RANK"] is None for e in start.values() if e["role"] == "spare")  # no rank yet

    # at the end: the four ranks, one of them played by the spare that took rank 1
    assert sorted(int(e["RANK"]) for e in done.values()) == [0, 1, 2, 3]
    by_node: dict[str, list[dict[str, str]]] = defaultdict(list)
    for e in done.values():
        by_node[e["node"]].append(e)
        assert e["GROUP_RANK"] == e["node"] and e["GROUP_WORLD_SIZE"] == "2"
        assert (e["WORLD_SIZE"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) == ("4", e["RANK"], "4")
        assert e["TORCHELASTIC_RESTART_COUNT"] == "1" and e["MASTER_PORT"] in ports
    for node, es in by_node.items():  # node-local indexes, distinct, below the node's rank count
        assert all(e["LOCAL_WORLD_SIZE"] == str(len(es)) for e in es), (node, es)
        assert sorted(int(e["LOCAL_RANK"]) for e in es) == list(range(len(es))), (node, es)
    (taker,) = [e for e in done.values() if e["role"] == "spare"]
    assert taker["RANK"] == "1"
    survivors = sorted(int(e["LOCAL_RANK"]) for e in by_node[taker["node"]] if e is not taker)
    # its index on ITS node: the one the killed rank left on node 0, or the next one on node 1
    assert taker["LOCAL_RANK"] == ("1" if taker["node"] == "0" else "2"), (taker, survivors)
    for sid, e in done.items():  # survivors kept their processes and their indexes
        if sid in launched:
            assert e["LOCAL_RANK"] == launched[sid]["LOCAL_RANK"]
