"""The flight-recorder watch (nonstop.train.frwatch): which dumps mean "waiting in a collective",
what a broken dump means, when a rank gets a watch, and the real recorder's format (gloo)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from nonstop.train.frwatch import MIN_IDLE_S, FlightRecorderWatch, flight_recorder_watch, started_entries
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.position import Position


def _dump(*states: str, completed: bool = False) -> bytes:
    entries = [
        {
            "record_id": i,
            "pg_id": 1,
            "collective_seq_id": i + 1,
            "profiling_name": "nccl:_reduce_scatter_base",
            "state": s,
            "time_discovered_completed_ns": 123 if completed else None,
        }
        for i, s in enumerate(states)
    ]
    return json.dumps({"version": "2.10", "entries": entries, "pg_config": {}}).encode()


def test_a_started_collective_is_a_wait_and_an_enqueued_one_is_not() -> None:
    assert started_entries(_dump("scheduled", "started")) == 1
    assert started_entries(_dump("started", "started")) == 2
    assert started_entries(_dump("scheduled", "scheduled")) == 0  # the rank's own kernels run first
    assert started_entries(_dump()) == 0  # nothing in flight: a rank stuck on the host
    assert started_entries(_dump("started", completed=True)) == 0  # seen completed since
    assert started_entries(json.dumps({"version": "2.10"})) == 0  # a recorder with no entries yet


@pytest.mark.parametrize(
    "bad", [b"not json", b"[1, 2]", json.dumps({"entries": {"a": 1}}), json.dumps({"entries": [3]})]
)
def test_a_dump_not_shaped_like_the_recorders_is_an_error(bad: Any) -> None:
    with pytest.raises(ValueError):
        started_entries(bad)


def test_the_watch_answers_from_the_dump_and_a_broken_one_never_protects_a_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dumps = [_dump("started"), _dump("scheduled"), b"garbage"]
    watch = FlightRecorderWatch(dump=lambda: dumps.pop(0))
    stalled = {"idle_s": 5.0, "step_s": 0.5}
    assert watch.pending(**stalled) is True
    assert watch.pending(**stalled) is False

    with caplog.at_level(logging.WARNING, logger="nonstop.train.frwatch"):
        assert watch.pending(**stalled) is False

        def boom() -> bytes:
            raise RuntimeError("moved in this torch")

        watch._dump = boom
        assert watch.pending(**stalled) is False
    assert len([r for r in caplog.records if "flight recorder" in r.getMessage()]) == 1  # once


def test_a_rank_still_within_its_step_is_never_dumped() -> None:
    """The dump holds the GIL for tens of ms: only a rank that has gone MIN_IDLE_S, and as long
    as its last step, without a step pays for one."""
    dumped: list[int] = []

    def dump() -> bytes:
        dumped.append(1)
        return _dump("started")

    watch = FlightRecorderWatch(dump=dump)
    assert watch.pending(idle_s=0.5, step_s=None) is False  # before MIN_IDLE_S
    assert watch.pending(idle_s=1.5, step_s=2.0) is False  # a 2 s step still running
    assert dumped == []
    assert watch.pending(idle_s=MIN_IDLE_S, step_s=None) is True
    assert watch.pending(idle_s=2.5, step_s=2.0) is True  # later than the step before it
    assert len(dumped) == 2


def test_retired_entries_are_finished_whatever_their_state() -> None:
    doc = json.loads(_dump("started", "scheduled"))
    doc["entries"][0]["retired"] = True
    assert started_entries(json.dumps(doc)) == 0


def test_only_a_cuda_rank_with_the_recorder_on_gets_a_watch() -> None:
    assert flight_recorder_watch("cpu", {"TORCH_FR_BUFFER_SIZE": "2000"}) is None
    assert isinstance(flight_recorder_watch("cuda", {"TORCH_FR_BUFFER_SIZE": "2000"}), FlightRecorderWatch)
    assert isinstance(
        flight_recorder_watch("cuda", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}), FlightRecorderWatch
    )
    assert flight_recorder_watch("cuda", {"TORCH_FR_BUFFER_SIZE": "0"}) is None  # the user turned it off
    assert flight_recorder_watch("cuda", {"TORCH_FR_BUFFER_SIZE": "lots"}) is None
    assert flight_recorder_watch("cuda", {}) is None


def test_the_heartbeat_says_coll_while_the_recorder_shows_a_started_collective() -> None:
    dumps = [_dump("scheduled", "started"), _dump("scheduled")]
    beat = HeartbeatWords(Position(step=3))
    beat.watch_collectives(sync=None, clock=None, frwatch=FlightRecorderWatch(dump=lambda: dumps.pop(0)))
    beat.stepped(time.monotonic() - 10.0, 0.5)  # ten seconds without a step
    assert beat.message().encode()["coll"] is True  # an FSDP2 reduce-scatter waits on a peer
    assert beat.message().encode()["coll"] is False  # only its own kernels queued: blamed
    beat.progressed()  # a step just completed: no dump (the fake has none left)
    assert beat.message().encode()["coll"] is False


REAL = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from nonstop.train.frwatch import _dump_active, started_entries
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.empty(3), t)
    raw = _dump_active()
    doc = json.loads(raw)
    print(json.dumps({"states": [e["state"] for e in doc["entries"]], "started": started_entries(raw)}))
    dist.destroy_process_group()
    """
)


def _run_rank(script: str, tmp_path: Path, env: dict[str, str], *, timeout: float) -> Any:
    """Run ``script`` as a one-rank job in a fresh process (its own flight recorder: torch reads
    the ring's size once per process); the JSON its last line prints."""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "rdzv")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_real_recorder_dump_parses_and_gloo_never_starts_an_entry(tmp_path: Path) -> None:
    """torch's own dump (the real recorder, on gloo): the format the watch parses, and why no
    watch is made on the CPU -- gloo leaves every entry ``scheduled``."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "GLOO_SOCKET_IFNAME": "lo"}
    got = _run_rank(REAL, tmp_path, env, timeout=120)
    assert got["states"] and set(got["states"]) == {"scheduled"}, got
    assert got["started"] == 0


NCCL = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from nonstop.train.frwatch import _dump_active, started_entries
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    t = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    print(json.dumps({"started": started_entries(_dump_active())}))
    dist.destroy_process_group()
    """
)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_on_nccl_completed_collectives_leave_no_started_entry(tmp_path: Path) -> None:
    """The environment nonstop gives a CUDA worker (devices/nccl.py), one rank: after its
    collectives have completed, the watch sees no wait."""
    from nonstop.devices.nccl import nccl_env

    env = {**os.environ, **nccl_env("cuda", {})}
    assert _run_rank(NCCL, tmp_path, env, timeout=300) == {"started": 0}
