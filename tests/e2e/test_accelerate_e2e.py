"""Hugging Face Accelerate owning the loop in a real nonstop job: ``examples/accelerate/train.py``
(3 ranks and a hot spare, Accelerate's DDP wrapper, AdamW and a cosine schedule prepared by
Accelerate) with rank 1 SIGKILLed at step 5, against the same job run without a fault:

* the spare takes rank 1, no committed step is lost, and the job ends in a later generation;
* the final weights are bitwise equal -- with 3 ranks this needs nonstop's canonical-order
  gradient allreduce on Accelerate's fresh DDP wrapper, and the abandoned step's gradients
  dropped at the restore (the example zeroes them after ``optimizer.step()``, as Accelerate's
  examples do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nonstop.config import JobConfig
from nonstop.coordinator.loop import JobResult, JobState
from nonstop.launch.launcher import run_job

pytestmark = pytest.mark.slow
pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate" / "train.py"
STEPS = 10


def _run(tmp_path: Path, name: str, faults: tuple[str, ...]) -> tuple[JobResult, dict[str, torch.Tensor]]:
    final = tmp_path / f"{name}.pt"
    config = JobConfig(
        script=str(EXAMPLE),
        script_args=("--steps", str(STEPS), "--save", str(final)),
        nproc_per_node=3,
        spares=1,
        job_dir=tmp_path / f"job-{name}",
        faults=faults,
    )
    result = run_job(config, redirect_output=True)
    assert result.state is JobState.DONE, result.error
    weights: dict[str, torch.Tensor] = torch.load(final)
    return result, weights


def test_accelerate_job_survives_a_kill_bitwise(tmp_path: Path) -> None:
    ref, want = _run(tmp_path, "ref", ())
    assert not ref.failures
    run, got = _run(tmp_path, "faulty", ("kill:rank=1,step=5",))
    assert run.final_step == ref.final_step == STEPS
    (failure,) = run.failures
    assert failure["rank"] == 1 and failure["replacement"] == "spare" and failure["lost_steps"] == 0
    assert run.generation > ref.generation  # recovered into a new generation: Accelerate re-prepared
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want), "recovered weights differ from the reference"
