"""The job phase table and which background operation may start when (pure)."""

from __future__ import annotations

import itertools

import pytest

from nonstop.policy.phase import BLOCKED_BY, Busy, JobPhase, Op, legal, may_start


def test_terminal_phases_go_nowhere_and_every_live_phase_can_fail() -> None:
    for a, b in itertools.product(JobPhase, JobPhase):
        if a.is_terminal:
            assert not legal(a, b)
        elif b is JobPhase.FAILED:
            assert legal(a, b)
    assert legal(JobPhase.RUNNING, JobPhase.RECONFIGURING) and legal(JobPhase.RECONFIGURING, JobPhase.RUNNING)
    assert legal(JobPhase.RECONFIGURING, JobPhase.RECONFIGURING)  # a failure during a recovery
    assert not legal(JobPhase.STARTING, JobPhase.RUNNING)  # the first generation is set up first
    assert not legal(JobPhase.FINISHING, JobPhase.RECONFIGURING)
    assert not legal(JobPhase.RECONFIGURING, JobPhase.FINISHING)


@pytest.mark.parametrize("op", list(Op))
def test_only_a_running_job_starts_background_work(op: Op) -> None:
    for phase in JobPhase:
        assert may_start(op, phase, set()) is (phase is JobPhase.RUNNING)


@pytest.mark.parametrize(
    ("op", "busy", "allowed"),
    [
        (Op.REPLICATE, {Busy.RESUMING}, False),  # the first step is the critical path
        (Op.REPLICATE, {Busy.SWAPPING}, False),
        (Op.REPLICATE, {Busy.MIGRATING}, True),  # a migration's prepare phase replicates
        (Op.REPLICATE, {Busy.ENDING}, True),
        (Op.PERSIST, {Busy.SWAPPING, Busy.RESUMING, Busy.MIGRATING}, True),
        (Op.PERSIST, {Busy.RESYNCING}, False),
        (Op.MIGRATE, {Busy.MIGRATING}, True),  # the queue's next one (one runs at a time elsewhere)
        (Op.MIGRATE, {Busy.GROWING}, False),  # two boundary swaps never overlap
        (Op.GROW, {Busy.MIGRATING}, False),
        (Op.GROW, {Busy.ENDING}, False),
        (Op.GROW, set(), True),
    ],
)
def test_conflicts(op: Op, busy: set[Busy], allowed: bool) -> None:
    assert may_start(op, JobPhase.RUNNING, busy) is allowed


def test_every_op_yields_to_a_resyncing_coordinator() -> None:
    assert all(Busy.RESYNCING in BLOCKED_BY[op] for op in Op)
