"""Abort before interrupt (issue 20): when a recovery's reconfigure reaches a rank inside a step, the
reader thread first aborts the generation's group -- gloo's sockets shut, a device backend's
communicators aborted (NCCL ``abort``, here a fake) -- and only then signals the main thread, so a
main thread blocked on the device has returned to Python when the interrupt arrives; a step that
completes on an aborted group is never snapshotted."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from types import FrameType, SimpleNamespace

import pytest

from nonstop.train.group import GenerationGroup
from nonstop.train.link import CoordinatorLink


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


def _reader_reacts(group: GenerationGroup, *, recovery: bool) -> None:
    link = SimpleNamespace(_sever=group.sever, _can_interrupt=True, _main_ident=threading.main_thread().ident)
    reader = threading.Thread(
        target=CoordinatorLink._leave_step_now, args=(link,), kwargs={"recovery": recovery}
    )
    reader.start()
    reader.join()
    signal.sigtimedwait([], 0)  # let the main thread run the pending handler (no-op wait)


def test_a_recovery_aborts_the_device_communicators_before_it_interrupts(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log)
    assert not group.severed
    _reader_reacts(group, recovery=True)
    assert usr1_log == ["abort", "interrupt"]
    assert group.severed  # the loop will not snapshot a step that completes on this group


def test_a_live_swap_interrupts_without_aborting(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log)
    _reader_reacts(group, recovery=False)
    assert usr1_log == ["interrupt"] and not group.severed


def test_a_failing_abort_does_not_stop_the_interrupt(usr1_log: list[str]) -> None:
    group = GenerationGroup()
    group._device_backend = FakeDeviceBackend(usr1_log, fail=True)
    _reader_reacts(group, recovery=True)
    assert usr1_log == ["abort", "interrupt"] and group.severed


def test_a_cpu_group_has_no_device_backend_to_abort() -> None:
    group = GenerationGroup()
    group.sever()  # nothing joined: no sockets, no device backend
    assert group.severed and group._device_backend is None
