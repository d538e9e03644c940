"""Each completed step's snapshot and report (train/reports.py), against a fake link and fake
slots: a step not due is reported at once as progress only, a snapshotted one once its snapshot
is complete, and with a budget the state's digest once a generation."""

from __future__ import annotations

from typing import Any, cast

import torch

from nonstop.policy import cadence
from nonstop.snapshot import StateCapture
from nonstop.train.reports import StepReports
from tests.worker_fakes import FakeLink, FakeSlots


def _capture() -> StateCapture:
    return StateCapture(model=torch.nn.Linear(3, 2), optimizer=None)


def _reports(*, every: int = 1, budget: float = 0.0) -> tuple[StepReports, FakeLink, FakeSlots]:
    link, slots = FakeLink(), FakeSlots(every=every)
    return StepReports(link=cast(Any, link), snaps=cast(Any, slots), snapshot_budget=budget), link, slots


def _done(reports: StepReports, step: int, *, generation: int = 1, num_steps: int | None = 100) -> None:
    reports.completed(
        step,
        generation=generation,
        capture=_capture(),
        step_s=0.5,
        wait_s=0.1234567,
        loss=2.0,
        num_steps=num_steps,
        since=0.0,
    )


def test_a_snapshotted_step_is_reported_once_its_snapshot_is_complete() -> None:
    reports, link, slots = _reports(every=2)
    slots.waited = 0.25  # the loop waited this long on the previous copy's fence
    _done(reports, 2)
    assert link.sent == [] and link.quiet == []  # not committed before the copy finishes
    slots.takes[-1].complete()
    (report,) = link.quiet  # (sent from the copier's thread)
    assert report["t"] == "step" and (report["gen"], report["step"], report["bytes"]) == (1, 2, 100)
    assert report["wait_s"] == 0.123457 and report["of"] == 100 and report["loss"] == 2.0
    assert report["snap_s"] > 0.25 and "snapped" not in report and "rest" not in report


def test_a_step_not_due_is_progress_only_sent_at_once_and_the_last_step_is_always_due() -> None:
    reports, link, slots = _reports(every=4)
    _done(reports, 3)
    assert [m["snapped"] for m in link.sent] == [False] and link.sent[0]["bytes"] == 0 and not slots.takes
    _done(reports, 5, num_steps=5)  # the run's last step: restorable
    assert [w.step for w in slots.takes] == [5]
    link.pause_at = 6  # a swap's boundary
    _done(reports, 6, num_steps=None)
    assert [w.step for w in slots.takes] == [5, 6]


def test_with_a_budget_the_rest_digest_goes_with_one_report_per_generation() -> None:
    reports, link, _ = _reports(every=1000, budget=0.01)
    _done(reports, cadence.SKIP - 1)
    _done(reports, cadence.SKIP)
    _done(reports, cadence.SKIP + 1)
    _done(reports, cadence.SKIP + 2, generation=2)
    assert ["rest" in m for m in link.sent] == [False, True, False, True]
    without, none, _ = _reports(every=1000)  # no budget: no digests
    _done(without, cadence.SKIP)
    assert [m["step"] for m in none.sent] == [cadence.SKIP] and "rest" not in none.sent[0]
