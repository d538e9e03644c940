"""The durable tier against real jobs: lazy persistence, `nonstop persist`, SIGTERM, total loss
and `--resume` with bitwise-equal final weights, corruption fallback, `nonstop inspect`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nonstop.snapshot.durable import DurableStore, step_dir
from tests.conftest import STEPS, leftovers, run_demo_job

pytestmark = pytest.mark.slow


def _launch(job_dir: Path, *extra: str, steps: int = STEPS, delay: float = 0.15) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "nonstop.cli", "run", "--nproc-per-node", "3",
        "--job-dir", str(job_dir), *extra,
        "-m", "nonstop.demo.train", "--steps", str(steps), "--model", "tiny", "--batch", "4",
        "--step-delay", str(delay), "--result", str(job_dir / "result.json"),
    ]  # fmt: skip
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _job_id(job_dir: Path) -> str:
    for line in (job_dir / "events.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["event"] == "job_start":
            return str(e["job_id"])
    raise AssertionError("no job_start event")


def _committed(job_dir: Path) -> int:
    """The running job's committed step (-1 while it has none, or the status cannot be read)."""
    out = _nonstop("status", "--job-dir", str(job_dir), "--json")
    if out.returncode != 0:
        return -1
    step = json.loads(out.stdout).get("committed_step")
    return -1 if step is None else int(step)


def _nonstop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nonstop.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_resume_after_total_loss_is_bitwise_equal(tmp_path: Path, reference_hash: str) -> None:
    ckpt = tmp_path / "ckpt"
    job = _launch(tmp_path / "job", "--persist", str(ckpt), "--persist-every", "3")
    try:
        _wait_for(lambda: len(DurableStore(ckpt).steps()) >= 2, 60, "two durable checkpoints")
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # total loss: launcher, agent and every worker
        job.wait()
    job_id = _job_id(tmp_path / "job")
    _wait_for(lambda: not leftovers(job_id)[1], 10, "workers to die with their launcher")
    assert _nonstop("gc").returncode == 0
    assert leftovers(job_id) == ([], [])
    latest = DurableStore(ckpt).latest_step()  # a kill between manifest and `latest` leaves the older
    assert latest is not None and 0 < latest < STEPS

    run = run_demo_job(tmp_path / "resumed", resume=str(ckpt), persist_url=str(tmp_path / "ckpt2"))
    assert run.out is not None, run.result.error
    resumed = [e for e in run.events if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] == latest
    assert run.out["final_hash"] == reference_hash


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, reference_hash: str, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    # Two durable steps whatever the machine's load: a job's final step is persisted before it
    # exits (the periodic rounds are lazy, and on a busy machine a 16-step job once ended with
    # only its final one), so a job of half the steps, then its resumption, each end with one.
    half = run_demo_job(tmp_path / "half", steps=STEPS // 2, persist_url=str(ckpt), persist_every=4, keep=3)
    assert half.out is not None, half.result.error
    run = run_demo_job(tmp_path / "job", resume=str(ckpt), persist_url=str(ckpt), persist_every=4, keep=3)
    assert run.out is not None, run.result.error
    store = DurableStore(ckpt)
    steps = store.steps()
    assert steps[-1] == STEPS and STEPS // 2 in steps  # the final step is persisted before exit
    # the file that holds the chunks: rank 1's, or -- a DDP job's ranks alike, their chunks shared
    # (the demo seeds every RNG alike) -- the one they are all in
    victim = max((ckpt / step_dir(steps[-1])).glob("rank-*.bin"), key=lambda f: f.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    victim.write_bytes(bytes(raw))
    report = _nonstop("inspect", str(ckpt))
    assert report.returncode == 0
    assert "crc" in report.stdout.lower() or "corrupt" in report.stdout.lower(), report.stdout

    run2 = run_demo_job(tmp_path / "resumed", resume=str(ckpt), persist_url=str(tmp_path / "ckpt2"))
    assert run2.out is not None, run2.result.error
    resumed = [e for e in run2.events if e["event"] == "resume"]
    assert resumed[0]["step"] == steps[-2]  # the corrupt newest one was skipped
    assert run2.out["final_hash"] == reference_hash


def test_persist_command_and_sigterm_make_the_committed_step_durable(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    job_dir = tmp_path / "job"
    job = _launch(job_dir, "--persist", str(ckpt), "--persist-every", "0", steps=400, delay=0.05)
    try:
        _wait_for(lambda: (job_dir / "job.json").exists(), 60, "the job to start")
        _wait_for(
            lambda: any(
                json.loads(x)["event"] == "generation"
                for x in (job_dir / "events.jsonl").read_text().splitlines()
            ),
            60,
            "the first generation",
        )
        # the job's pace is the machine's: wait for progress, never for a fixed time (a saturated
        # CPU can take seconds for a step)
        _wait_for(lambda: _committed(job_dir) > 0, 120, "a committed step after step 0")
        out = _nonstop("persist", "--job-dir", str(job_dir))
        assert out.returncode == 0, out.stderr
        step = int(out.stdout.split("step ")[1].split()[0])
        assert step > 0 and DurableStore(ckpt).latest_step() == step
        listing = _nonstop("inspect", str(ckpt))
        assert listing.returncode == 0 and str(step) in listing.stdout
        _wait_for(lambda: _committed(job_dir) > step, 120, f"a committed step after step {step}")
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    last = DurableStore(ckpt).latest_step()
    assert last is not None and last > step  # SIGTERM persisted the newer committed step before exit
    assert _nonstop("persist", "--job-dir", str(job_dir)).returncode == 2  # the job is gone: a clear error


def test_resume_with_wrong_world_size_fails_at_start(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = run_demo_job(tmp_path / "job", nproc=2, spares=0, steps=4, persist_url=str(ckpt))
    assert run.out is not None
    out = _nonstop("run", "--nproc-per-node", "3", "--job-dir", str(tmp_path / "j2"), "--resume", str(ckpt),
                   "-m", "nonstop.demo.train", "--steps", "4")  # fmt: skip
    assert out.returncode == 2
    assert "--nproc-per-node 2" in out.stderr and out.stderr.count("\n") == 1


def test_rank_memory_lost_recovers_from_the_durable_tier(tmp_path: Path, reference_hash: str) -> None:
    """Rank 1 dies and its snapshot memory with it: no step is in every rank's memory, so the
    coordinator restores the newest durable checkpoint, and the result is still exact."""
    run = run_demo_job(
        tmp_path / "job",
        persist_url=str(tmp_path / "ckpt"),
        persist_every=3,
        faults=("wipe:rank=1,step=14",),
        # time for the lazy persister to commit some steps, even on a loaded machine
        script_extra=("--step-delay", "0.3"),
    )
    assert run.out is not None, run.result.error
    restored = [e for e in run.events if e["event"] == "restore_from_durable"]
    assert len(restored) == 1 and 0 < restored[0]["step"] <= 14
    gen = [e for e in run.events if e["event"] == "generation" and e["cause"]]
    assert gen[0]["restore_step"] == restored[0]["step"]
    assert run.out["final_hash"] == reference_hash


def test_lost_memory_without_a_durable_checkpoint_fails_the_job_clearly(tmp_path: Path) -> None:
    run = run_demo_job(tmp_path / "job", persist_every=0, faults=("wipe:rank=1,step=5",))
    assert run.out is None and run.result.error is not None
    assert "no step is snapshotted for every rank in memory or in the durable tier" in run.result.error
