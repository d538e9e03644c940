"""Fakes of a worker session's collaborators for unit tests of the others (train/rejoin.py,
train/reports.py, train/loop.py): a coordinator link that records what is sent and answers from a script, a
rank's snapshot slots, a process group and a trainee."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nonstop.control.channel import Message
from nonstop.protocol.worker import WorkerOrder, decode_order
from nonstop.snapshot import StateCapture


def order(msg: Message) -> Any:
    """``msg`` as the worker's reader decodes it; a reconfigure given without a rank or a world
    size (fields a test does not care for) plays rank 0 of 1 in generation 0."""
    if msg.get("t") == "reconfigure":
        msg = {"gen": 0, "rank": 0, "world_size": 1, **msg}
    decoded = decode_order(msg)
    assert decoded is not None, msg
    return decoded


class FakeLink:
    """CoordinatorLink as the main thread uses it: ``replies`` answers ``wait_for`` in order
    (each must be of a kind asked for), ``inbox`` what ``poll_reconfigure`` finds."""

    def __init__(self, replies: list[Message] | None = None) -> None:
        self.replies = list(replies or [])
        self.inbox: list[Message] = []
        self.sent: list[Message] = []
        self.quiet: list[Message] = []
        self.settled: list[tuple[Any, int | None]] = []
        self.pause_at: int | None = None
        self.leave_gen: int | None = None
        self.rdzv: Any = None
        self.opened: list[tuple[int, float]] = []
        self.in_step = False
        self.entered = 0  # enter_step calls
        self.closing = False

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def send_quietly(self, msg: Message) -> None:
        self.quiet.append(msg)

    def wait_for(self, *kinds: type[Any]) -> WorkerOrder:
        msg = order(self.replies.pop(0))
        assert type(msg) in kinds, (msg, kinds)
        return msg  # type: ignore[no-any-return]

    def poll_reconfigure(self) -> Any:
        return order(self.inbox.pop(0)) if self.inbox else None

    def leaving(self, generation: int) -> bool:
        return self.leave_gen == generation

    def post_settled(self, claims: Any, gen: int | None = None) -> None:
        self.settled.append((claims, gen))

    def open_rdzv(self, gen: int, timeout_s: float) -> Any:
        self.opened.append((gen, timeout_s))
        self.rdzv = object()
        return self.rdzv

    def drop_rdzv(self, why: str) -> None:
        self.rdzv = None

    def enter_step(self) -> None:
        self.in_step = True
        self.entered += 1

    def kinds(self) -> list[str]:
        return [m["t"] for m in self.sent]


class FakeWrite:
    """A snapshot write in flight: its completion callbacks run at :meth:`complete`."""

    def __init__(self, step: int, nbytes: int) -> None:
        self.step, self.nbytes = step, nbytes
        self._then: list[Callable[[], None]] = []

    def on_complete(self, fn: Callable[[], None]) -> None:
        self._then.append(fn)

    def complete(self) -> None:
        for fn in self._then:
            fn()


class FakeSlots:
    """LoopSnapshots: every ``every``-th step due (and the run's last and a boundary), writes
    recorded; ``live`` is itself (the store's drain and clear)."""

    def __init__(self, *, every: int = 1) -> None:
        self.every = every
        self.may_skip = every > 1
        self.taken: int | None = None
        self.takes: list[FakeWrite] = []
        self.writes: list[tuple[int, int]] = []  # (step, generation)
        self.opened: list[int] = []
        self.events: list[str] = []
        self.waited = 0.0
        self.held: dict[int, Any] = {}  # the states read() finds, by step
        self.live = self

    def due(self, step: int, *, final: bool, pause_at: int | None) -> bool:
        return step % self.every == 0 or final or (pause_at is not None and step >= pause_at)

    def take(self, step: int, capture: StateCapture, gen: int) -> FakeWrite:
        self.taken = step
        self.takes.append(FakeWrite(step, 100))
        return self.takes[-1]

    def waited_s(self) -> float:
        out, self.waited = self.waited, 0.0
        return out

    def write(self, step: int, capture: StateCapture, gen: int) -> None:
        self.writes.append((step, gen))

    def prefault(self, capture: StateCapture, step: int) -> int:
        self.events.append(f"prefault {step}")
        return 2

    def open(self, rank: int) -> None:
        self.opened.append(rank)

    def read(self, step: int, *, copy: bool = True) -> Any:
        self.events.append(f"read {step}")
        return self.held[step]

    def drain(self) -> None:
        self.events.append("drain")

    def clear(self) -> None:
        self.events.append("clear")

    def close(self) -> None:
        self.events.append("close")


class FakeGroup:
    def __init__(self) -> None:
        self.destroyed: list[bool] = []
        self.settles: list[Any] = []
        self.severed = False

    def destroy(self, *, at_boundary: bool = False) -> list[Any]:
        self.destroyed.append(at_boundary)
        return []

    def settle(self, lost: Any) -> list[Any]:
        self.settles.append(lost)
        return []


class FakeTrainee:
    """A data-parallel trainee on a real model: ``join`` records its arguments (and raises
    ``fail`` once, when given)."""

    restore_in_group = False
    sync = None

    def __init__(self, fail: BaseException | None = None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.capture = StateCapture(model=self.model, optimizer=None)
        self.bare = self.model
        self.joins: list[dict[str, Any]] = []
        self.fail = fail
        self.closed = False

    def join(self, group: Any, store: Any, **kw: Any) -> torch.nn.Module:
        self.joins.append(kw)
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        return self.model

    def close(self) -> None:
        self.closed = True


class FakeFaults:
    def __init__(self) -> None:
        self.asked: list[tuple[str, int, int, int]] = []
        self.stretched = 0
        self.observed: list[float] = []

    def maybe_fire(self, phase: str, *, rank: int, step: int, generation: int) -> None:
        self.asked.append((phase, rank, step, generation))

    def stretch(self) -> None:
        self.stretched += 1

    def observe(self, compute_s: float) -> None:
        self.observed.append(compute_s)
