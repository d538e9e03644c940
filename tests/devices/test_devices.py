"""Issue 20's device half, without a GPU: the node's device inventory, the agent handing every
process (spares included) a free device at spawn and refusing one when none is free, the
coordinator's room per node, LOCAL_RANK kept for a process's life, ``--nproc-per-node gpu``,
the oversubscription check, NCCL's environment, the backend and ``device_id`` a CUDA rank would
use (through torch's fake backend), and the gradient buffer on the gradients' device."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from nonstop.agent.node import EXIT_NO_DEVICE, NodeAgent, NodeSpec
from nonstop.cli.env import _nproc
from nonstop.control.channel import Message
from nonstop.coordinator.view import JobView, NodeRecord, Role
from nonstop.devices.inventory import (
    DeviceInventory,
    Devices,
    NoFreeDeviceError,
    check_fits,
    detect_devices,
    worker_device_env,
)
from nonstop.devices.nccl import nccl_env
from nonstop.errors import UsageError
from nonstop.protocol.wire import Spawned, decode_agent
from nonstop.train.backend import BackendChoice, choose_backend, collective_timeout_s, worker_device
from nonstop.train.ddp import CanonicalGradSync

CUDA4 = Devices(type="cuda", count=4)


# -- detection and the start-time check ---------------------------------------------------------
def test_detect_fake_devices_and_cpu() -> None:
    assert detect_devices({"NONSTOP_FAKE_DEVICES": "3"}) == Devices(type="cuda", count=3, fake=True)
    assert detect_devices({"NONSTOP_FAKE_DEVICES": "2", "NONSTOP_FAKE_DEVICE_TYPE": "xpu"}).type == "xpu"
    assert detect_devices({"NONSTOP_FAKE_DEVICES": "0"}) == Devices()
    assert detect_devices({}) == Devices()  # this machine: torch.accelerator finds none
    with pytest.raises(UsageError, match="NONSTOP_FAKE_DEVICES"):
        detect_devices({"NONSTOP_FAKE_DEVICES": "two"})


def test_oversubscription_is_one_usage_error_except_on_cpu() -> None:
    check_fits(nproc=3, spares=1, devices=CUDA4)
    check_fits(nproc=64, spares=8, devices=Devices())  # CPU: no limit
    with pytest.raises(UsageError) as e:
        check_fits(nproc=4, spares=1, devices=CUDA4)
    assert "\n" not in str(e.value) and "5 processes" in str(e.value) and "4 cuda device(s)" in str(e.value)


def _refused_at_start(tmp_path: Path, env: dict[str, str], *args: str) -> str:
    """``nonstop run ARGS`` of a script that must not run, with ``env`` added: its exit code is
    2 (a usage error) and its stderr one line, returned."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    cmd = [str(Path(".venv/bin/nonstop").resolve()), "run", *args]
    p = subprocess.run(
        [*cmd, "--job-dir", str(tmp_path / "job"), str(script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_nonstop_run_refuses_an_oversubscribed_node_with_exit_2(tmp_path: Path) -> None:
    env = {"NONSTOP_FAKE_DEVICES": "2"}
    line = _refused_at_start(tmp_path, env, "--nproc-per-node", "2", "--spares", "1")
    assert "3 processes" in line and "2 cuda device(s)" in line, line


def test_nonstop_run_refuses_a_bad_device_groups_mode_before_anything_starts(tmp_path: Path) -> None:
    """Read by every worker at its first join, and checked by the launcher first: a typo fails
    the job at its start, in one line, not at the first generation."""
    line = _refused_at_start(tmp_path, {"NONSTOP_DEVICE_GROUPS": "ring"}, "--nproc-per-node", "1")
    assert "NONSTOP_DEVICE_GROUPS='ring'" in line and "'split'" in line, line
    assert not (tmp_path / "job").exists()


def test_nproc_gpu_is_the_device_count_less_the_spares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NONSTOP_FAKE_DEVICES", "8")
    assert _nproc("gpu") == 8 and _nproc("auto") == 8 and _nproc("gpu", spares=1) == 7
    with pytest.raises(UsageError, match="no device left"):
        _nproc("gpu", spares=8)
    monkeypatch.delenv("NONSTOP_FAKE_DEVICES")
    with pytest.raises(UsageError, match="no accelerator"):
        _nproc("gpu")
    assert _nproc("auto") == (os.cpu_count() or 1)


# -- the inventory ------------------------------------------------------------------------------
def test_inventory_hands_out_free_devices_and_refuses_when_full() -> None:
    inv = DeviceInventory(Devices(type="cuda", count=2))
    assert inv.acquire(10) == 0 and inv.acquire(11) == 1 and inv.acquire(10) == 0  # idempotent
    assert not inv.has_room() and inv.free() == []
    with pytest.raises(NoFreeDeviceError, match="0: process 10, 1: process 11"):
        inv.acquire(12)
    assert inv.release(10) == 0 and inv.free() == [0] and inv.release(10) is None
    assert inv.acquire(12) == 0 and inv.device_of(11) == 1  # the freed one; 11 keeps its own
    cpu = DeviceInventory(Devices())
    assert cpu.acquire(1) is None and cpu.has_room() and cpu.release(1) is None


def test_worker_env_sets_local_rank_to_the_device() -> None:
    assert worker_device_env(CUDA4, 3) == {
        "NONSTOP_DEVICE": "3",
        "NONSTOP_DEVICE_TYPE": "cuda",
        "LOCAL_RANK": "3",
    }
    assert worker_device_env(Devices(type="cuda", count=2, fake=True), 1)["NONSTOP_DEVICE_FAKE"] == "1"
    assert worker_device_env(Devices(), None) == {}


# -- the agent: spawn on a free device, refuse when none ----------------------------------------
class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid = pid


class FakeAgent:
    """The process table (agent/processes.py) without processes."""

    def __init__(self) -> None:
        self.procs: dict[int, _Proc] = {}
        self.envs: dict[int, dict[str, str]] = {}
        self.exited_pids: dict[int, int] = {}
        self.dead: list[int] = []

    def spawn(self, role: str, spawn_id: int, *, rank: int | None, env: dict[str, str]) -> int:
        self.procs[spawn_id] = _Proc(1000 + spawn_id)
        self.envs[spawn_id] = env
        return spawn_id

    def pid(self, sid: int) -> int | None:
        return self.procs[sid].pid if sid in self.procs else None

    def kill(self, sid: int, sig: int) -> None:
        if sid in self.procs and sig == signal.SIGKILL:
            self.dead.append(sid)

    def poll(self) -> list[tuple[int, int]]:
        out = [(sid, -9) for sid in self.dead]
        for sid in self.dead:
            self.exited_pids[sid] = self.procs.pop(sid).pid
        self.dead = []
        return out


def _agent(tmp_path: Path, devices: Devices, spares: int = 1) -> tuple[NodeAgent, FakeAgent, list[Message]]:
    spec = NodeSpec(node="0", nproc=2, spares=spares, domain="0", devices=devices)
    node = NodeAgent(
        spec=spec, coordinator=("127.0.0.1", 1), secret=b"s", secret_file=tmp_path / "s", command=["true"],
        env={}, job_dir=tmp_path, shm_dir=tmp_path, redirect_output=True,
    )  # fmt: skip
    fake = FakeAgent()
    node.agent = cast(Any, fake)
    sent: list[Message] = []
    node._send = sent.append  # type: ignore[method-assign]
    return node, fake, sent


def test_agent_gives_each_process_its_own_device_and_refuses_a_third(tmp_path: Path) -> None:
    node, fake, sent = _agent(tmp_path, Devices(type="cuda", count=2, fake=True))
    node._on_command({"t": "spawn", "spawn_id": 0, "role": "worker", "rank": 0, "env": {"LOCAL_RANK": "0"}})
    # the coordinator's LOCAL_RANK guess is overridden by the device the agent gave it
    node._on_command({"t": "spawn", "spawn_id": 1, "role": "spare", "env": {"LOCAL_RANK": "0"}})
    assert [fake.envs[s]["LOCAL_RANK"] for s in (0, 1)] == ["0", "1"]
    assert [fake.envs[s]["NONSTOP_DEVICE"] for s in (0, 1)] == ["0", "1"]
    assert [m.get("device") for m in sent] == [0, 1]
    sent.clear()
    node._on_command({"t": "spawn", "spawn_id": 2, "role": "spare"})  # the node is full: refused
    assert 2 not in fake.procs
    refused = decode_agent(sent[0])
    assert isinstance(refused, Spawned) and refused.pid is None and "no free device" in (refused.error or "")
    assert sent[1] == {"t": "exit", "spawn_id": 2, "rc": EXIT_NO_DEVICE, "pid": None, "fault_at": None}
    # a process that exits frees its device for the next one
    sent.clear()
    fake.dead.append(0)
    node._report_exits()
    node._on_command({"t": "spawn", "spawn_id": 3, "role": "spare"})
    assert fake.envs[3]["LOCAL_RANK"] == "0" and sent[-1]["device"] == 0


def test_kill_then_spawn_waits_for_the_killed_process_device(tmp_path: Path) -> None:
    node, fake, sent = _agent(tmp_path, Devices(type="cuda", count=2, fake=True))
    for sid in (0, 1):
        node._on_command({"t": "spawn", "spawn_id": sid, "role": "spare"})
    # the coordinator retires process 1 and replaces it by a spare in one breath (swapops Retire)
    node._on_command({"t": "kill", "spawn_id": 1, "sig": int(signal.SIGKILL)})
    node._on_command({"t": "spawn", "spawn_id": 2, "role": "spare"})
    assert fake.envs[2]["LOCAL_RANK"] == "1"  # the killed one's device, once it was reaped
    exits = [m for m in sent if m["t"] == "exit"]
    assert [m["spawn_id"] for m in exits] == [1]  # its exit was reported, not lost


def test_cpu_node_spawns_without_a_device(tmp_path: Path) -> None:
    node, fake, sent = _agent(tmp_path, Devices())
    for sid in range(5):
        node._on_command({"t": "spawn", "spawn_id": sid, "role": "spare", "env": {"LOCAL_RANK": "7"}})
    assert all(e["LOCAL_RANK"] == "7" and "NONSTOP_DEVICE" not in e for e in fake.envs.values())
    assert all(m["device"] is None for m in sent)


def test_nccl_env_for_cuda_workers_never_overrides_the_user(tmp_path: Path) -> None:
    full = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_ENABLE_TIMING": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
    }
    assert nccl_env("cuda", {}) == full

    def without(*names: str) -> dict[str, str]:
        return {k: v for k, v in full.items() if k not in names}

    assert nccl_env("cuda", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == without(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    )
    assert nccl_env("cuda", {"NCCL_BLOCKING_WAIT": "1"}) == without("TORCH_NCCL_BLOCKING_WAIT")
    # a user who turned the flight recorder off (either spelling) or chose a size keeps it
    assert nccl_env("cuda", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == without("TORCH_FR_BUFFER_SIZE")
    assert nccl_env("cuda", {"NCCL_ENABLE_TIMING": "0"}) == without("TORCH_NCCL_ENABLE_TIMING")
    assert nccl_env("cpu", {}) == {} and nccl_env("xpu", {}) == {}


# -- the coordinator: room per node, LOCAL_RANK from the device --------------------------------
def test_view_counts_room_per_device_node_and_keeps_local_rank_in_its_record() -> None:
    v = JobView(job_id="j", world_size=2)
    v.nodes["0"] = NodeRecord(
        name="0", chan=None, nproc=2, spares=1, domain="0", data_addr="", last_lease=0.0, devices=3
    )
    v.nodes["1"] = NodeRecord(
        name="1", chan=None, nproc=2, spares=1, domain="1", data_addr="", last_lease=0.0
    )
    a = v.add_worker("0", Role.WORKER, 0, 0.0)
    v.add_worker("0", Role.SPARE, None, 0.0)
    assert v.room_on("0") == 1 and v.room_on("1") is None
    a.live = False
    assert v.room_on("0") == 2
    a.local_rank = 2
    back = JobView.from_record(v.to_record(), now=0.0, grace_until=0.0)
    assert back.workers[a.spawn_id].local_rank == 2 and back.nodes["0"].devices == 3


def test_membership_keeps_the_device_as_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from nonstop.protocol.worker import ReconfigureMsg
    from nonstop.train.membership import Membership

    monkeypatch.setenv("NONSTOP_DEVICE", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    m = Membership(None)
    m.apply(ReconfigureMsg(gen=0, rank=1, world_size=4, env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}))
    assert os.environ["LOCAL_RANK"] == "2" and os.environ["RANK"] == "1"
    monkeypatch.delenv("NONSTOP_DEVICE")
    m.apply(ReconfigureMsg(gen=0, rank=1, world_size=4, env={"LOCAL_RANK": "1"}))
    assert os.environ["LOCAL_RANK"] == "1"  # a CPU node: the coordinator's number, as before


# -- the worker: device, backend, timeout, gradient buffer ---------------------------------------
def test_worker_device_from_the_agents_env() -> None:
    assert worker_device({"NONSTOP_DEVICE": "3", "NONSTOP_DEVICE_TYPE": "cuda"}) == torch.device("cuda", 3)
    fake = {"NONSTOP_DEVICE": "3", "NONSTOP_DEVICE_TYPE": "cuda", "NONSTOP_DEVICE_FAKE": "1"}
    assert worker_device(fake) == torch.device("cpu") and worker_device({}) == torch.device("cpu")


def test_backend_choice_per_device() -> None:
    assert choose_backend(torch.device("cpu")) == BackendChoice(backend="gloo", device_id=None)
    cuda = choose_backend(torch.device("cuda", 5))
    assert cuda == BackendChoice(backend="cpu:gloo,cuda:nccl", device_id=torch.device("cuda", 5))
    assert choose_backend(torch.device("xpu", 0)).backend == "cpu:gloo,xpu:xccl"
    with pytest.raises(ValueError):
        choose_backend(torch.device("cuda"))


def test_collective_timeout_is_separate_from_the_rebuild_timeout() -> None:
    assert collective_timeout_s(30.0, torch.device("cpu"), {}) == 30.0  # CPU: as before
    assert collective_timeout_s(30.0, torch.device("cuda", 0), {}) == 600.0
    assert collective_timeout_s(30.0, torch.device("cuda", 0), {"NONSTOP_COLLECTIVE_TIMEOUT_S": "90"}) == 90.0
    with pytest.raises(UsageError, match="NONSTOP_COLLECTIVE_TIMEOUT_S"):
        collective_timeout_s(30.0, torch.device("cpu"), {"NONSTOP_COLLECTIVE_TIMEOUT_S": "0"})


def test_group_passes_the_cuda_backend_and_device_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """What GenerationGroup hands init_process_group for a rank on cuda:1 (recorded: this torch
    has no CUDA), and that the composite string itself works: the same with NCCL swapped for
    torch's fake backend, CPU tensors reduced by gloo."""
    import torch.testing._internal.distributed.fake_pg  # registers the "fake" backend

    import nonstop.train.group as group

    monkeypatch.setenv("NONSTOP_DEVICE", "1")
    monkeypatch.setenv("NONSTOP_DEVICE_TYPE", "cuda")
    calls: list[dict[str, Any]] = []
    real_init = dist.init_process_group

    def record(backend: str, **kw: Any) -> None:
        calls.append({"backend": backend, **kw})
        kw.pop("device_id")  # no CUDA here: run it with the fake backend for the device side
        real_init(backend.replace("cuda:nccl", "cuda:fake"), **kw)

    monkeypatch.setattr(group.dist, "init_process_group", record)
    g = group.GenerationGroup()
    try:
        g.join_plain(cast(Any, dist.HashStore()), rank=0, world_size=1, timeout_s=30.0)
        (call,) = calls
        assert call["backend"] == "cpu:gloo,cuda:nccl" and call["device_id"] == torch.device("cuda", 1)
        assert call["timeout"] == datetime.timedelta(seconds=600)
        pg = dist.group.WORLD
        assert pg is not None
        assert type(pg._get_backend(torch.device("cpu"))).__name__ == "ProcessGroupGloo"
        assert type(pg._get_backend(torch.device("cuda"))).__name__ == "FakeProcessGroup"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        g.destroy()


def test_gradient_buffer_lives_on_the_gradients_device() -> None:
    cpu = CanonicalGradSync(torch.nn.Linear(3, 2))
    assert cpu.flat.device == torch.device("cpu") and cpu.flat.numel() == 8
    with torch.device("meta"):
        meta = torch.nn.Linear(3, 2)
    assert CanonicalGradSync(meta).flat.device == torch.device("meta")
