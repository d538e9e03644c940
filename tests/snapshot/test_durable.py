"""The durable checkpoint tier: storage backends (one contract), the format's round trips (full,
delta, several contributors), the writer's rules and retention. Under faults (kills, corruption):
``test_durable_faults.py``."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError, UsageError
from nonstop.snapshot.codec import CodecConfig, Encoder, segments_for
from nonstop.snapshot.durable import (
    LATEST,
    MANIFEST,
    DurableStore,
    FsspecStorage,
    LocalStorage,
    Storage,
    WriterState,
    open_storage,
    rank_file,
    step_dir,
)
from nonstop.snapshot.durable import local as durable_local
from tests.durable_fakes import (
    CHUNK,
    WORLD,
    RankData,
    assert_loaded,
    delta_ckpt,
    full_ckpt,
    make_rank,
    misuse,
    persist,
)


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
