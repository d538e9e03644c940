"""The heartbeat's words (train/heartbeat.py) as an object of its own: the step it reads from the
loop's position, idle from the later of the last step and the last collective it saw, and what
it says only once it watches the training thread. (Its collectives' sources: test_liveness.py,
test_frwatch.py.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, cast

from nonstop.protocol.wire import Heartbeat, decode_worker
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.position import Position


def test_it_reports_the_loops_current_step_and_idle_since_the_last_one() -> None:
    pos = Position(step=4)
    words = HeartbeatWords(pos)
    words.stepped(time.monotonic() - 2.0, 0.25)
    msg = words.message().encode()
    assert msg["t"] == "hb" and msg["step"] == 4 and msg["coll"] is False and msg["idle"] >= 2.0
    assert "moving" not in msg and "at" not in msg  # no training thread named yet
    pos.step = 5  # a restore moved the loop: the next heartbeat says so
    words.progressed()
    msg = words.message().encode()
    assert msg["step"] == 5 and msg["idle"] < 1.0
    assert isinstance(decode_worker(msg), Heartbeat)


def test_idle_runs_from_the_last_collective_the_heartbeat_saw() -> None:
    words = HeartbeatWords(Position())
    words.progressed(time.monotonic() - 50.0)
    inside = SimpleNamespace(in_collective=lambda: True, left_at=None)
    words.watch_collectives(sync=cast(Any, inside), clock=None, frwatch=None)
    assert words.message().encode() == {"t": "hb", "coll": True, "step": 0, "idle": 0.0}
    words.sync = None  # the allreduce returned, with no stamp of when: counted from this look
    msg = words.message().encode()
    assert msg["coll"] is False and msg["idle"] < 1.0


def test_once_it_watches_the_training_thread_it_says_where_that_thread_is() -> None:
    words = HeartbeatWords(Position())
    words.watch_thread(threading.get_ident(), words.thread_progress)
    msg = words.message().encode()
    assert msg["at"].startswith("train/heartbeat.py:") and msg["at"].endswith(" message")
