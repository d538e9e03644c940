"""The files a job keeps in its job dir for other processes: ``job.json`` (how ``nonstop
status/persist/migrate`` and the metrics scraper reach it), the store-mode coordinator's spec and
result, and reading ``--resume``'s checkpoint (declaring it to the checkpoint root's retention).
All JSON; nothing is unpickled."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from nonstop.config import JobConfig
from nonstop.coordinator.loop import JobResult, JobState
from nonstop.errors import SnapshotMissingError, UsageError
from nonstop.launch.jobdir import local_root
from nonstop.snapshot.durable import DurableStore, LoadedCheckpoint

if TYPE_CHECKING:
    from nonstop.coordinator.status_server import StatusServer

__all__ = [
    "COORDINATOR_RESULT",
    "COORDINATOR_SPEC",
    "JOB_INFO",
    "declare_resume",
    "load_resume",
    "result_from_json",
    "result_to_json",
    "write_job_info",
]

COORDINATOR_SPEC = "coordinator.json"  # store mode: what the coordinator process is started from
COORDINATOR_RESULT = "coordinator-result.json"  # ... and what it leaves when the job has ended

JOB_INFO = "job.json"


def write_job_info(
    job_dir: Path,
    *,
    job_id: str,
    control: tuple[str, int],
    checkpoints: str,
    secret_file: Path,
    metrics: StatusServer | None = None,
) -> None:
    """What ``nonstop persist``/``status``/``migrate`` need to reach this job (the secret is a
    separate 0600 file; this names where), and where its metrics are served (``--metrics-port``)."""
    info = {
        "job_id": job_id,
        "pid": os.getpid(),
        "control": f"{control[0]}:{control[1]}",
        "checkpoints": checkpoints,
        "secret_file": str(secret_file.resolve()),
    }
    if metrics is not None:
        info.update(metrics.job_info(job_dir))
    tmp = job_dir / f".{JOB_INFO}.tmp"
    tmp.write_text(json.dumps(info))
    tmp.replace(job_dir / JOB_INFO)


def declare_resume(durable: DurableStore, resume_url: str, step: int) -> None:
    """Tell the checkpoint root's retention that this job resumed from ``step`` of it (when
    ``--resume`` names the root it persists to): what was newer there then is the timeline it
    abandoned (:meth:`Catalog.resumed_from`)."""
    a, b = local_root(resume_url), local_root(durable.url)
    if a is not None and b is not None:
        same = a.resolve() == b.resolve()
    else:
        same = resume_url.rstrip("/") == durable.url.rstrip("/")
    if same:
        durable.resumed_from(step)


def load_resume(config: JobConfig) -> LoadedCheckpoint:
    """The newest good checkpoint at ``--resume``, checked against the job's world size: an
    elastic job (``--min-world-size``, its ranks data-parallel replicas) resumes a checkpoint of
    any size (``elastic.resume_sources``), a sharded job (``--mesh``) too (its workers reshard
    it: ``Generations.reshard``); any other job needs the size it was written at."""
    resume = config.persist.resume
    assert resume is not None
    from nonstop.progress import wait_with_status, wanted

    try:
        ckpt = wait_with_status(
            DurableStore(resume, keep=config.persist.keep).load,
            f"--resume: loading and verifying the newest checkpoint at {resume}",
            show=wanted(None),
        )
    except SnapshotMissingError as e:
        raise UsageError(f"--resume {resume}: no loadable checkpoint ({e})") from None
    if ckpt.world_size != config.world_size and not config.elastic.min_world_size and config.mesh is None:
        raise UsageError(
            f"--resume {resume}: checkpoint step {ckpt.step} has {ckpt.world_size} ranks but this "
            f"job has {config.world_size}; run {ckpt.world_size} ranks (--nnodes x --nproc-per-node, e.g. "
            f"--nproc-per-node {ckpt.world_size} on one node) or, when the ranks are data-parallel "
            "replicas, pass --min-world-size N (elastic: ranks beyond the checkpoint's start from its rank 0)"
        )
    return ckpt


def result_to_json(result: JobResult) -> str:
    return json.dumps(
        {
            "state": str(result.state),
            "generation": result.generation,
            "final_step": result.final_step,
            "failures": result.failures,
            "error": result.error,
            "usage_error": result.usage_error,
            "median_step_s": result.median_step_s,
            "replication": result.replication,
        }
    )


def result_from_json(text: str) -> JobResult:
    d = json.loads(text)
    return JobResult(
        state=JobState(d["state"]),
        generation=int(d["generation"]),
        final_step=int(d["final_step"]),
        failures=list(d["failures"]),
        error=d["error"],
        usage_error=d.get("usage_error") is True,
        median_step_s=d["median_step_s"],
        replication=dict(d["replication"]),
    )
