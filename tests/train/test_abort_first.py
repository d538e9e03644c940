"""Abort before interrupt (issue 20): when a recovery's reconfigure reaches a rank inside a step, the
reader thread first aborts the generation's group -- gloo's sockets shut, a device backend's
communicators aborted (NCCL ``abort``, here a fake) -- and only then signals the main thread, so a
main thread blocked on the device has returned to Python when the interrupt arrives; a step that
completes on an aborted group is never snapshotted."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType, SimpleNamespace

import pytest

from nonstop.train import link as link_mod
from nonstop.train.group import GenerationGroup
from nonstop.train.link import CoordinatorLink, severs
from tests.worker_fakes import order


class FakeDeviceBackend:
    """What ``ProcessGroup._get_backend(cuda)`` gives: only ``abort`` matters here."""

    def __init__(self, log: list[str], *, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def abort(self) -> None:
        self.log.append("abort")
        if self.fail:
            raise RuntimeError("NCCL error: invalid usage")


@pytest.fixture
def usr1_log() -> Iterator[list[str]]:
    log: list[str] = []

    def handler(_signum: int, _frame: FrameType | None) -> None:
        log.append("interrupt")

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield log
    finally:
        signal.signal(signal.SIGUSR1, old)


def _reader_reacts(group: GenerationGroup, *, sever: bool) -> None:
    link = SimpleNamespace(
        _sever=group.sever, _settle_store=None, _can_interrupt=True, _main_ident=threading.main_thread().ident
    )
    msg = order({"t": "reconfigure", "gen": 2, **({"recovery": True} if sever else {"live": True})})
    reader = threading.Thread(target=CoordinatorLink._leave_step_now, args=(link, msg))
    reader.start()
    reader.join()
    signal.sigtimedwait([], 0)  # let the main thread run the pending handler (no-op wait)


def test_a_recovery_aborts_the_device_communicators_before_it_interrupts(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log)
    assert not group.severed
    _reader_reacts(group, sever=True)
    assert usr1_log == ["abort", "interrupt"]
    assert group.severed  # the loop will not snapshot a step that completes on this group


def test_a_live_swap_interrupts_without_aborting(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log)
    _reader_reacts(group, sever=False)
    assert usr1_log == ["interrupt"] and not group.severed


def test_a_failing_abort_does_not_stop_the_interrupt(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log, fail=True)
    _reader_reacts(group, sever=True)
    assert usr1_log == ["abort", "interrupt"] and group.severed


def test_a_cpu_group_has_no_device_backend_to_abort() -> None:
    group = GenerationGroup()
    group.sever()  # nothing joined: no sockets, no device backend
    assert group.severed and group._device_backend is None


def test_every_reconfigure_but_a_live_swaps_severs_a_rank_found_in_a_step() -> None:
    """A re-plan's peers leave wherever they are, and a sharded job's peer that left at a boundary
    parks its mesh groups with their sockets open: a rank blocked in the next step's all-gather
    would wait on it until the stage timed out (an HSDP job under a CPU load), so it severs too."""
    assert severs(order({"t": "reconfigure", "recovery": True}))
    assert severs(order({"t": "reconfigure", "recovery": False}))  # a re-plan (a resync, a replan)
    assert severs(order({"t": "reconfigure", "recovery": False, "prepare": True}))  # a joiner: no group yet
    assert not severs(order({"t": "reconfigure", "recovery": False, "live": True}))  # every rank paused
    assert severs(order({"t": "leave", "gen": 2, "recovery": True}))  # a failure's leave


def test_a_reconfigure_stuck_behind_a_step_severs_it_after_the_dump(
    monkeypatch: pytest.MonkeyPatch, usr1_log: list[str]
) -> None:
    """A live swap's reconfigure does not sever; should it find a rank in a step that cannot finish,
    the heartbeat thread severs once the reconfigure has waited STUCK_DUMP_S (then the interrupt
    sent at its arrival is raised as soon as the collective fails)."""
    monkeypatch.setattr(link_mod, "STUCK_DUMP_S", 0.0)
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log)
    link = SimpleNamespace(
        _arrived=1, _taken=0, _stuck_since=None, _dumped=False, in_step=True, _sever=group.sever
    )
    CoordinatorLink._dump_if_stuck(link)  # type: ignore[arg-type]
    assert not group.severed  # the first look only starts the clock
    time.sleep(0.01)
    CoordinatorLink._dump_if_stuck(link)  # type: ignore[arg-type]
    assert group.severed and usr1_log == ["abort"]
    link._dumped, link.in_step, group._severed = False, False, False
    CoordinatorLink._dump_if_stuck(link)  # type: ignore[arg-type]
    assert not group.severed  # out of the step: nothing to sever, the loop takes it


class _FakePG:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def _get_backend(self, device: object) -> FakeDeviceBackend:
        self.log.append(f"{self.name}:{device}")
        return FakeDeviceBackend(self.log)

    def rank(self) -> int:
        return 0


def test_a_device_nodes_recovery_aborts_every_mesh_groups_own_communicators(usr1_log: list[str]) -> None:
    """On a device node each mesh group has communicators of its own, which aborting the default
    group's does not reach: a recovery aborts the world's and those of each group with a lost
    rank, and leaves the others open -- independent groups (not split from the world) share
    nothing with it (the split path's keeping is tests/train/test_devicegroups.py)."""
    from nonstop.train.abort import SocketWatch
    from nonstop.train.meshgroups import _Group

    def fresh() -> GenerationGroup:
        group = GenerationGroup()
        group._device_backend = FakeDeviceBackend(usr1_log)
        mesh = group.mesh_groups
        mesh._device_type = "cuda"
        for dim, ranks in (("shard", [0, 1]), ("replicate", [0, 2])):
            watch = SocketWatch()
            watch.stop()
            mesh._groups[dim] = _Group(_FakePG(usr1_log, dim), f"1:{dim}", watch, ranks)
        return group

    group = fresh()
    left = group.sever(lost=[3])  # neither group has rank 3: both stay open, the world is aborted
    assert sorted(g.dim for g in left) == ["replicate", "shard"]
    assert usr1_log == ["abort"]
    assert not any(g.severed for g in group.mesh_groups._groups.values())
    usr1_log.clear()
    group = fresh()
    assert [g.dim for g in group.sever(lost=[1])] == ["replicate"]  # {0, 1} had rank 1: aborted
    assert usr1_log == ["abort", "shard:cuda", "abort"]
    usr1_log.clear()
    assert fresh().sever(lost=None) == []  # a full sever: every group's communicators
    assert usr1_log == ["abort", "shard:cuda", "abort", "replicate:cuda", "abort"]
