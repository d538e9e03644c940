"""Files another local user cannot hijack or read (issue 17, items 4-6): the job secret is written
0600 through no symlink and refused when others can read it or when it is too short; ``nonstop
gc`` survives lock files it cannot open and never takes a starting job for an orphan;
checkpoints and the job dir are not world-readable."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from nonstop.agent import gc
from nonstop.agent.gc import collect_garbage, hold_lock, lock_path
from nonstop.snapshot.durable import DurableStore
from tests.durable_fakes import full_ckpt, persist

NONSTOP = [sys.executable, "-m", "nonstop.cli"]
SECRET = "s" * 40


def _nonstop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*NONSTOP, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], match: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nonstop: error: "), proc.stderr
    assert match in lines[0], lines[0]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


# A worker that reports how it found its secret file and the job dir, then fails the job fast.
REPORT_SCRIPT = """
import json, os, stat, sys
f = os.environ["NONSTOP_SECRET_FILE"]
st = os.lstat(f)
json.dump({"file": f, "mode": stat.S_IMODE(st.st_mode), "link": stat.S_ISLNK(st.st_mode),
           "job_dir_mode": stat.S_IMODE(os.stat(os.environ["NONSTOP_JOB_DIR"]).st_mode)},
          open(sys.argv[1], "w"))
raise SystemExit(3)
"""


def _report_run(
    tmp_path: Path, job_dir: Path, *args: str, env: dict[str, str] | None = None
) -> dict[str, object]:
    script, report = tmp_path / "report.py", tmp_path / "report.json"
    script.write_text(REPORT_SCRIPT)
    proc = _nonstop("run", *args, "--job-dir", str(job_dir), str(script), str(report), env=env)
    assert proc.returncode == 1 and "exit code 3" in proc.stderr, proc.stderr
    return dict(json.loads(report.read_text()))


# ---------------------------------------------------------------------------- item 4: the secret file
def test_a_precreated_world_readable_secret_file_is_replaced_0600(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    planted = job_dir / "secret"
    planted.write_text("attacker-known-value-0123456789")
    planted.chmod(0o644)
    rep = _report_run(tmp_path, job_dir)
    assert rep["file"] == str(planted.resolve())
    assert rep["mode"] == 0o600 and rep["link"] is False


def test_a_secret_symlink_is_not_followed(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    (job_dir / "secret").symlink_to(victim)
    rep = _report_run(tmp_path, job_dir)
    assert rep["mode"] == 0o600 and rep["link"] is False
    assert victim.read_text() == "precious\n" and _mode(victim) == 0o644


def test_a_node_secret_symlink_is_not_followed(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (job_dir / ".secret-node-1").symlink_to(victim)
    (tmp_path / "t.py").write_text("")
    proc = _nonstop(
        "run", "--nnodes", "2", "--node-rank", "1", "--coordinator", "127.0.0.1:1",
        "--job-dir", str(job_dir), str(tmp_path / "t.py"),
        env={"NONSTOP_SECRET": SECRET},
    )  # fmt: skip
    assert victim.read_text() == "precious\n"
    written = job_dir / ".secret-node-1"
    assert proc.returncode in (1, 2) and not written.is_symlink()
    assert written.read_text() == SECRET and _mode(written) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    secret = tmp_path / "my-secret"
    secret.write_text(SECRET)
    secret.chmod(mode)
    node1 = ("--nnodes", "2", "--node-rank", "1", "--coordinator", "127.0.0.1:1")
    proc = _nonstop(
        "run", *node1, "--secret-file", str(secret), "--job-dir", str(tmp_path / "a"), str(script)
    )
    _one_line_error(proc, f"chmod 600 {secret}")
    job_dir = tmp_path / "b"
    job_dir.mkdir()
    (job_dir / "secret").write_text(SECRET)  # node 0's file in a shared job dir
    (job_dir / "secret").chmod(mode)
    proc = _nonstop("run", *node1, "--job-dir", str(job_dir), str(script))
    _one_line_error(proc, f"chmod 600 {job_dir / 'secret'}")


def test_a_short_secret_is_refused_wherever_it_comes_from(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit(3)\n")
    proc = _nonstop("run", "--job-dir", str(tmp_path / "a"), str(script), env={"NONSTOP_SECRET": "short"})
    _one_line_error(proc, "NONSTOP_SECRET")
    assert "fewer than 16" in proc.stderr
    job_dir = tmp_path / "b"
    job_dir.mkdir()
    (job_dir / "secret").write_text("short\n")
    (job_dir / "secret").chmod(0o600)
    node1 = ("--nnodes", "2", "--node-rank", "1", "--coordinator", "127.0.0.1:1")
    proc = _nonstop("run", *node1, "--job-dir", str(job_dir), str(script))
    _one_line_error(proc, "fewer than 16")


# ---------------------------------------------------------------------------- item 5: gc
@pytest.fixture
def shared_shm() -> Iterator[Path]:
    """A shared-memory-like directory every user may write (mode 1777, like /dev/shm)."""
    d = Path(tempfile.mkdtemp(prefix="nonstop-gc-test-", dir="/tmp"))
    d.chmod(0o1777)
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def _gc_as_another_user(shm: Path) -> dict[str, list[str]]:
    """``collect_garbage(shm)`` in a forked process that does not own the files in ``shm``
    (root drops to nobody; any other user meets files it cannot open, see the callers); its
    report and what it logged."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            logged: list[str] = []
            handler = logging.Handler()
            handler.emit = lambda rec: logged.append(rec.getMessage())  # type: ignore[method-assign]
            logging.getLogger("nonstop.agent.gc").addHandler(handler)
            rep = collect_garbage(shm)
            out = {"jobs": rep.jobs, "live": rep.live_jobs, "skipped": [str(p) for p in rep.skipped]}
            os.write(w, json.dumps({**out, "logged": logged}).encode())
            code = 0
        except BaseException as e:
            os.write(w, json.dumps({"error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    rep = json.loads(text)
    assert os.waitstatus_to_exitcode(status) == 0, rep
    return dict(rep)


def test_gc_skips_a_lock_file_it_cannot_open(shared_shm: Path) -> None:
    lock = lock_path(shared_shm, "abc123")
    lock.write_text("{}")
    lock.chmod(0o000 if os.geteuid() != 0 else 0o600)  # root's 0600 file is closed to nobody
    segment = shared_shm / "nonstop-abc123-0"
    segment.write_bytes(b"x" * 64)
    segment.chmod(0o600)
    rep = _gc_as_another_user(shared_shm)
    assert rep["skipped"] == [str(lock)] and rep["jobs"] == [] and "abc123" not in rep["live"]
    assert lock.exists() and segment.exists()
    assert any("cannot open" in m and str(lock) in m for m in rep["logged"])  # reported, not hidden


def test_nonstop_gc_says_what_it_skipped(
    shared_shm: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nonstop import cli

    lock = lock_path(shared_shm, "abc123")
    monkeypatch.setattr(gc, "collect_garbage", lambda shm, dry_run: gc.GcReport(skipped=[lock]))
    assert cli.main(["gc"]) == 0
    out = capsys.readouterr().out
    assert "1 path(s) it may not touch skipped" in out and f"skipped {lock}" in out


GC_CODE = """
import json, sys
from pathlib import Path
from nonstop.agent.gc import collect_garbage
r = collect_garbage(Path(sys.argv[1]))
print(json.dumps({"jobs": r.jobs, "live": r.live_jobs}))
"""


def test_a_lock_being_taken_never_looks_orphaned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc runs (a real process) at the worst moment: inside hold_lock, before the lock is held."""
    seen: list[dict[str, list[str]]] = []
    real_flock = gc.fcntl.flock

    def flock_after_gc(fd: int, op: int) -> None:
        if not seen:
            out = subprocess.run(
                [sys.executable, "-c", GC_CODE, str(tmp_path)], capture_output=True, text=True
            )
            assert out.returncode == 0, out.stderr
            seen.append(json.loads(out.stdout))
        real_flock(fd, op)

    monkeypatch.setattr(gc.fcntl, "flock", flock_after_gc)
    fd, lock = hold_lock(tmp_path, "feed42", tmp_path / "job")
    monkeypatch.undo()
    try:
        assert seen and "feed42" not in seen[0]["jobs"]  # not taken for an orphan mid-start
        assert lock == lock_path(tmp_path, "feed42") and lock.exists()
        assert os.fstat(fd).st_ino == lock.stat().st_ino  # we hold the file gc will look at
        assert collect_garbage(tmp_path).live_jobs == ["feed42"]
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    finally:
        os.close(fd)
    assert collect_garbage(tmp_path).jobs == ["feed42"] and not lock.exists()


# ---------------------------------------------------------------------------- item 6: file modes
def test_checkpoints_are_private_by_default(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    persist(DurableStore(root), 10, full_ckpt(10, world=2))
    paths = [root, *root.rglob("*")]
    assert len(paths) > 3
    for p in paths:
        assert _mode(p) & 0o077 == 0, f"{p} is {oct(_mode(p))}"


def test_a_group_shared_root_gives_its_group_read_access_never_the_world(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o750)  # the user shares this root with their group
    persist(DurableStore(root), 10, full_ckpt(10, world=2))
    for p in root.rglob("*"):
        m = _mode(p)
        assert m & 0o007 == 0, f"{p} is {oct(m)}"
        assert m & 0o040, f"{p} is {oct(m)}: its group cannot read it"


def test_the_job_dir_is_created_private(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    rep = _report_run(tmp_path, job_dir)
    assert rep["job_dir_mode"] == 0o700
