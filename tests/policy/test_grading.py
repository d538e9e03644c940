"""Failure grading (policy/grading.py) over a table of cases, and the proactive policy
(policy/proactive.py)."""

from __future__ import annotations

import signal

import pytest

from nonstop.policy.decisions import FailureKind, QuarantinePolicy
from nonstop.policy.grading import (
    REPEATS_TO_FAIL,
    FailureSignal,
    Grade,
    RepeatedErrors,
    exception_type,
    grade_failure,
)
from nonstop.policy.proactive import decide_migration, measured_migration_cost

Q = QuarantinePolicy(max_failures=3, window_s=600.0)
K = FailureKind
R, E, QN, F = Grade.RESTART_IN_PLACE, Grade.REPLACE_ELSEWHERE, Grade.QUARANTINE_NODE, Grade.FAIL_JOB

CASES: list[tuple[str, FailureSignal, Grade, str]] = [
    ("sigkill, healthy node", FailureSignal(kind=K.KILLED, returncode=-9, others_usable=1), R, "killed"),
    ("hang", FailureSignal(kind=K.HANG, returncode=-9, others_usable=1), R, "hung"),
    ("exit 3", FailureSignal(kind=K.EXIT, returncode=3, others_usable=1), R, "exited"),
    (
        "a RuntimeError",
        FailureSignal(kind=K.ERROR, returncode=1, exception="RuntimeError: boom", others_usable=1),
        R,
        "RuntimeError",
    ),
    ("node lost", FailureSignal(kind=K.NODE_LOST, others_usable=1), E, "node is lost"),
    ("node lost, last node", FailureSignal(kind=K.NODE_LOST, others_usable=0), E, "node is lost"),
    ("usage", FailureSignal(kind=K.ERROR, returncode=2, usage=True, others_usable=1), F, "UsageError"),
    (
        "import error",
        FailureSignal(kind=K.ERROR, returncode=1, exception="ModuleNotFoundError: no x", others_usable=1),
        F,
        "cannot load",
    ),
    (
        "syntax error, single node",
        FailureSignal(kind=K.ERROR, returncode=1, exception="SyntaxError: bad", others_usable=0),
        F,
        "cannot load",
    ),
    (
        "sigbus",
        FailureSignal(kind=K.KILLED, returncode=-int(signal.SIGBUS), others_usable=1),
        E,
        "SIGBUS",
    ),
    (
        "sigbus on the last node restarts in place",
        FailureSignal(kind=K.KILLED, returncode=-int(signal.SIGBUS), others_usable=0),
        R,
        "killed",
    ),
    (
        "an ECC error",
        FailureSignal(
            kind=K.ERROR,
            returncode=1,
            exception="torch.AcceleratorError: CUDA error: uncorrectable ECC error",
            others_usable=1,
        ),
        E,
        "AcceleratorError",
    ),
    (
        "an NCCL error",
        FailureSignal(
            kind=K.ERROR, returncode=1, exception="DistBackendError: NCCL error: remote", others_usable=2
        ),
        E,
        "nccl",
    ),
    (
        "degraded probe",
        FailureSignal(kind=K.KILLED, returncode=-9, probe="degraded", others_usable=1),
        E,
        "degraded",
    ),
    (
        "failing probe",
        FailureSignal(kind=K.EXIT, returncode=1, probe="failing", others_usable=1),
        QN,
        "failing",
    ),
    (
        "failing probe, the last node",
        FailureSignal(kind=K.EXIT, returncode=1, probe="failing", others_usable=0),
        R,
        "exited",
    ),
    (
        "third failure in the window",
        FailureSignal(
            kind=K.KILLED, returncode=-9, node_failures=(10.0, 200.0, 500.0), now=500.0, others_usable=1
        ),
        QN,
        "3 failures",
    ),
    (
        "old failures outside the window",
        FailureSignal(
            kind=K.KILLED, returncode=-9, node_failures=(1.0, 2.0, 900.0), now=900.0, others_usable=1
        ),
        R,
        "killed",
    ),
    (
        "third failure but the last usable node",
        FailureSignal(kind=K.KILLED, returncode=-9, node_failures=(1.0, 2.0, 3.0), now=3.0, others_usable=0),
        R,
        "killed",
    ),
    (
        "the same error at the same step, twice: restarts",
        FailureSignal(
            kind=K.ERROR, returncode=1, exception="ValueError: x", same_error_generations=2, others_usable=1
        ),
        R,
        "ValueError",
    ),
    (
        "the same error at the same step, three generations in a row",
        FailureSignal(
            kind=K.ERROR, returncode=1, exception="ValueError: x", same_error_generations=3, others_usable=1
        ),
        F,
        "the same ValueError at the same step in 3 generations",
    ),
    (
        "repeats beat quarantine, on the last node too",
        FailureSignal(
            kind=K.ERROR,
            exception="KeyError: 'w'",
            same_error_generations=4,
            node_failures=(1.0, 2.0, 3.0),
            now=3.0,
            others_usable=0,
        ),
        F,
        "in 4 generations in a row",
    ),
    (
        "usage beats quarantine",
        FailureSignal(kind=K.ERROR, usage=True, node_failures=(1.0, 2.0, 3.0), now=3.0, others_usable=1),
        F,
        "UsageError",
    ),
]


@pytest.mark.parametrize(("name", "sig", "grade", "why"), CASES, ids=[c[0] for c in CASES])
def test_the_grading_table(name: str, sig: FailureSignal, grade: Grade, why: str) -> None:
    g = grade_failure(sig, Q)
    assert g.grade is grade, (name, g)
    assert why in g.reason, (name, g.reason)


def test_exception_type() -> None:
    assert exception_type("RuntimeError: x: y") == "RuntimeError"
    assert exception_type("torch.AcceleratorError: x") == "AcceleratorError"
    assert exception_type("a sentence: no type") is None
    assert exception_type(None) is None and exception_type("") is None


def test_proactive_migrates_when_doing_nothing_costs_more() -> None:
    d = decide_migration(
        compute_s=0.3, peers_s=0.1, remaining_steps=1000, migration_cost_s=10.0, has_target=True
    )
    assert d.migrate and d.expected_loss_s == pytest.approx(200.0)


def test_proactive_waits_when_the_run_is_nearly_over() -> None:
    d = decide_migration(
        compute_s=0.3, peers_s=0.1, remaining_steps=20, migration_cost_s=10.0, has_target=True
    )
    assert not d.migrate and d.expected_loss_s == pytest.approx(4.0)


def test_proactive_needs_a_target_and_a_real_slowdown() -> None:
    no_target = decide_migration(
        compute_s=0.3, peers_s=0.1, remaining_steps=None, migration_cost_s=1.0, has_target=False
    )
    assert not no_target.migrate and "spare" in no_target.reason
    not_slow = decide_migration(
        compute_s=0.1, peers_s=0.1, remaining_steps=None, migration_cost_s=1.0, has_target=True
    )
    assert not not_slow.migrate


def test_proactive_with_an_unknown_run_length_migrates() -> None:
    d = decide_migration(
        compute_s=0.2, peers_s=0.1, remaining_steps=None, migration_cost_s=100.0, has_target=True
    )
    assert d.migrate and d.expected_loss_s is None


def test_measured_migration_cost() -> None:
    assert measured_migration_cost(None, 0.1, 10.0) == 10.0
    assert measured_migration_cost(0.5, 0.1, 10.0) == pytest.approx(0.4)
    assert measured_migration_cost(0.1, 0.1, 10.0) == pytest.approx(0.1)  # at least a step


def test_repeated_errors_count_generations_of_one_error_at_one_step() -> None:
    r = RepeatedErrors()
    assert r.count(exception="ValueError: x", step=7, generation=1) == 1
    assert r.count(exception="ValueError: x", step=7, generation=1) == 1  # another rank, same generation
    assert r.count(exception="ValueError: x", step=7, generation=2) == 2
    assert r.count(exception="ValueError: x", step=7, generation=3) == REPEATS_TO_FAIL


def test_repeated_errors_start_over_when_the_step_or_the_error_differs() -> None:
    r = RepeatedErrors()
    r.count(exception="ValueError: x", step=7, generation=1)
    r.count(exception="ValueError: x", step=7, generation=2)
    assert r.count(exception="ValueError: x", step=9, generation=3) == 1  # the job moved on
    assert r.count(exception="ValueError: x", step=9, generation=4) == 2
    assert r.count(exception="RuntimeError: gloo", step=9, generation=5) == 1  # another fault
    assert r.count(exception="ValueError: x", step=9, generation=6) == 1  # not in a row
