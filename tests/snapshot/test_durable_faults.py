"""The durable tier under faults: a persist killed at every phase leaves the last committed
checkpoint loadable; corruption of any kind is detected and falls back to an older checkpoint with
one warning; ``inspect`` describes what is there."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot.durable import (
    LATEST,
    MANIFEST,
    DurableStore,
    format_inspect,
    rank_file,
    step_dir,
)
from tests.durable_fakes import (
    REPO,
    WORLD,
    assert_loaded,
    delta_ckpt,
    flip_byte,
    full_ckpt,
    make_rank,
    persist,
    warnings_of,
)

# ---------------------------------------------------------------------------- crash atomicity
A_STEP, B_STEP, C_STEP, Z_STEP = 10, 20, 30, 5
PHASES = [
    "bin_partial",
    "bin_written",
    "bins_done",
    "manifest_partial",
    "manifest_written",
    "latest_written",
    "retention_partial",
]


def crash_child(root: str, phase: str) -> None:
    """Run in a subprocess: persist B (a delta of A) and SIGKILL ourselves at ``phase``."""

    def hook(p: str) -> None:
        if p == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    store = DurableStore(root, keep=2, _crash_hook=hook)
    a = full_ckpt(A_STEP)
    persist(store, B_STEP, delta_ckpt(B_STEP, a), base=(A_STEP, a))
    sys.exit(3)  # the phase never came


def _files(root: Path) -> dict[str, list[str]]:
    return {d.name: sorted(os.listdir(d)) for d in root.iterdir() if d.is_dir()}


@pytest.mark.parametrize("phase", PHASES)
def test_kill_at_every_phase_of_a_persist(
    tmp_path: Path, phase: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nonstop.durable")
    root = tmp_path / "ckpt"
    store = DurableStore(root, keep=2)
    z, a = full_ckpt(Z_STEP), full_ckpt(A_STEP)
    persist(store, Z_STEP, z)
    persist(store, A_STEP, a)
    b = delta_ckpt(B_STEP, a)

    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import tests.snapshot.test_durable_faults as t; "
    code += f"t.crash_child({str(root)!r}, {phase!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    # The kill happened where it should have.
    bdir = root / step_dir(B_STEP)
    files = _files(root)
    latest = (root / LATEST).read_text()
    b_names = files.get(bdir.name, [])
    if phase == "bin_partial":
        assert any(".tmp-" in n for n in b_names) and rank_file(0) not in b_names
    elif phase == "bin_written":
        assert rank_file(0) in b_names and rank_file(1) not in b_names
    elif phase == "bins_done":
        assert all(rank_file(r) in b_names for r in range(WORLD)) and MANIFEST not in b_names
    elif phase == "manifest_partial":
        assert MANIFEST not in b_names and any(n.startswith(MANIFEST + ".tmp-") for n in b_names)
    elif phase == "manifest_written":
        assert MANIFEST in b_names and latest == f"{step_dir(A_STEP)}\n"
    elif phase == "latest_written":
        assert latest == f"{step_dir(B_STEP)}\n" and MANIFEST in files[step_dir(Z_STEP)]
    elif phase == "retention_partial":
        assert latest == f"{step_dir(B_STEP)}\n" and MANIFEST not in files[step_dir(Z_STEP)]

    # Loading gives A, or B once `latest` names it: never a mix, never a warning.
    if phase in ("latest_written", "retention_partial"):
        assert_loaded(store, None, B_STEP, b)
    else:
        assert_loaded(store, None, A_STEP, a)
    assert_loaded(store, A_STEP, A_STEP, a)
    assert warnings_of(caplog) == []

    # The next persist (a new writer: the killed one's successor) works and cleans up what the
    # killed one left.
    store = DurableStore(root, keep=2)
    c = full_ckpt(C_STEP)
    persist(store, C_STEP, c)
    assert_loaded(store, None, C_STEP, c)
    committed = store.steps()
    assert committed[-1] == C_STEP and len(committed) <= 3
    assert sorted(_files(root)) == sorted(step_dir(s) for s in committed)  # no abandoned dirs
    for d, names in _files(root).items():
        assert not any(".tmp-" in n for n in names), (d, names)
    assert not any(".tmp-" in n for n in os.listdir(root))
    for s in committed:
        assert store.verify(s) == []


# ---------------------------------------------------------------------------- corruption
def _bin(root: Path, step: int, rank: int) -> Path:
    return root / step_dir(step) / rank_file(rank)


def _flip_bin(root: Path) -> None:
    p = _bin(root, B_STEP, 1)
    flip_byte(p, p.stat().st_size // 2)


def _truncate_bin(root: Path) -> None:
    p = _bin(root, B_STEP, 1)
    p.write_bytes(p.read_bytes()[:-7])


def _missing_bin(root: Path) -> None:
    _bin(root, B_STEP, 2).unlink()


def _missing_manifest(root: Path) -> None:
    (root / step_dir(B_STEP) / MANIFEST).unlink()


def _corrupt_manifest(root: Path) -> None:
    p = root / step_dir(B_STEP) / MANIFEST
    flip_byte(p, p.stat().st_size // 3)


def _edited_manifest(root: Path) -> None:
    # valid JSON, plausible values, but not what was written
    p = root / step_dir(B_STEP) / MANIFEST
    p.write_bytes(p.read_bytes().replace(b'"data_len":', b'"data_len": ', 1))


def _corrupt_latest(root: Path) -> None:
    (root / LATEST).write_bytes(b"step-00\x00garbage")


def _missing_base(root: Path) -> None:
    import shutil

    shutil.rmtree(root / step_dir(A_STEP))


def _corrupt_base(root: Path) -> None:
    p = _bin(root, A_STEP, 0)
    flip_byte(p, 10)


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], int, list[str]]] = {
    # kind: (mutation, step load() falls back to, words the warning must contain)
    "flipped-bin": (_flip_bin, A_STEP, ["step 20", "rank 1", rank_file(1)]),
    "truncated-bin": (_truncate_bin, A_STEP, ["step 20", "rank 1", "truncated"]),
    "missing-bin": (_missing_bin, A_STEP, ["step 20", "rank 2", "missing"]),
    "missing-manifest": (_missing_manifest, A_STEP, ["step 20", "no manifest"]),
    "corrupt-manifest": (_corrupt_manifest, A_STEP, ["step 20", "manifest"]),
    "edited-manifest": (_edited_manifest, A_STEP, ["step 20", "manifest", "checksum"]),
    "corrupt-latest": (_corrupt_latest, B_STEP, ["latest", "corrupt"]),
    "missing-base": (_missing_base, Z_STEP, ["step 20", "rank 0", "base checkpoint step 10"]),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_falls_back_with_one_warning(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    mutate, expect_step, words = CORRUPTIONS[kind]
    store = DurableStore(tmp_path, keep=5)
    z, a = full_ckpt(Z_STEP), full_ckpt(A_STEP)
    b = delta_ckpt(B_STEP, a)
    persist(store, Z_STEP, z)
    persist(store, A_STEP, a)
    persist(store, B_STEP, b, base=(A_STEP, a))
    mutate(tmp_path)

    caplog.set_level(logging.INFO, logger="nonstop.durable")
    assert_loaded(store, None, expect_step, {Z_STEP: z, A_STEP: a, B_STEP: b}[expect_step])
    warns = warnings_of(caplog)
    assert len(warns) == 1, warns
    assert "\n" not in warns[0]
    for w in words:
        assert w in warns[0], (w, warns[0])
    if kind != "corrupt-latest":
        assert f"falling back to step {expect_step}" in warns[0]
        problems = store.verify(B_STEP)
        assert problems and any("step 20" in p for p in problems), problems
        with pytest.raises(SnapshotError):  # nothing is ever returned silently wrong
            store.load(B_STEP)
        report = store.describe()
        entry = [c for c in report["checkpoints"] if c["step"] == B_STEP]
        assert not entry or entry[0]["ok"] is False
    else:
        assert store.latest_step() == B_STEP
        assert "corrupt" in (store.describe(verify=False)["latest_problem"] or "")
    assert store.verify(Z_STEP) == []


def test_corrupt_base_and_delta_fall_back_twice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DurableStore(tmp_path, keep=5)
    z, a = full_ckpt(Z_STEP), full_ckpt(A_STEP)
    persist(store, Z_STEP, z)
    persist(store, A_STEP, a)
    persist(store, B_STEP, delta_ckpt(B_STEP, a), base=(A_STEP, a))
    _corrupt_base(tmp_path)
    caplog.set_level(logging.WARNING, logger="nonstop.durable")
    assert_loaded(store, None, Z_STEP, z)
    warns = warnings_of(caplog)
    assert len(warns) == 2 and "its base is unusable" in warns[0] and "step 10" in warns[1], warns


def test_every_manifest_byte_is_checked(tmp_path: Path) -> None:
    store = DurableStore(tmp_path)
    persist(store, 1, [make_rank(1, sizes=(10, 3))])
    p = tmp_path / step_dir(1) / MANIFEST
    good = p.read_bytes()
    for pos in range(len(good)):
        for mask in (0x01, 0x20):
            raw = bytearray(good)
            raw[pos] ^= mask
            p.write_bytes(bytes(raw))
            with pytest.raises(SnapshotCorruptError):
                store.load_rank(1, 0)
    p.write_bytes(good)
    assert store.verify(1) == []


def test_nothing_loadable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DurableStore(tmp_path)
    with pytest.raises(SnapshotMissingError, match="no committed checkpoint"):
        store.load()
    with pytest.raises(SnapshotMissingError):
        store.load(7)
    assert store.verify(7) and store.describe()["checkpoints"] == []
    persist(store, 7, full_ckpt(7, world=1))
    flip_byte(_bin(tmp_path, 7, 0), 3)
    caplog.set_level(logging.WARNING, logger="nonstop.durable")
    with pytest.raises(SnapshotMissingError, match="no loadable checkpoint"):
        store.load()
    assert len(warnings_of(caplog)) == 1


def test_missing_latest_uses_newest_manifest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = DurableStore(tmp_path)
    persist(store, 1, full_ckpt(1, world=1))
    persist(store, 2, full_ckpt(2, world=1))
    (tmp_path / LATEST).unlink()
    caplog.set_level(logging.WARNING, logger="nonstop.durable")
    assert_loaded(store, None, 2, full_ckpt(2, world=1))
    assert store.latest_step() == 2 and warnings_of(caplog) == []


def test_begin_replaces_a_corrupt_current_checkpoint(tmp_path: Path) -> None:
    store = DurableStore(tmp_path)
    persist(store, 1, full_ckpt(1, world=2))
    persist(store, 2, full_ckpt(2, world=2))
    flip_byte(_bin(tmp_path, 2, 1), 5)
    assert store.load().step == 1
    fresh = full_ckpt(2, world=2)
    persist(store, 2, fresh)  # training resumed from 1 and reached step 2 again
    assert_loaded(store, None, 2, fresh)


# ---------------------------------------------------------------------------- inspect
def test_describe_and_format_inspect(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=5)
    a = full_ckpt(A_STEP)
    persist(store, A_STEP, a)
    persist(store, B_STEP, delta_ckpt(B_STEP, a), base=(A_STEP, a))
    rep = store.describe()
    assert rep["latest"] == B_STEP and rep["uncommitted"] == []
    by_step = {c["step"]: c for c in rep["checkpoints"]}
    assert sorted(by_step) == [A_STEP, B_STEP]
    ca, cb = by_step[A_STEP], by_step[B_STEP]
    assert ca["ok"] and cb["ok"] and cb["latest"] and not ca["latest"]
    assert ca["base_step"] is None and cb["base_step"] == A_STEP and cb["delta_ranks"] == WORLD
    assert ca["world_size"] == WORLD and ca["data_bytes"] == sum(len(d) for _, d, _ in a)
    assert ca["stored_bytes"] == sum(_bin(tmp_path, A_STEP, r).stat().st_size for r in range(WORLD))
    assert ca["ratio"] == pytest.approx(ca["data_bytes"] / ca["stored_bytes"])
    assert cb["ratio"] > ca["ratio"]
    json.dumps(rep)  # JSON-able for --json output
    text = format_inspect(rep)
    assert "STEP" in text and "* " in text and "ok" in text and "CORRUPT" not in text
    _flip_bin(tmp_path)
    text = format_inspect(store.describe())
    assert "CORRUPT" in text and "rank 1" in text
    assert "(no committed checkpoints)" in format_inspect(DurableStore(tmp_path / "empty").describe())
