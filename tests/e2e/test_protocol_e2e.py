"""A real job whose rank misuses the process group's store: the coordinator answers with an
error, the script sees it raised, and the job trains on to the end, bitwise equal to a run that
did not misuse anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from nonstop.coordinator.loop import JobState
from tests.conftest import events_named, run_demo_job

pytestmark = pytest.mark.slow


def test_store_add_on_text_raises_in_the_caller_and_the_job_goes_on(
    tmp_path: Path, reference_hash: str
) -> None:
    run = run_demo_job(tmp_path, spares=0, script_extra=("--kv-probe-step", "5"))
    assert run.result.state is JobState.DONE, run.result.error
    assert run.out is not None
    assert str(run.out["kv_probe"]).startswith("refused: rendezvous add failed"), run.out["kv_probe"]
    assert "not a counter" in str(run.out["kv_probe"])
    assert run.out["final_hash"] == reference_hash
    assert run.result.generation == 1 and not events_named(run.events, "failure")
