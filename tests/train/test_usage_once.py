"""A worker's mistake that failed the job is printed once, by ``nonstop run`` (issue 46, item 6):
the worker that raised it prints nothing once the coordinator's abort carries its line
(train/session.py ``_fail_usage``, the worker's excepthook)."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest

from nonstop.errors import UsageError
from nonstop.protocol.worker import AbortMsg, CadenceMsg
from nonstop.train.session import Session, _one_line_usage_errors


class _Link:
    """The two calls ``_fail_usage`` makes, with the abort the coordinator would send."""

    def __init__(self, abort: str | None) -> None:
        self.abort = abort
        self.sent: list[dict[str, Any]] = []

    def send_quietly(self, msg: dict[str, Any]) -> None:
        self.sent.append(msg)

    def await_abort(self, timeout_s: float) -> str | None:
        return self.abort


def _fail(abort: str | None, err: UsageError) -> _Link:
    link = _Link(abort)
    fake = SimpleNamespace(_link=link, generation=0, _pos=SimpleNamespace(step=3))
    Session._fail_usage(fake, err)  # type: ignore[arg-type]
    return link


@pytest.mark.parametrize(
    ("abort", "reported"),
    [("rank 1: the line", True), ("rank 0: another mistake", False), (None, False)],
)
def test_a_mistake_is_reported_only_when_the_abort_carries_its_line(
    abort: str | None, reported: bool
) -> None:
    err = UsageError("the line")
    link = _fail(abort, err)
    assert link.sent == [{"t": "fault", "gen": 0, "step": 3, "error": "the line", "usage": True}]
    assert err.reported is reported


def test_the_excepthook_prints_an_unreported_mistake_and_not_a_reported_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = UsageError("bad state= object")
    _one_line_usage_errors(UsageError, err, None)
    assert capsys.readouterr().err == "nonstop: error: bad state= object\n"
    err.reported = True
    _one_line_usage_errors(UsageError, err, None)
    assert capsys.readouterr().err == ""


def test_await_abort_returns_the_aborts_line_or_none() -> None:
    from nonstop.train.link import CoordinatorLink

    fake = SimpleNamespace(_inbox=queue.Queue(), _take=lambda m: m)
    fake._inbox.put(CadenceMsg(every=1, since=0))
    fake._inbox.put(AbortMsg(error="rank 0: the line"))
    assert CoordinatorLink.await_abort(fake, 1.0) == "rank 0: the line"  # type: ignore[arg-type]
    assert CoordinatorLink.await_abort(fake, 0.05) is None  # type: ignore[arg-type]
