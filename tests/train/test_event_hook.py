"""The event hook (``Session.on_event``): the coordinator's feed (coordinator/event_feed.py), the worker's
queue and delivery (train/eventhooks.py), the subscribe message, and the logger adapters
(nonstop/loggers.py) against fakes. The real job with the real TensorBoard writer is in
tests/e2e/test_event_hook_e2e.py."""

from __future__ import annotations

import sys
import threading
import time
import types
from typing import Any

import pytest

from nonstop import events as ev
from nonstop.control.channel import Message
from nonstop.coordinator.event_feed import EventFeed
from nonstop.errors import ControlError, UsageError
from nonstop.events.hook import Committed
from nonstop.loggers import EventTally, TensorBoardHook, WandbHook, event_record
from nonstop.protocol import wire
from nonstop.protocol.worker import EventMsg
from nonstop.train.eventhooks import EventHooks
from tests.coord_fakes import FakeClock

RECOVERY = ev.Recovery(
    ts=100.0, failure_kind="kill", rank=1, step=15, detail="", detect_s=0.05,
    stages={"detect": 0.05, "plan": 0.01, "restore": 0.2, "rebuild": 0.1, "resume": 0.02},
    training_again_s=0.3, mttr_s=0.38, lost_steps=1, restore_step=14, replacement="spare",
    generation=2, replans=0,
)  # fmt: skip
FAILURE = ev.Failure(ts=99.6, failure_kind="kill", rank=1, spawn_id=3, detail="", step=15, detect_s=0.05)


class FakeChan:
    """A worker's channel: records what is sent; ``gate`` (when set) holds every send."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.closed = False
        self.gate: threading.Event | None = None

    def send(self, msg: Message) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if self.closed:
            raise ControlError("closed")
        self.sent.append(msg)


def _kinds(chan: FakeChan) -> list[str]:
    return [m["event"]["event"] for m in chan.sent]


# -- the coordinator's feed ------------------------------------------------------------------------
def test_feed_sends_only_to_subscribers_the_kinds_they_asked_for() -> None:
    feed = EventFeed()
    feed.on_event(FAILURE)  # nobody subscribed yet: nothing queued, nothing sent
    everything, some, silent = FakeChan(), FakeChan(), FakeChan()
    feed.subscribe(1, everything, None)
    feed.subscribe(2, some, ["recovery"])
    for e in (FAILURE, RECOVERY, ev.Finish(ts=101.0, step=20, generation=2)):
        feed.on_event(e)
    assert feed.flush(5)
    assert _kinds(everything) == ["failure", "recovery", "finish"]
    assert _kinds(some) == ["recovery"] and silent.sent == []
    assert some.sent[0] == {"t": "event", "event": RECOVERY.to_json()}  # the log's line, as is
    feed.close()


def test_feed_drops_a_dead_subscriber_and_takes_a_resubscription() -> None:
    feed = EventFeed()
    old = FakeChan()
    feed.subscribe(7, old, None)
    old.closed = True
    feed.on_event(FAILURE)
    assert feed.flush(5) and feed.subscribers == ()  # its process is gone
    new = FakeChan()
    feed.subscribe(7, new, None)  # a reconnect (store mode) or a new process subscribes again
    feed.on_event(RECOVERY)
    assert feed.flush(5) and _kinds(new) == ["recovery"]
    feed.close()


def test_a_subscriber_that_does_not_read_never_holds_the_coordinator() -> None:
    feed = EventFeed(max_pending=10)
    stuck = FakeChan()
    stuck.gate = threading.Event()  # a process stopped mid-read: every send blocks
    feed.subscribe(1, stuck, None)
    t0 = time.monotonic()
    for _ in range(100):
        feed.on_event(FAILURE)
    assert time.monotonic() - t0 < 0.5  # the logging thread only queued
    assert feed.dropped >= 89  # the queue held 10, the sender thread at most one more
    stuck.gate.set()
    assert feed.flush(5) and 1 <= len(stuck.sent) <= 11
    feed.close()


def test_committed_is_sent_when_it_moves_at_most_once_per_interval() -> None:
    clock = FakeClock(monotonic=0.0)
    feed = EventFeed(committed_every_s=1.0, clock=clock)
    chan = FakeChan()
    feed.tick(committed=3, generation=1, world_size=2)  # no subscriber: nothing
    feed.subscribe(1, chan, ["committed"])
    feed.tick(committed=3, generation=1, world_size=2)
    clock.now = 0.5
    feed.tick(committed=5, generation=1, world_size=2)  # too soon
    clock.now = 1.1
    feed.tick(committed=5, generation=1, world_size=2)
    clock.now = 3.0
    feed.tick(committed=5, generation=1, world_size=2)  # did not move
    assert feed.flush(5)
    got = [ev.decode(m["event"]) for m in chan.sent]
    assert [(c.step, c.world_size) for c in got if isinstance(c, Committed)] == [(3, 2), (5, 2)]
    assert {c.ts for c in got if isinstance(c, Committed)} == {clock.unix}  # the clock's wall time
    feed.close()


def test_subscribe_message_is_typed_at_the_edge() -> None:
    assert wire.decode_worker({"t": "subscribe", "kinds": None}) == wire.Subscribe(kinds=None)
    assert wire.decode_worker({"t": "subscribe", "kinds": ["recovery"]}) == wire.Subscribe(
        kinds=("recovery",)
    )
    with pytest.raises(wire.WireError, match="kinds"):
        wire.decode_worker({"t": "subscribe", "kinds": "recovery"})


# -- the worker's queue and delivery -----------------------------------------------------------------
def _msg(e: ev.Event) -> EventMsg:
    return EventMsg(event=e.to_json())


def test_thread_delivery_in_order_and_a_slow_callback_never_blocks_the_reader() -> None:
    hooks = EventHooks()
    got: list[ev.Event] = []
    release = threading.Event()

    def slow(e: ev.Event) -> None:
        release.wait(10)
        got.append(e)

    assert hooks.add(slow, kinds=None, deliver="thread", max_pending=5) is None
    t0 = time.monotonic()
    for i in range(20):
        hooks.put(_msg(ev.Finish(ts=float(i), step=i, generation=1)))
    assert time.monotonic() - t0 < 0.5
    assert hooks.dropped >= 14  # bounded: the oldest went
    release.set()
    assert hooks.flush(5)
    steps = [e.step for e in got if isinstance(e, ev.Finish)]
    assert steps == sorted(steps) and steps[-1] == 19  # the newest kept, in order


def test_step_delivery_filters_and_survives_a_raising_callback() -> None:
    hooks = EventHooks()
    seen: list[str] = []

    def bad(e: ev.Event) -> None:
        raise RuntimeError("logger broke")

    assert hooks.add(bad, kinds=["failure"], deliver="step", max_pending=100) == ["failure"]
    assert hooks.add(lambda e: seen.append(e.event), kinds=("recovery", "committed"), deliver="step",
                     max_pending=100) == ["committed", "failure", "recovery"]  # fmt: skip
    for e in (FAILURE, RECOVERY, Committed(ts=1.0, step=3, generation=1, world_size=2)):
        hooks.put(_msg(e))
    assert seen == []  # nothing until the loop delivers, between two steps
    assert hooks.deliver_pending() == 3
    assert seen == ["recovery", "committed"] and hooks.delivered == 3
    with pytest.raises(UsageError, match="by 'step' already"):
        hooks.add(print, kinds=None, deliver="thread", max_pending=10)
    with pytest.raises(UsageError):
        EventHooks().add(print, kinds=None, deliver="later", max_pending=10)
    with pytest.raises(UsageError):
        EventHooks().add("not callable", kinds=None, deliver="thread", max_pending=10)  # type: ignore[arg-type]


# -- the adapters -------------------------------------------------------------------------------------
def test_event_records() -> None:
    tally = EventTally()
    f = event_record(FAILURE, tally)
    assert (
        f is not None and f.step == 15 and f.scalars == {"failures": 1} and "kill of rank 1" in (f.text or "")
    )
    r = event_record(RECOVERY, tally)
    assert r is not None and r.step == 14
    assert (
        r.scalars["mttr_s"] == 0.38
        and r.scalars["lost_steps"] == 1
        and r.scalars["recovery/restore_s"] == 0.2
    )
    assert r.text is not None and "recovered in 0.380s" in r.text
    shrink = ev.Shrink(
        ts=1.0, world_size=2, old_world_size=3, dropped=[1], renumbered={}, shards={}, reason="no spare"
    )
    s = event_record(shrink, tally)
    assert (
        s is not None
        and s.step == 14
        and s.scalars == {"world_size": 2}
        and s.text == "shrink: 3 -> 2 ranks (no spare)"
    )
    assert event_record(ev.Spawned(ts=1.0, spawn_id=1, pid=2, node="0"), tally) is None  # nothing to log


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int | None, float | None]] = []
        self.texts: list[tuple[str, str, int | None]] = []
        self.flushes = 0

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None,
                   walltime: float | None = None) -> None:  # fmt: skip
        self.scalars.append((tag, scalar_value, global_step, walltime))

    def add_text(self, tag: str, text_string: str, global_step: int | None = None,
                 walltime: float | None = None) -> None:  # fmt: skip
        self.texts.append((tag, text_string, global_step))

    def flush(self) -> None:
        self.flushes += 1


def test_tensorboard_hook_writes_scalars_and_text_at_the_events_step_and_time() -> None:
    w = FakeWriter()
    hook = TensorBoardHook(w)
    hook(FAILURE)
    hook(RECOVERY)
    hook(ev.Spawned(ts=1.0, spawn_id=1, pid=2, node="0"))
    assert ("nonstop/failures", 1, 15, 99.6) in w.scalars
    assert ("nonstop/mttr_s", 0.38, 14, 100.0) in w.scalars
    assert [t[0] for t in w.texts] == ["nonstop/events", "nonstop/events"] and w.flushes == 2


def test_wandb_hook_imports_wandb_lazily_and_logs_against_its_own_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(sys, "path", [])  # no wandb to import
    with pytest.raises(UsageError, match="pip install wandb"):
        WandbHook()
    calls: list[tuple[str, Any, Any]] = []

    class Run:
        def define_metric(self, name: str, **kw: Any) -> None:
            calls.append(("define_metric", name, kw))

        def log(self, data: dict[str, Any], commit: bool | None = None) -> None:
            calls.append(("log", data, commit))

    fake = types.ModuleType("wandb")
    fake.run = None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with pytest.raises(UsageError, match=r"wandb\.init"):
        WandbHook()
    fake.run = Run()  # type: ignore[attr-defined]
    hook = WandbHook()
    hook(RECOVERY)
    assert calls[:2] == [
        ("define_metric", "nonstop/step", {}),
        ("define_metric", "nonstop/*", {"step_metric": "nonstop/step"}),
    ]
    (_, data, commit) = calls[2]
    assert commit is False and data["nonstop/step"] == 14 and data["nonstop/mttr_s"] == 0.38
    assert "recovered" in data["nonstop/event"]
