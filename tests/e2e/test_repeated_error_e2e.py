"""A program error that every restart replays ends the job after three generations, not ten.

A real 2-rank job with a hot spare runs a script whose rank 1 raises the same ``ValueError`` at
step 4 each time it runs it. Each generation restores step 3 and raises again. The third time,
the grading (:class:`~nonstop.policy.grading.RepeatedErrors`) fails the job: its error names
the exception and says why it was not restarted, and the job spent 3 failures, not the 11 the
restart budget (10) allows. Rank 0, whose step failed each time with the closed connection rank
1 left behind, survives every recovery (the detector does not tell a peer's symptom to raise)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nonstop.config import DetectionConfig, DetectorConfig, JobConfig
from nonstop.coordinator.loop import JobState
from nonstop.events.log import read_events
from nonstop.launch.launcher import run_job
from nonstop.policy.grading import REPEATS_TO_FAIL

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import torch
    import nonstop

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = nonstop.init()
    for step in session.steps(8, model=model, optimizer=opt):
        with step:
            if int(step) == 4 and session.rank == 1:
                raise ValueError("sample 17 has no label")
            opt.zero_grad()
            step.model(torch.ones(2, 4)).sum().backward()
            opt.step()
    session.close()
    """
)


def test_the_same_error_at_the_same_step_fails_the_job_after_three_generations(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = JobConfig(
        script=str(script),
        nproc_per_node=2,
        spares=1,
        job_dir=tmp_path / "job",
        max_restarts=10,
        detection=DetectionConfig(detector=DetectorConfig(heartbeat_timeout_s=3.0, hang_min_s=60.0)),
    )
    result = run_job(config, redirect_output=True)
    assert result.state is JobState.FAILED, result
    assert result.error is not None
    assert "ValueError: sample 17 has no label" in result.error, result.error
    assert f"in {REPEATS_TO_FAIL} generations in a row" in result.error, result.error
    events = read_events(config.job_dir / "events.jsonl")
    failures = [e for e in events if e["event"] == "failure"]  # the last one, which ended it, too
    assert [(f["rank"], f["step"]) for f in failures] == [(1, 4)] * REPEATS_TO_FAIL
    assert failures[-1]["kind"] == "error"
    graded = [e for e in events if e["event"] == "failure_graded"]
    assert [g["grade"] for g in graded] == ["restart_in_place"] * (REPEATS_TO_FAIL - 1) + ["fail_job"]
    assert {g["rank"] for g in graded} == {1}
    # the survivor, whose step failed with 'connection closed by peer' each time, was never told
    # to raise: the same process played rank 0 in every generation
    generations = [e for e in events if e["event"] == "generation"]
    assert len(generations) == REPEATS_TO_FAIL
    assert {g["members"]["0"] for g in generations} == {0}, generations
    assert not [e for e in events if e["event"] == "exit" and e["rank"] == 0]
