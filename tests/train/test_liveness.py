"""Collective-aware liveness with fake device events (issue 20 item 4; train/liveness.py).

On a device an NCCL allreduce returns at enqueue, so the heartbeat's ``coll`` must come from
events recorded around nonstop's own allreduce and polled. Here the events are fakes whose
completion the test sets: a rank whose allreduce event is pending (its own inputs ready) reports
``coll`` and the no-progress rule does not blame it; a rank still computing before the collective,
or past it, is not in one. The DDP part runs a real one-process gloo group in a subprocess (this
test's process never holds a process group)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, cast

import torch

from nonstop.config import DetectorConfig
from nonstop.policy.decisions import RankObservation, find_hung_ranks
from nonstop.protocol.wire import Heartbeat, decode_worker
from nonstop.train.ddp import CanonicalGradSync
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.liveness import CollectiveWatch, device_event
from nonstop.train.position import Position
from nonstop.train.threadprogress import ThreadProgress

CUDA0 = torch.device("cuda", 0)  # only a name: the fakes never touch a device


class FakeEvent:
    """A device event whose completion the test sets."""

    def __init__(self, device: torch.device, *, done: bool = False) -> None:
        self.device = device
        self.done = done

    def query(self) -> bool:
        return self.done


class Factory:
    """Makes fake events, keeping them in order."""

    def __init__(self) -> None:
        self.made: list[FakeEvent] = []

    def __call__(self, device: torch.device) -> FakeEvent:
        self.made.append(FakeEvent(device))
        return self.made[-1]


def _issued(watch: CollectiveWatch) -> tuple[FakeEvent, FakeEvent]:
    """A collective issued on a (fake) device: its ``ready`` and ``done`` events."""
    make = cast(Factory, watch._make)
    watch.before(CUDA0)
    watch.after(CUDA0)
    ready, done = make.made[-2:]
    return ready, done


def test_waiting_on_peers_is_being_in_a_collective() -> None:
    watch = CollectiveWatch(make_event=Factory())
    assert not watch.pending()  # before any collective
    ready, done = _issued(watch)
    assert not watch.pending()  # its own backward still runs on the device: not waiting on peers
    ready.done = True
    assert watch.pending()  # its part is done, the allreduce is not: waiting on its peers
    done.done = True
    assert not watch.pending()  # past the collective


def test_the_newest_collective_counts_and_a_new_generation_forgets() -> None:
    watch = CollectiveWatch(make_event=Factory())
    ready, _ = _issued(watch)
    ready.done = True
    ready2, _ = _issued(watch)  # the next step's allreduce replaces it
    assert not watch.pending()
    ready2.done = True
    assert watch.pending()
    watch.clear()  # a new generation's wrapper: the aborted group's events do not count
    assert not watch.pending()


def test_a_device_that_cannot_answer_is_not_in_a_collective() -> None:
    class Broken(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    watch = CollectiveWatch(make_event=lambda d: Broken(d))
    watch.before(CUDA0)
    watch.after(CUDA0)
    assert not watch.pending() and not watch.pending()  # logged once, never raises


def test_the_cpu_records_no_event() -> None:
    assert device_event(torch.device("cpu")) is None
    watch = CollectiveWatch()  # the real factory
    watch.before(torch.device("cpu"))
    watch.after(torch.device("cpu"))
    assert not watch.pending()


CFG = DetectorConfig(heartbeat_timeout_s=1.0, hang_factor=10, hang_min_s=2.0)


def _seen(now: float, hb: Heartbeat | None) -> RankObservation:
    """A rank 100 s without a step report, as its heartbeat ``hb`` says (None: one out of any
    collective for all of those 100 s, by its own word)."""
    return RankObservation(
        last_heartbeat=now,
        last_progress=now - 100.0,
        collective_pending=hb is not None and hb.coll,
        stepped=True,
        idle_s=100.0 if hb is None else hb.idle_s,
        moving=hb is not None and hb.moving,
    )


def _sync_with_fakes() -> tuple[CanonicalGradSync, Factory]:
    sync = CanonicalGradSync(torch.nn.Linear(3, 2))
    make = Factory()
    sync.watch = CollectiveWatch(make_event=make)
    return sync, make


def test_a_pending_device_event_is_coll_in_the_heartbeat_and_spares_the_rank() -> None:
    sync, make = _sync_with_fakes()
    assert not sync.in_collective()
    sync.watch.before(CUDA0)  # what the comm hook does around the allreduce on a device
    sync.watch.after(CUDA0)
    make.made[0].done = True  # its backward is done; the allreduce waits on a stalled peer
    assert sync.in_collective()
    # the heartbeat of a rank whose host has run ahead (it sits in loss.item(), in its own frames)
    stub = _words(sync=sync, step=7, since_step_s=100.0)
    msg = stub.message().encode()
    assert msg["coll"] is True and msg["idle"] == 0.0  # waiting on a peer: not idle in its own code
    hb = decode_worker(msg)
    assert isinstance(hb, Heartbeat) and hb.coll
    # the coordinator: both ranks silent in progress for 100 s; only the one not waiting is blamed
    now = 1000.0
    hung = find_hung_ranks({0: _seen(now, hb), 1: _seen(now, None)}, now=now, median_step_s=0.1, config=CFG)
    assert list(hung) == [1]
    make.made[1].done = True  # the allreduce completed
    assert not stub.message().encode()["coll"]


def _words(
    *, sync: CanonicalGradSync | None, step: int, since_step_s: float, step_s: float | None = None
) -> HeartbeatWords:
    """The heartbeat of a rank at ``step`` whose last step (``step_s`` long) completed
    ``since_step_s`` ago, watching ``sync``."""
    words = HeartbeatWords(Position(step=step))
    words.watch_collectives(sync=sync, clock=None, frwatch=None)
    words.progressed(time.monotonic() - since_step_s)
    words.last_step_s = step_s
    return words


def _beat(stub: HeartbeatWords) -> Heartbeat:
    hb = decode_worker(stub.message().encode())
    assert isinstance(hb, Heartbeat)
    return hb


def test_a_rank_that_waited_long_for_a_slow_peer_is_not_blamed_as_it_leaves_the_collective() -> None:
    """Found in the loaded CI (test_straggler_e2e, test_migration_e2e): a healthy rank that had
    waited ~3 s in the gradient allreduce for a starved peer was killed as hung the moment it
    left it -- asleep in the demo's pace, "no step progress for 3.4s (limit 3.00s)" -- because
    its heartbeat's idle counted the wait as its own stall. Idle now runs from the later of its
    last step and the last moment it was in a collective: exactly (a DDP rank: the allreduce's
    return), from the sampler of a sharded model's waits, or as the heartbeat saw it."""
    now = time.monotonic()
    sync = CanonicalGradSync(torch.nn.Linear(3, 2))
    stub = _words(sync=sync, step=7, since_step_s=time.monotonic() - (now - 100.0), step_s=0.3)
    # out of any collective for all of the 100 s: blamed (the rule as before)
    hb = _beat(stub)
    assert not hb.coll and hb.idle_s is not None and hb.idle_s >= 100.0
    assert list(find_hung_ranks({0: _seen(now, hb)}, now=now, median_step_s=0.1, config=CFG)) == [0]
    # it waited in the allreduce until just now (the rank's step clock still says 100 s)
    sync.left_at = time.monotonic()
    hb = _beat(stub)
    assert not hb.coll and hb.idle_s is not None and hb.idle_s < 1.0
    assert find_hung_ranks({0: _seen(now, hb)}, now=now, median_step_s=0.1, config=CFG) == {}
    # a sharded model: the sampler of its waits saw it inside a collective just now
    stub.sync, stub.clock = None, cast(Any, SimpleNamespace(inside_at=time.monotonic()))
    hb = _beat(stub)
    assert hb.idle_s is not None and hb.idle_s < 1.0
    # with neither: the heartbeat itself saw it in one (an FSDP2 all-gather, a pending event)
    stub.clock = None
    sync.pending_since = time.monotonic()
    stub.sync, sync.left_at = sync, None
    assert _beat(stub).coll
    sync.pending_since = None  # it returned; the next heartbeat counts idle from the last one
    hb = _beat(stub)
    assert not hb.coll and hb.idle_s is not None and hb.idle_s < 1.0


def _asleep_in_a_lock(lock: Any) -> None:
    lock.acquire()  # blocks: a stuck rank's main thread


def _busy(stop: list[bool]) -> None:
    n = 0
    while not stop:
        n = (n * 31 + 7) % 1000003  # a starved rank's main thread: running, slowly


def test_the_heartbeat_says_whether_the_training_thread_moves_and_where_it_is() -> None:
    """The detector gives a moving rank (its training thread uses the CPU or waits for one: slow
    on a starved machine, not stuck) the longer limit and records where a blamed rank's training thread was
    (policy/decisions.py, coordinator/detector.py)."""
    import threading

    lock = threading.Lock()
    lock.acquire()
    stuck = threading.Thread(target=_asleep_in_a_lock, args=(lock,), daemon=True)
    stop: list[bool] = []
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    stuck.start()
    busy.start()
    try:
        time.sleep(0.1)

        def stub(thread: threading.Thread) -> HeartbeatWords:
            assert thread.ident is not None
            words = _words(sync=None, step=3, since_step_s=5.0)
            clock = time.pthread_getcpuclockid(thread.ident)
            words.watch_thread(thread.ident, ThreadProgress(clock, thread.native_id))
            return words

        s = stub(stuck)
        s.message().encode()
        time.sleep(0.05)
        msg = s.message().encode()
        assert msg["moving"] is False and msg["at"].endswith("_asleep_in_a_lock"), msg
        b = stub(busy)
        b.message().encode()
        time.sleep(0.05)
        assert b.message().encode()["moving"] is True
        hb = decode_worker({**msg, "moving": True, "at": "x" * 1000})
        assert isinstance(hb, Heartbeat) and hb.moving and hb.at == "x" * 200
    finally:
        stop.append(True)
        lock.release()
        busy.join(5)
        stuck.join(5)


DDP = """
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
from nonstop.train.ddp import CanonicalGradSync, foreign_allreduce_pending, register_canonical_hook, wrap_ddp
from nonstop.train.liveness import CollectiveWatch

class Fake:
    def __init__(self, grad_at_record):
        self.grad, self.done = grad_at_record, False
    def query(self):
        return self.done

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
out = {}
for how in ("wrap", "foreign"):
    made = []
    def make(device):  # records the weight's gradient as seen when the event is recorded
        g = model.weight.grad
        made.append(Fake(None if g is None else g.abs().sum().item()))
        return made[-1]
    model.zero_grad(set_to_none=True)
    sync = CanonicalGradSync(model)
    sync.watch = CollectiveWatch(make_event=make)
    if how == "wrap":
        ddp = wrap_ddp(model, sync, dist.group.WORLD)
    else:
        plain = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1.0)
        ddp, _ = plain, register_canonical_hook(plain, sync)
    before = time.monotonic()
    ddp(torch.randn(3, 4)).sum().backward()
    left = sync.left_at is not None and before <= sync.left_at <= time.monotonic()
    after_step = sync.in_collective()
    made[0].done = True  # ready reached, done not: a device allreduce waiting on a peer
    pending = sync.in_collective()
    foreign = foreign_allreduce_pending()
    made[1].done = True
    grad = model.weight.grad.abs().sum().item()
    out[how] = {"events": len(made), "grad_at_done": made[1].grad, "grad": grad,
                "after_step": after_step, "pending": pending, "left": left, "foreign": foreign,
                "done": sync.in_collective()}
    sync.hook(dist.group.WORLD)  # a new wrapper (generation) forgets the events
    made[0].done, made[1].done = True, False
    out[how]["after_rewrap"] = sync.in_collective()
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_the_canonical_sync_records_ready_before_and_done_after_its_allreduce(tmp_path: Any) -> None:
    res = subprocess.run(
        [sys.executable, "-c", DDP, str(tmp_path / "rdzv")], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    for how in ("wrap", "foreign"):
        s = seen[how]
        # one pair per allreduce; done recorded after the unpack (the gradients are already there)
        assert s["events"] == 2 and s["grad_at_done"] == s["grad"] > 0, (how, s)
        assert s["left"] is True, (how, s)  # when the allreduce returned (the heartbeat's idle)
        assert s["after_step"] is False  # fakes start incomplete: ready pending = still computing
        assert s["pending"] is True and s["done"] is False and s["after_rewrap"] is False, (how, s)
    assert seen["wrap"]["foreign"] is False and seen["foreign"]["foreign"] is True
