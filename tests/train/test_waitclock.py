"""CollectiveClock: a sharded model's time in collectives, sampled (train/waitclock.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.elastic.utils.store as store_util

from nonstop.train.waitclock import CollectiveClock, CollectiveWaits


def test_a_look_charges_the_time_since_the_last_only_inside_and_at_most_two_periods() -> None:
    clock = CollectiveClock(threading.get_ident(), period_s=3600.0)  # the thread never looks
    try:
        clock.look(0.004, inside=True)
        clock.look(0.004, inside=False)
        clock.look(10_000.0, inside=True)  # a late look: two periods at most
        assert clock.take_wait_s() == pytest.approx(0.004 + 7200.0)
        assert clock.take_wait_s() == 0.0  # taken
    finally:
        clock.close()


def test_a_bad_period_is_refused() -> None:
    with pytest.raises(ValueError, match="period_s"):
        CollectiveClock(threading.get_ident(), period_s=0)


def test_it_sees_a_thread_blocked_in_torch_distributed_and_not_one_computing() -> None:
    """A thread waits ~0.4 s in torch.distributed's store barrier (the other party arrives late:
    the innermost Python frame is torch's, blocked in a C++ wait, as in a collective), then
    computes ~0.4 s: the clock charges the wait -- at most the wait plus two periods (a starved
    machine may charge less, never the compute) -- and remembers its last look inside."""
    store = dist.HashStore()
    timing: dict[str, float] = {}
    clocks: list[CollectiveClock] = []

    def waiter() -> None:
        clocks.append(CollectiveClock(threading.get_ident()))
        t0 = time.monotonic()
        store_util.barrier(store, 2, "b", barrier_timeout=60)
        timing["wait"] = time.monotonic() - t0
        timing["left"] = time.monotonic()
        end = time.monotonic() + 0.4
        x = torch.ones(64, 64)
        while time.monotonic() < end:
            x = (x @ x).clamp(-1, 1)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.4)
    store_util.barrier(store, 2, "b", barrier_timeout=60)
    t.join()
    (clock,) = clocks
    try:
        wait = clock.take_wait_s()
        assert 0.0 < wait <= timing["wait"] + 2 * clock.period_s, (wait, timing)
        # the last look inside the barrier: the heartbeat's idle runs from there, not the compute
        assert clock.inside_at is not None and clock.inside_at <= timing["left"], (clock.inside_at, timing)
    finally:
        clock.close()


def test_the_loops_waits_come_from_the_stamped_allreduce_else_a_clock_of_its_own() -> None:
    stamped = SimpleNamespace(take_wait_s=lambda: 0.75)
    ddp = CollectiveWaits(cast(Any, stamped), threading.get_ident())
    assert ddp.clock is None and ddp.take_wait_s() == 0.75  # no sampler thread for a DDP model
    sharded = CollectiveWaits(None, threading.get_ident())
    clock = sharded.clock
    assert clock is not None and clock._thread.is_alive()
    clock.look(0.001, True)
    assert sharded.take_wait_s() == 0.001 and sharded.take_wait_s() == 0.0
    sharded.close()
    assert sharded.clock is None and not clock._thread.is_alive() and sharded.take_wait_s() == 0.0
