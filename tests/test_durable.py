"""The durable checkpoint tier: storage backends, format, atomicity under kills, corruption
fallback, retention."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError, UsageError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.codec import CodecConfig, Encoder, segments_for
from nonstop.snapshot.durable import (
    LATEST,
    MANIFEST,
    DurableStore,
    FsspecStorage,
    LocalStorage,
    Storage,
    WriterState,
    format_inspect,
    open_storage,
    rank_file,
    step_dir,
)
from nonstop.snapshot.durable import local as durable_local

REPO = Path(__file__).resolve().parent.parent
WORLD = 3
CHUNK = 16 << 10  # small chunks: every rank has several

RankData = tuple[bytes, bytearray, list[TensorEntry]]


# ---------------------------------------------------------------------------- helpers
def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def make_rank(seed: int, *, sizes: tuple[int, ...] = (3000, 517, 9000, 1)) -> RankData:
    """A rank snapshot like RankSnapshotStore writes: float32 tensors at 64-byte aligned
    offsets (zero padding between them) and the JSON meta describing them."""
    rng = np.random.default_rng(seed)
    entries, off = [], 0
    for n in sizes:
        entries.append(TensorEntry(dtype="float32", shape=(n,), offset=off, nbytes=4 * n))
        off = _align(off + 4 * n)
    data_len = entries[-1].offset + entries[-1].nbytes
    data = bytearray(data_len)
    for e in entries:
        vals = rng.standard_normal(e.shape[0]).astype(np.float32)
        data[e.offset : e.offset + e.nbytes] = vals.tobytes()
    meta = {"tree": {"seed": seed, "name": f"rank-{seed}"}, "tensors": [e.to_json() for e in entries]}
    return json.dumps(meta, separators=(",", ":")).encode(), data, entries


def perturb(base: RankData, seed: int) -> RankData:
    """Same layout as ``base``, a few values changed (as after one optimizer step)."""
    meta_b, data_b, entries = base
    rng = np.random.default_rng(seed)
    data = bytearray(data_b)
    for e in entries:
        vals = np.frombuffer(bytes(data[e.offset : e.offset + e.nbytes]), dtype=np.float32).copy()
        idx = rng.integers(0, len(vals), size=max(1, len(vals) // 50))
        vals[idx] += np.float32(0.5)
        data[e.offset : e.offset + e.nbytes] = vals.tobytes()
    meta = json.loads(meta_b)
    meta["tree"]["seed"] = seed
    return json.dumps(meta, separators=(",", ":")).encode(), data, entries


def full_ckpt(step: int, world: int = WORLD) -> list[RankData]:
    return [make_rank(step * 100 + r) for r in range(world)]


def delta_ckpt(step: int, base: list[RankData]) -> list[RankData]:
    return [perturb(b, step * 100 + r) for r, b in enumerate(base)]


def persist(
    store: DurableStore,
    step: int,
    ranks: list[RankData],
    *,
    base: tuple[int, list[RankData]] | None = None,
    codec: str = "zstd",
) -> None:
    cfg = CodecConfig(codec=codec, chunk_bytes=CHUNK)
    writer = store.begin(step, len(ranks), cfg.describe())
    for r, (meta, data, entries) in enumerate(ranks):
        enc = Encoder(cfg)
        try:
            base_data = None if base is None else bytes(base[1][r][1])
            chunks = enc.encode(bytes(data), segments_for(entries, len(data)), base=base_data)
        finally:
            enc.close()
        written = writer.add_rank(r, meta, len(data), chunks, None if base is None else base[0])
        assert written == sum(len(p) for _, p in chunks)
    writer.commit()


def assert_loaded(store: DurableStore, step: int | None, expect_step: int, ranks: list[RankData]) -> None:
    ck = store.load(step)
    assert ck.step == expect_step
    assert ck.world_size == len(ranks)
    for r, (meta, data, _) in enumerate(ranks):
        assert ck.meta(r) == meta
        assert bytes(ck.data(r)) == bytes(data), f"rank {r} data differs"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "nonstop.durable" and r.levelno >= logging.WARNING
    ]


@contextlib.contextmanager
def misuse(match: str | None = None) -> Iterator[None]:
    """API misuse raises a plain ValueError: UsageError (a ValueError too) is reserved for
    what a person typed."""
    with pytest.raises(ValueError, match=match) as ei:
        yield
    assert not isinstance(ei.value, UsageError), repr(ei.value)


def flip_byte(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x5A
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------------------- storage contract
@pytest.fixture(params=["local", "local-buffered", "memory", "fsspec-file"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield LocalStorage(tmp_path / "root")
    elif request.param == "local-buffered":
        yield LocalStorage(tmp_path / "root", direct=False)
    elif request.param == "fsspec-file":
        yield FsspecStorage(f"file://{tmp_path}/root")
    else:
        st = FsspecStorage(f"memory://nonstop-test-{uuid.uuid4().hex}")
        yield st
        st.remove_tree("")


def test_storage_contract(storage: Storage) -> None:
    assert storage.listdir("") == []
    assert not storage.exists("a/b.bin")
    with pytest.raises(SnapshotMissingError):
        storage.read("a/b.bin")
    with pytest.raises(SnapshotMissingError):
        storage.size("a/b.bin")

    floats = np.arange(4, dtype=np.float32)
    n = storage.write("a/b.bin", [b"hello ", bytearray(b"wor"), memoryview(b"ld!"), floats])
    assert n == 12 + 16
    assert storage.read("a/b.bin") == b"hello world!" + floats.tobytes()
    assert storage.read("a/b.bin", 6, 6) == b"world!"
    assert storage.read("a/b.bin", 6) == b"world!" + floats.tobytes()
    assert storage.read("a/b.bin", 26, 100) == floats.tobytes()[-2:]
    assert storage.size("a/b.bin") == 28
    assert storage.exists("a/b.bin") and storage.exists("a")

    assert storage.write("a/empty", []) == 0
    assert storage.exists("a/empty") and storage.size("a/empty") == 0 and storage.read("a/empty") == b""
    storage.write("top", [b"x"])
    assert storage.listdir("") == ["a", "top"]
    assert storage.listdir("a") == ["b.bin", "empty"]
    assert storage.listdir("nope") == []

    storage.write("a/b.bin", [b"new"])  # overwrite replaces the whole object
    assert storage.read("a/b.bin") == b"new" and storage.size("a/b.bin") == 3

    big = np.random.default_rng(0).integers(0, 255, size=5 << 20, dtype=np.uint8)
    assert storage.write("big/x.bin", [big[: 1 << 20], big[1 << 20 :]]) == big.nbytes
    assert storage.read("big/x.bin") == big.tobytes()
    assert storage.read("big/x.bin", 3 << 20, 10) == big[3 << 20 : (3 << 20) + 10].tobytes()

    def failing() -> Iterator[bytes]:
        yield b"partial"
        raise RuntimeError("boom")

    # A failed write never leaves a partial object under the final name.
    with pytest.raises(RuntimeError):
        storage.write("a/fresh.bin", failing())
    assert not storage.exists("a/fresh.bin")
    with pytest.raises(RuntimeError):
        storage.write("a/b.bin", failing())
    if isinstance(storage, LocalStorage):
        assert storage.read("a/b.bin") == b"new"  # the old object survives intact
    else:
        assert not storage.exists("a/b.bin") or storage.read("a/b.bin") == b"new"
    assert [n for n in storage.listdir("a") if ".tmp-" in n] == []

    storage.remove_tree("a/empty")
    assert not storage.exists("a/empty")
    storage.remove_tree("a")
    storage.remove_tree("does/not/exist")
    assert storage.listdir("") == ["big", "top"]
    with pytest.raises(SnapshotError):
        storage.write("../escape", [b"x"])


@pytest.mark.parametrize("direct", [True, False])
def test_local_write_sizes_around_the_staging_buffer(tmp_path: Path, direct: bool) -> None:
    st = LocalStorage(tmp_path, direct=direct)
    rng = np.random.default_rng(1)
    stage = durable_local._STAGE
    for sizes in [(stage - 1, 2, 4097, stage, 3, 0), (stage,), (4096,), (1,), (stage + 4096, 5)]:
        parts = [rng.integers(0, 255, size=n, dtype=np.uint8).tobytes() for n in sizes]
        assert st.write("f.bin", parts) == sum(sizes)
        assert st.size("f.bin") == sum(sizes)
        assert st.read("f.bin") == b"".join(parts)


def test_local_write_is_durable_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = LocalStorage(tmp_path / "r")
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    st.write("d/e/f.bin", [b"abc"])
    # new dirs r, d, e (parents fsynced), the file itself, and its directory
    assert len(synced) >= 5
    assert sorted(os.listdir(tmp_path / "r" / "d" / "e")) == ["f.bin"]


def test_local_throttle(tmp_path: Path) -> None:
    st = LocalStorage(tmp_path, max_bytes_per_s=4 << 20)
    t0 = time.monotonic()
    st.write("x", [bytes(2 << 20)])
    assert time.monotonic() - t0 >= 0.4  # 2 MiB at 4 MiB/s
    with misuse("max_bytes_per_s"):
        LocalStorage(tmp_path, max_bytes_per_s=0)


def test_open_storage(tmp_path: Path) -> None:
    st = open_storage(str(tmp_path / "a"))
    assert isinstance(st, LocalStorage) and st.root == str(tmp_path / "a")
    st = open_storage(f"file://{tmp_path}/b")
    assert isinstance(st, LocalStorage) and st.root == f"{tmp_path}/b"
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage("memory://x"), FsspecStorage)
    for bad in ["", "   ", "bogus-proto://x/y", "3x://y"]:
        with pytest.raises(UsageError) as ei:
            open_storage(bad)
        assert "\n" not in str(ei.value)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="is a file"):
        open_storage(str(tmp_path / "afile"))
    with misuse("use LocalStorage"):
        FsspecStorage(str(tmp_path / "a"))  # a path, not a URL: the caller picked the wrong class


def test_store_arguments(tmp_path: Path) -> None:
    for keep in [0, -1, True, "3", 1.5]:
        with pytest.raises(UsageError, match="keep"):
            DurableStore(tmp_path, keep=keep)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        DurableStore("bogus-proto://somewhere")
    for bad_call in (
        lambda: DurableStore(12345),  # type: ignore[arg-type]
        lambda: DurableStore(tmp_path, threads=0),
        lambda: DurableStore(tmp_path).begin(-1, 2, "zstd"),
        lambda: DurableStore(tmp_path).begin(1, 0, "zstd"),
        lambda: DurableStore(tmp_path).contribute(True, 2, "zstd"),  # type: ignore[arg-type]
        lambda: DurableStore(tmp_path).contribute(1, 0, "zstd"),
    ):
        with misuse():
            bad_call()
    assert DurableStore(LocalStorage(tmp_path)).url == str(tmp_path)


# ---------------------------------------------------------------------------- round trips
@pytest.fixture(params=["local", "memory"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "ckpt")
    else:
        url = f"memory://nonstop-test-{uuid.uuid4().hex}"
        yield url
        open_storage(url).remove_tree("")


def test_round_trip_full_and_delta(store_url: str) -> None:
    store = DurableStore(store_url, keep=5)
    assert store.steps() == [] and store.latest_step() is None
    a = full_ckpt(10)
    persist(store, 10, a)
    b = delta_ckpt(20, a)
    persist(store, 20, b, base=(10, a))
    assert store.steps() == [10, 20] and store.latest_step() == 20
    assert_loaded(store, None, 20, b)
    assert_loaded(store, 10, 10, a)
    assert_loaded(store, 20, 20, b)
    meta, data = store.load_rank(20, 1)
    assert meta == b[1][0] and bytes(data) == bytes(b[1][1])
    assert store.verify(10) == [] and store.verify(20) == []

    st = store.storage
    assert st.read(LATEST) == f"{step_dir(20)}\n".encode()
    assert st.listdir(step_dir(20)) == sorted([*(rank_file(r) for r in range(WORLD)), MANIFEST])
    man = json.loads(st.read(f"{step_dir(20)}/{MANIFEST}"))
    assert man["format"] == "nonstop-checkpoint" and man["version"] == 2
    assert man["step"] == 20 and man["world_size"] == WORLD
    assert [r["base_step"] for r in man["ranks"]] == [10] * WORLD
    assert all(c["delta"] for r in man["ranks"] for c in r["chunks"])
    assert json.loads(man["ranks"][0]["meta"]) == json.loads(b[0][0])
    full_bytes = sum(st.size(f"{step_dir(10)}/{rank_file(r)}") for r in range(WORLD))
    delta_bytes = sum(st.size(f"{step_dir(20)}/{rank_file(r)}") for r in range(WORLD))
    assert delta_bytes < full_bytes / 2, (delta_bytes, full_bytes)
    with pytest.raises(SnapshotMissingError):
        store.load(30)


def test_round_trip_raw_codec_and_empty_rank(tmp_path: Path) -> None:
    store = DurableStore(tmp_path)
    ranks = [make_rank(1), make_rank(2, sizes=(0,)), make_rank(3, sizes=(1 << 16, 7))]
    persist(store, 5, ranks, codec="none")
    assert_loaded(store, None, 5, ranks)
    man = json.loads((tmp_path / step_dir(5) / MANIFEST).read_bytes())
    assert man["ranks"][1]["data_len"] == 0
    assert man["ranks"][2]["file_len"] >= man["ranks"][2]["data_len"]


def test_world_size_mismatch(tmp_path: Path) -> None:
    store = DurableStore(tmp_path)
    persist(store, 3, full_ckpt(3))
    with pytest.raises(UsageError, match="--nproc-per-node 3") as ei:
        store.load(world_size=2)
    assert "\n" not in str(ei.value)
    assert store.load(world_size=3).step == 3


def test_writer_rules(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=5)
    a = full_ckpt(10)
    persist(store, 10, a)
    b = delta_ckpt(20, a)
    persist(store, 20, b, base=(10, a))
    c = delta_ckpt(30, b)
    with misuse("FULL"):  # a delta of a delta
        persist(store, 30, c, base=(20, b))
    with misuse("base checkpoint step 15"):
        persist(store, 30, c, base=(15, a))
    with misuse("older step"):
        persist(store, 30, c, base=(30, a))
    other = [make_rank(7, sizes=(100, 200)), *c[1:]]
    with misuse("layout"):
        persist(store, 30, other, base=(10, [make_rank(7, sizes=(100, 200)), *a[1:]]))

    cfg = CodecConfig(codec="zstd", chunk_bytes=CHUNK)
    meta, data, entries = c[0]
    delta_chunks = Encoder(cfg).encode(bytes(data), segments_for(entries, len(data)), base=bytes(a[0][1]))
    full_chunks = Encoder(cfg).encode(bytes(data), segments_for(entries, len(data)))
    w = store.begin(40, 2, cfg.describe())
    with misuse("base_step"):
        w.add_rank(0, meta, len(data), delta_chunks, None)
    with misuse("outside"):
        w.add_rank(2, meta, len(data), full_chunks, None)
    with misuse("JSON"):
        w.add_rank(0, b"\xff not json", len(data), full_chunks, None)
    with misuse("cover"):
        w.add_rank(0, meta, len(data) + 64, full_chunks, None)
    w.add_rank(0, meta, len(data), full_chunks, None)
    with misuse("already added"):
        w.add_rank(0, meta, len(data), full_chunks, None)
    with misuse(r"ranks \[1\]"):
        w.commit()
    with misuse("was not added"):
        w.record(1)
    w.abort()
    assert w.state is WriterState.ABORTED
    assert not store.storage.exists(step_dir(40))
    with misuse("already aborted"):
        w.commit()
    with misuse("already aborted"):
        w.add_rank(1, meta, len(data), full_chunks, None)
    w.abort()  # idempotent
    # Re-persisting the current good checkpoint is refused; nothing was touched.
    with misuse("already committed"):
        store.begin(20, WORLD, "zstd")
    with misuse("already committed"):
        store.begin(10, WORLD, "zstd")  # the base of the current one
    assert store.steps() == [10, 20] and store.verify(20) == []
    # A committed writer is done: it neither commits again nor aborts (removes) its checkpoint.
    w = store.begin(50, 1, cfg.describe())
    w.add_rank(0, meta, len(data), full_chunks, None)
    w.commit()
    assert w.state is WriterState.COMMITTED
    with misuse("already committed"):
        w.commit()
    w.abort()
    assert w.state is WriterState.COMMITTED
    assert store.steps() == [10, 20, 50] and store.verify(50) == []


def _contribute(store: DurableStore, step: int, rank: int, rd: RankData, base: RankData | None) -> dict:
    """One contributor (a node) writes one rank of checkpoint ``step``; returns its record."""
    cfg = CodecConfig(codec="zstd", chunk_bytes=CHUNK)
    meta, data, entries = rd
    enc = Encoder(cfg)
    try:
        chunks = enc.encode(
            bytes(data), segments_for(entries, len(data)), base=None if base is None else bytes(base[1])
        )
    finally:
        enc.close()
    part = store.contribute(step, WORLD, cfg.describe())
    part.add_rank(rank, meta, len(data), chunks, None if base is None else 10)
    with misuse("contributor cannot commit"):
        part.commit()
    return part.record(rank)


def test_checkpoint_written_by_several_contributors(tmp_path: Path) -> None:
    """Nodes write their own ranks; the owner adopts their records (validated) and commits."""
    store = DurableStore(tmp_path, keep=5)
    a = full_ckpt(10)
    owner = store.begin(10, WORLD, "zstd")
    records = [json.loads(json.dumps(_contribute(store, 10, r, a[r], None))) for r in range(WORLD)]
    assert not store.steps()  # nothing exists until the owner commits
    for rec in reversed(records):
        owner.adopt(rec)
    owner.commit()
    assert_loaded(store, None, 10, a)

    b = delta_ckpt(20, a)
    owner = store.begin(20, WORLD, "zstd")
    good = _contribute(store, 20, 0, b[0], a[0])  # a delta against the owner's step 10
    assert good["base_step"] == 10
    with pytest.raises(SnapshotCorruptError, match="not a rank entry"):
        owner.adopt({"rank": True})
    with pytest.raises(SnapshotCorruptError, match="outside"):
        owner.adopt({**good, "rank": WORLD})
    with pytest.raises(SnapshotCorruptError, match="meta"):
        owner.adopt({**good, "meta": good["meta"].replace("rank-", "rank_")})
    with pytest.raises(SnapshotCorruptError, match="file"):
        owner.adopt({**good, "file": rank_file(1)})
    owner.adopt(good)
    with pytest.raises(SnapshotCorruptError, match="twice"):
        owner.adopt(good)
    truncated = _contribute(store, 20, 1, b[1], a[1])
    (tmp_path / step_dir(20) / rank_file(1)).write_bytes(b"short")
    with pytest.raises(SnapshotCorruptError, match="bytes"):
        owner.adopt(truncated)
    with misuse(r"ranks \[1, 2\]"):
        owner.commit()
    owner.abort()
    assert store.steps() == [10] and not (tmp_path / step_dir(20)).exists()

    # A contributor's abort removes only its own files.
    owner = store.begin(30, WORLD, "zstd")
    kept = _contribute(store, 30, 0, b[0], None)
    part = store.contribute(30, WORLD, "zstd")
    cfg = CodecConfig(codec="zstd", chunk_bytes=CHUNK)
    meta, data, entries = b[1]
    part.add_rank(
        1, meta, len(data), Encoder(cfg).encode(bytes(data), segments_for(entries, len(data))), None
    )
    part.abort()
    assert sorted(p.name for p in (tmp_path / step_dir(30)).iterdir()) == [rank_file(0)]
    owner.adopt(kept)


# ---------------------------------------------------------------------------- retention
def test_retention_keeps_newest_and_their_bases(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=2)
    for s in (10, 20, 30, 40):
        persist(store, s, full_ckpt(s, world=1))
    assert store.steps() == [30, 40]
    base = full_ckpt(50, world=1)
    persist(store, 50, base)
    for s in (60, 70, 80):
        persist(store, s, delta_ckpt(s, base), base=(50, base))
    assert store.steps() == [50, 70, 80]  # 50 stays: the base of 70 and 80
    assert_loaded(store, 70, 70, delta_ckpt(70, base))
    persist(store, 90, full_ckpt(90, world=1))
    assert store.steps() == [50, 80, 90]
    persist(store, 100, full_ckpt(100, world=1))
    assert store.steps() == [90, 100]
    assert sorted(os.listdir(tmp_path)) == [LATEST, step_dir(90), step_dir(100)]
    assert_loaded(store, None, 100, full_ckpt(100, world=1))


def test_keep_one(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=1)
    for s in (1, 2, 3):
        persist(store, s, full_ckpt(s, world=2))
        assert store.steps() == [s]
    assert_loaded(store, None, 3, full_ckpt(3, world=2))


def test_abandoned_dirs_and_superseded_timeline(tmp_path: Path) -> None:
    store = DurableStore(tmp_path, keep=3)
    for s in (10, 20, 30):
        persist(store, s, full_ckpt(s, world=2))
    # an abandoned persist (no manifest) and a stray temp file from a killed writer
    w = store.begin(40, 2, "zstd")
    meta, data, entries = make_rank(1)
    cfg = CodecConfig(codec="zstd", chunk_bytes=CHUNK)
    w.add_rank(0, meta, len(data), Encoder(cfg).encode(bytes(data), segments_for(entries, len(data))), None)
    (tmp_path / f"{LATEST}.tmp-999-abcd").write_text("junk")
    assert store.steps() == [10, 20, 30]
    assert store.describe(verify=False)["uncommitted"] == [step_dir(40)]
    assert_loaded(store, None, 30, full_ckpt(30, world=2))
    # training resumed from step 20 (a new process) and persists step 25: 30 and the abandoned 40
    # belong to the superseded timeline it declared and go; 25 becomes latest.
    store = DurableStore(tmp_path, keep=3)
    store._catalog.resumed_from(20)
    persist(store, 25, full_ckpt(25, world=2))
    assert store.steps() == [10, 20, 25]
    assert sorted(os.listdir(tmp_path)) == [LATEST, step_dir(10), step_dir(20), step_dir(25)]
    assert_loaded(store, None, 25, full_ckpt(25, world=2))


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

    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import tests.test_durable as t; "
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
