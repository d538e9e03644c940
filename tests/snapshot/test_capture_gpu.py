"""Capture on a real GPU: skipped without one (CI, the dev machine); run on a lent GPU machine with
``pytest tests/snapshot/test_capture_gpu.py -s``. tests/snapshot/test_capture_device.py checks the same
ordering rules on CPU against a fake CUDA; these check them against the real driver."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nonstop.snapshot import RankSnapshotStore, StateCapture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    # slots of a few GiB: /dev/shm when it has room (a container's may be 64 MiB), else the disk
    shm_dir = Path("/dev/shm")
    d = shm_dir if shm_dir.is_dir() and shutil.disk_usage(shm_dir).free > 8 << 30 else tmp_path
    out = d / f"nonstop-gpu-test-{time.monotonic_ns()}"
    out.mkdir()
    yield out
    for p in out.iterdir():
        p.unlink()
    out.rmdir()


def _model(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)


def _torn_race(shm: Path, device: torch.device) -> None:
    """A model of 2 GiB (params + Adam state) on ``device``; optimizer.step right after begin(),
    held back only by the fence in a step pre-hook: the snapshot must equal the pre-step state."""
    model = _model(4096, 8, device)  # 8 x 4096^2 x 4 B = 512 MiB of weights, 1.5 GiB with Adam
    opt = torch.optim.Adam(model.parameters(), lr=1.0)  # lr 1: every element changes visibly
    x = torch.randn(8, 4096, device=device)
    model(x).sum().backward()
    opt.step()
    capture = StateCapture(model=model, optimizer=opt)
    store = RankSnapshotStore(shm_dir=shm, job_id="g", rank=0, num_slots=2)
    try:
        store.prefault(capture.state(1))  # page-locks the slots ahead of use
        expect_w = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        expect_step = [float(s["step"]) for s in opt.state.values()]
        expect_avg = [s["exp_avg"].clone().cpu() for s in opt.state.values()]
        pending = store.begin(1, capture.state(1), deferred=capture.deferrable())
        hook = opt.register_step_pre_hook(lambda *_: pending.fence())
        model(x).sum().backward()
        opt.step()  # right away: the fence is all that holds it back
        hook.remove()
        pending.wait()
        got = store.read(1)
    finally:
        store.close()
    for k, v in expect_w.items():
        assert torch.equal(got["model"][k], v), k
    assert [float(s["step"]) for s in got["optimizer"]["state"].values()] == expect_step
    for g, e in zip(got["optimizer"]["state"].values(), expect_avg, strict=True):
        assert torch.equal(g["exp_avg"], e)


def test_the_snapshot_equals_the_pre_step_state_when_the_step_follows_begin_at_once(shm: Path) -> None:
    torch.cuda.set_device(0)
    _torn_race(shm, torch.device("cuda", 0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_the_same_with_the_model_on_another_device_than_the_current_one(shm: Path) -> None:
    torch.cuda.set_device(0)
    _torn_race(shm, torch.device("cuda", 1))


def test_pinned_capture_bandwidth_against_a_plain_copy(shm: Path) -> None:
    """Device-to-host bandwidth of a snapshot (into page-locked slot memory) against a copy into a
    pinned buffer (the PCIe floor) and into pageable memory. Printed (-s); the snapshot must
    reach at least half the pinned copy's."""
    torch.cuda.init()
    n = 256 << 20  # 1 GiB of float32
    src = torch.randn(n, device="cuda")
    pinned = torch.empty(n, pin_memory=True)
    pageable = torch.empty(n)

    def timed(fn: object) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return (n * 4) / best / 1e9

    store = RankSnapshotStore(shm_dir=shm, job_id="b", rank=0, num_slots=2)
    try:
        store.prefault({"w": src})
        gbps_snap = timed(lambda: store.write(1, {"w": src}))
    finally:
        store.close()
    gbps_pinned = timed(lambda: pinned.copy_(src))
    gbps_pageable = timed(lambda: pageable.copy_(src))
    print(
        f"\nD2H GB/s: snapshot {gbps_snap:.1f}, pinned buffer {gbps_pinned:.1f}, pageable {gbps_pageable:.1f}"
    )
    assert gbps_snap >= 0.5 * gbps_pinned
