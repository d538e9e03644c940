"""One writer per job dir and per checkpoint root (issue 17, items 1-3): a second job is refused
before it touches anything of the first; retention never deletes a newer checkpoint it does not
know to be superseded by its own timeline, nor anything whose manifest it could not read."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nonstop.errors import SnapshotMissingError, UsageError
from nonstop.launch.jobdir import LOCK_FILE, hold_job
from nonstop.snapshot.durable import MANIFEST, DurableStore, LocalStorage, step_dir
from tests.durable_fakes import assert_loaded, delta_ckpt, full_ckpt, persist

NONSTOP = [sys.executable, "-m", "nonstop.cli"]


def _one_line_error(proc: subprocess.CompletedProcess[str], match: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nonstop: error: "), proc.stderr
    assert match in lines[0], lines[0]


def _tree(root: Path) -> dict[str, tuple[int, float, bytes | None]]:
    """Every path under ``root`` with its mode, mtime and (files) content: what 'untouched' means."""
    out: dict[str, tuple[int, float, bytes | None]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime, p.read_bytes() if p.is_file() else None)
    return out


# ---------------------------------------------------------------------------- item 1: the job-dir lock
def _planted_job_dir(job_dir: Path) -> None:
    """What a running first job has in its job dir."""
    (job_dir / "faults").mkdir(parents=True)
    (job_dir / "faults" / "kill-rank1-step6").write_text("1")
    (job_dir / "secret").write_bytes(b"f" * 64)
    (job_dir / "secret").chmod(0o600)
    (job_dir / "job.json").write_text('{"job_id": "first"}')
    (job_dir / "checkpoints" / step_dir(10)).mkdir(parents=True)
    (job_dir / "checkpoints" / step_dir(10) / MANIFEST).write_text("{}")


def test_a_second_job_in_a_held_job_dir_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    _planted_job_dir(job_dir)
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    with hold_job(job_dir, str(job_dir / "checkpoints")):
        before = _tree(job_dir)
        proc = subprocess.run(
            [*NONSTOP, "run", "--job-dir", str(job_dir), str(script)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        _one_line_error(proc, "in use by another job")
        assert str(job_dir) in proc.stderr and "--job-dir" in proc.stderr
        assert _tree(job_dir) == before


def test_a_second_job_on_a_held_checkpoint_root_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    with hold_job(tmp_path / "first", str(ckpt)):
        before = _tree(ckpt)
        proc = subprocess.run(
            [*NONSTOP, "run", "--job-dir", str(tmp_path / "second"), "--persist", str(ckpt), str(script)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        _one_line_error(proc, "in use by another job")
        assert "--persist" in proc.stderr
        assert _tree(ckpt) == before
        assert not (tmp_path / "second" / "secret").exists()


def test_the_lock_is_released_when_the_job_ends(tmp_path: Path) -> None:
    with hold_job(tmp_path / "job", str(tmp_path / "job" / "checkpoints")):
        with pytest.raises(UsageError, match="in use by another job"):
            hold_job(tmp_path / "job", str(tmp_path / "elsewhere")).__enter__()
        assert not (tmp_path / "elsewhere").exists()  # refused before the root was made
    with hold_job(tmp_path / "job", str(tmp_path / "job" / "checkpoints")):
        pass
    assert (tmp_path / "job" / LOCK_FILE).exists()  # left in place: unlinking a flock file races


def test_a_remote_checkpoint_root_is_not_locked(tmp_path: Path) -> None:
    with hold_job(tmp_path / "a", "memory://shared-root"), hold_job(tmp_path / "b", "memory://shared-root"):
        pass


def _launch(job_dir: Path, *extra: str, steps: int, delay: float) -> subprocess.Popen[str]:
    cmd = [
        *NONSTOP, "run", "--nproc-per-node", "1", "--spares", "0", "--job-dir", str(job_dir), *extra,
        "-m", "nonstop.demo.train", "--steps", str(steps), "--model", "tiny", "--batch", "4",
        "--step-delay", str(delay),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_job_started_beside_a_running_one_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    # The first job must outlive both refused launches (each a Python start with torch imported:
    # 2-5 s quiet, 10-20 s on a loaded 2-core machine): 300 steps of at least 0.1 s each.
    job_dir, steps = tmp_path / "job", 300
    first = _launch(job_dir, "--persist-every", "4", steps=steps, delay=0.1)
    try:
        ckpt = DurableStore(job_dir / "checkpoints")
        deadline = time.monotonic() + 90
        while len(ckpt.steps()) < 2:
            assert first.poll() is None and time.monotonic() < deadline, "the first job made no checkpoints"
            time.sleep(0.1)
        secret, info = (job_dir / "secret").read_bytes(), (job_dir / "job.json").read_text()
        for extra in ((), ("--persist", str(job_dir / "checkpoints"))):
            other = job_dir if not extra else tmp_path / "other"
            second = _launch(other, *extra, steps=8, delay=0.0)
            out, err = second.communicate(timeout=60)
            assert first.poll() is None, "the first job ended before the second was refused: lengthen it"
            _one_line_error(subprocess.CompletedProcess(second.args, second.returncode, out, err), "in use")
            assert (job_dir / "secret").read_bytes() == secret and (job_dir / "job.json").read_text() == info
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    assert f"job done at step {steps}" in out
    starts = [e for e in map(json.loads, (job_dir / "events.jsonl").read_text().splitlines())]
    assert sum(e["event"] == "job_start" for e in starts) == 1  # the second never started
    assert DurableStore(job_dir / "checkpoints").load().step == steps


# ---------------------------------------------------------------------------- item 2: newer checkpoints
def test_a_job_that_did_not_resume_never_deletes_newer_checkpoints(tmp_path: Path) -> None:
    old = DurableStore(tmp_path, keep=2)
    for s in (10, 20, 30):
        persist(old, s, full_ckpt(s, world=1))
    fresh = DurableStore(tmp_path, keep=2)  # another run in the same root, from step 0
    persist(fresh, 5, full_ckpt(5, world=1))
    assert fresh.steps() == [5, 20, 30]  # 10 was already gone (keep=2); 20 and 30 are not ours
    persist(fresh, 8, full_ckpt(8, world=1))
    assert fresh.steps() == [5, 8, 20, 30]
    assert_loaded(fresh, None, 8, full_ckpt(8, world=1))  # `latest` is ours
    assert_loaded(fresh, 30, 30, full_ckpt(30, world=1))


def test_a_newer_checkpoint_keeps_its_base(tmp_path: Path) -> None:
    old = DurableStore(tmp_path, keep=3)
    base = full_ckpt(10, world=1)
    persist(old, 10, base)
    persist(old, 20, delta_ckpt(20, base), base=(10, base))
    fresh = DurableStore(tmp_path, keep=1)
    for s in (2, 4, 12, 14):  # 12 and 14 are past 10: it would go by keep, but 20 needs it
        persist(fresh, s, full_ckpt(s, world=1))
    assert fresh.steps() == [10, 14, 20]
    assert_loaded(fresh, 20, 20, delta_ckpt(20, base))


def test_a_resumed_job_deletes_only_the_timeline_it_resumed_away_from(tmp_path: Path) -> None:
    old = DurableStore(tmp_path, keep=3)
    for s in (10, 20, 30):
        persist(old, s, full_ckpt(s, world=1))
    resumed = DurableStore(tmp_path, keep=3)
    resumed._catalog.resumed_from(20)  # the job loaded step 20 (30 was unusable)
    persist(DurableStore(tmp_path, keep=9), 40, full_ckpt(40, world=1))  # someone else, afterwards
    persist(resumed, 25, full_ckpt(25, world=1))
    assert resumed.steps() == [10, 20, 25, 40]  # 30 was superseded; 40 is not ours to judge
    persist(resumed, 30, full_ckpt(31, world=1))  # our own step 30 is never "superseded"
    persist(resumed, 35, full_ckpt(35, world=1))
    assert resumed.steps() == [25, 30, 35, 40]
    assert_loaded(resumed, 30, 30, full_ckpt(31, world=1))


# ---------------------------------------------------------------------------- item 3: unreadable manifests
class FlakyStorage(LocalStorage):
    """A local root on which chosen paths fail their next few looks (``flaky[path] = n``:
    ``exists``/``size``) or reads (``flaky_reads``) with ENOENT: a stale NFS handle, an
    eventually consistent listing."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.flaky: dict[str, int] = {}
        self.flaky_reads: dict[str, int] = {}

    @staticmethod
    def _trip(counts: dict[str, int], path: str) -> bool:
        n = counts.get(path, 0)
        if n > 0:
            counts[path] = n - 1
        return n > 0

    def exists(self, path: str) -> bool:
        return False if self._trip(self.flaky, path) else super().exists(path)

    def size(self, path: str) -> int:
        if self._trip(self.flaky, path):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist")
        return super().size(path)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if self._trip(self.flaky_reads, path):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist")
        return super().read(path, offset, length)


def test_a_manifest_that_is_briefly_missing_is_not_deleted(tmp_path: Path) -> None:
    storage = FlakyStorage(tmp_path)
    store = DurableStore(storage, keep=3)
    for s in (10, 20, 30):
        persist(store, s, full_ckpt(s, world=1))
    manifest = f"{step_dir(30)}/{MANIFEST}"
    storage.flaky[manifest] = 1  # one failed look, during the next persist
    persist(store, 40, full_ckpt(40, world=1))
    assert store.steps() == [10, 20, 30, 40]  # what 30 might need stays too, for this pass
    assert_loaded(store, 30, 30, full_ckpt(30, world=1))
    storage.flaky[manifest] = 1000  # however many looks fail in one pass: it was seen committed
    persist(store, 50, full_ckpt(50, world=1))
    assert (tmp_path / manifest).exists()
    storage.flaky[manifest] = 0
    persist(store, 60, full_ckpt(60, world=1))  # readable again: retention goes on as usual
    assert store.steps() == [40, 50, 60]


def test_rewriting_the_current_checkpoint_is_refused_even_when_one_look_misses_its_manifest(
    tmp_path: Path,
) -> None:
    storage = FlakyStorage(tmp_path)
    store = DurableStore(storage, keep=3)
    for s in (10, 20, 30):
        persist(store, s, full_ckpt(s, world=1))
    storage.flaky[f"{step_dir(30)}/{MANIFEST}"] = 1  # one failed look as the step is begun again
    with pytest.raises(ValueError, match="already committed"):
        store.begin(30, 1, "raw")
    assert_loaded(store, 30, 30, full_ckpt(30, world=1))  # the current checkpoint is whole


def test_a_manifest_gone_for_good_goes_at_the_next_pass(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=3)
    for s in (10, 20, 30):
        persist(store, s, full_ckpt(s, world=1))
    (tmp_path / step_dir(20) / MANIFEST).unlink()  # e.g. a killed retention un-committed it
    persist(store, 40, full_ckpt(40, world=1))
    assert (tmp_path / step_dir(20)).is_dir() and (tmp_path / step_dir(10)).is_dir()  # this pass: kept
    persist(store, 50, full_ckpt(50, world=1))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        step_dir(30),
        step_dir(40),
        step_dir(50),
    ]


def test_an_unreadable_manifest_of_a_kept_delta_keeps_its_base(tmp_path: Path) -> None:
    storage = FlakyStorage(tmp_path)
    store = DurableStore(storage, keep=1)
    base = full_ckpt(10, world=1)
    persist(store, 10, base)
    storage.flaky_reads[f"{step_dir(20)}/{MANIFEST}"] = 1  # retention cannot read what 20 needs
    persist(store, 20, delta_ckpt(20, base), base=(10, base))
    assert store.steps() == [10, 20]
    assert_loaded(store, None, 20, delta_ckpt(20, base))


def test_an_abandoned_directory_older_than_current_still_goes(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=3)
    persist(store, 10, full_ckpt(10, world=1))
    (tmp_path / step_dir(15)).mkdir()  # a killed writer's, no manifest
    (tmp_path / step_dir(15) / "rank-00000.bin").write_bytes(b"x")
    (tmp_path / step_dir(90)).mkdir()  # newer, no manifest: maybe being written; left alone
    persist(store, 20, full_ckpt(20, world=1))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        step_dir(10),
        step_dir(20),
        step_dir(90),
    ]


def test_a_second_demo_on_a_held_demo_dir_is_refused_before_it_clears_anything(tmp_path: Path) -> None:
    """Was: ``nonstop demo`` deleted JOB_DIR/run before the job inside could take its lock, so
    a second demo on the same --job-dir destroyed a running one."""
    from nonstop.launch.jobdir import hold_dir

    demo_dir = tmp_path / "demo"
    (demo_dir / "run").mkdir(parents=True)
    (demo_dir / "run" / "events.jsonl").write_text("{}\n")
    with hold_dir(demo_dir, what="demo dir", option="--job-dir"):
        before = _tree(demo_dir)
        proc = subprocess.run(
            [*NONSTOP, "demo", "--job-dir", str(demo_dir), "--nproc", "2", "--steps", "4"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        _one_line_error(proc, "in use by another job")
        assert _tree(demo_dir) == before
