"""Regressions of the decoder hardening (issue 17, item 6): bytes from disk, shared memory or a peer
that are corrupt in a way no checksum catches (a manifest re-signed after an edit, a slot header
scribbled over) must raise SnapshotCorruptError -- never a bare ValueError, MemoryError or
RecursionError -- must not make the reader allocate what a length field claims before it is
checked, and the callers must fall back: a durable load to the next older checkpoint, a rank's
snapshot slots to another slot or a clean "no snapshot".

Each test here failed on the code before the hardening."""

from __future__ import annotations

import json
import logging
import struct
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nonstop.errors import SnapshotCorruptError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.api import HEADER_FMT, SlotState, TensorEntry
from nonstop.snapshot.codec import (
    ChunkInfo,
    CodecConfig,
    Encoder,
    checksum,
    decode,
    decode_chunk,
    segments_for,
)
from nonstop.snapshot.durable import MANIFEST, DurableStore, step_dir
from nonstop.snapshot.durable.format import decode_manifest
from nonstop.snapshot.sharded import decode_dtensor
from nonstop.snapshot.store import decode_raw, slot_path

OLD, NEW = 10, 20


# ---------------------------------------------------------------------------- helpers
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _rank(seed: int, n: int = 5000) -> tuple[bytes, bytes, list[TensorEntry]]:
    vals = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    entries = [TensorEntry(dtype="float32", shape=(n,), offset=0, nbytes=4 * n)]
    meta = _canonical({"tree": {"w": {"__t__": 0}, "seed": seed}, "tensors": [e.to_json() for e in entries]})
    return meta, vals.tobytes(), entries


def _persist(store: DurableStore, step: int, codec: str = "zstd") -> tuple[bytes, bytes]:
    meta, data, entries = _rank(step)
    cfg = CodecConfig(codec=codec, chunk_bytes=8 << 10)
    writer = store.begin(step, 1, cfg.describe())
    with Encoder(cfg) as enc:
        chunks = enc.encode(data, segments_for(entries, len(data)))
        writer.add_rank(0, meta, len(data), chunks, None)
    writer.commit()
    return meta, data


def _resign(root: Path, step: int, edit: Any) -> None:
    """Apply ``edit`` to checkpoint ``step``'s parsed manifest and write it back with a valid
    manifest_crc: a corruption no checksum catches (or a deliberate forgery)."""
    path = root / step_dir(step) / MANIFEST
    doc = json.loads(path.read_bytes())
    doc.pop("manifest_crc")
    edit(doc)
    path.write_bytes(_canonical({**doc, "manifest_crc": zlib.crc32(_canonical(doc))}) + b"\n")


def _two_checkpoints(root: Path, codec: str = "zstd") -> tuple[DurableStore, tuple[bytes, bytes]]:
    store = DurableStore(root, keep=5)
    old = _persist(store, OLD, codec)
    _persist(store, NEW, codec)
    return store, old


def _load_falls_back(store: DurableStore, old: tuple[bytes, bytes], caplog: pytest.LogCaptureFixture) -> str:
    """``load()`` returns checkpoint OLD intact and logs one warning naming NEW; the warning."""
    caplog.set_level(logging.WARNING, logger="nonstop.durable")
    ck = store.load()
    assert ck.step == OLD and ck.meta(0) == old[0] and bytes(ck.data(0)) == old[1]
    warns = [r.getMessage() for r in caplog.records if r.name == "nonstop.durable"]
    assert len(warns) == 1 and f"step {NEW}" in warns[0] and f"falling back to step {OLD}" in warns[0], warns
    with pytest.raises(SnapshotCorruptError):
        store.load(NEW)
    assert store.verify(NEW)
    return warns[0]


# ---------------------------------------------------------------------------- durable manifests
def _huge_last_chunk(claim: int) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        rank = doc["ranks"][0]
        last = rank["chunks"][-1]
        rank["data_len"] += claim - last["length"]
        last["length"] = claim

    return edit


def test_resigned_manifest_claiming_exabytes_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid CRC and a length field of 2**60 bytes: was a MemoryError out of load()."""
    store, old = _two_checkpoints(tmp_path)
    _resign(tmp_path, NEW, _huge_last_chunk(1 << 60))
    _load_falls_back(store, old, caplog)


def test_resigned_manifest_is_checked_before_the_rank_buffer_is_allocated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A length that would fit in memory (256 MiB) but that the chunk's payload does not hold:
    the loader used to allocate it first and find out after."""
    store, old = _two_checkpoints(tmp_path)
    _resign(tmp_path, NEW, _huge_last_chunk(256 << 20))
    tracemalloc.start()
    try:
        _load_falls_back(store, old, caplog)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"loading allocated {peak} bytes"


def test_raw_chunk_of_the_wrong_length_in_a_manifest_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stored-raw chunk whose length differs from its payload's: was a bare numpy ValueError
    (turned into a corrupt error by the loader only by accident of its except list)."""
    store, old = _two_checkpoints(tmp_path, codec="none")
    _resign(tmp_path, NEW, _huge_last_chunk(1 << 20))
    warning = _load_falls_back(store, old, caplog)
    assert "manifest" in warning and "a raw payload must be exactly" in warning, warning


def test_deeply_nested_manifest_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Was a RecursionError out of load()."""
    store, old = _two_checkpoints(tmp_path)
    (tmp_path / step_dir(NEW) / MANIFEST).write_bytes(b"[" * 200_000)
    _load_falls_back(store, old, caplog)


def test_checkpoint_whose_meta_does_not_decode_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank meta with a matching meta_crc that names a tensor past the data: load() used to
    return it, and the restore failed later with no older checkpoint tried."""

    def edit(doc: dict[str, Any]) -> None:
        meta = _canonical({"tree": {"w": {"__t__": 0}}, "tensors": [["float32", [5000], 64, 20000]]})
        doc["ranks"][0]["meta"] = meta.decode()
        doc["ranks"][0]["meta_crc"] = checksum(meta)

    store, old = _two_checkpoints(tmp_path)
    _resign(tmp_path, NEW, edit)
    assert "tensor" in _load_falls_back(store, old, caplog)


def test_deeply_nested_meta_of_a_delta_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The layout comparison of a delta with its base parsed the meta unguarded: RecursionError."""
    store = DurableStore(tmp_path, keep=5)
    old = _persist(store, OLD)
    meta, data, entries = _rank(OLD)
    new = bytearray(data)
    new[:4] = b"\x01\x02\x03\x04"
    cfg = CodecConfig(chunk_bytes=8 << 10)
    writer = store.begin(NEW, 1, cfg.describe())
    with Encoder(cfg) as enc:
        chunks = enc.encode(bytes(new), segments_for(entries, len(new)), base=old[1])
        writer.add_rank(0, meta, len(new), chunks, OLD)
    writer.commit()

    def edit(doc: dict[str, Any]) -> None:
        deep = b"[" * 100_000 + b"]" * 100_000
        doc["ranks"][0]["meta"] = deep.decode()
        doc["ranks"][0]["meta_crc"] = checksum(deep)

    _resign(tmp_path, NEW, edit)
    _load_falls_back(store, old, caplog)


@pytest.mark.parametrize("edit", ["drop-base_step", "extra-key", "int-created_at"])
def test_resigned_manifest_with_other_fields_is_corrupt(tmp_path: Path, edit: str) -> None:
    """decode_manifest accepts exactly what encode_manifest writes: a re-signed manifest without
    ``base_step`` (a delta would read as a full checkpoint) or with a key it never writes was
    accepted."""

    def apply(doc: dict[str, Any]) -> None:
        if edit == "drop-base_step":
            del doc["ranks"][0]["base_step"]
        elif edit == "extra-key":
            doc["ranks"][0]["note"] = 1
        else:
            doc["created_at"] = int(doc["created_at"])

    store, _ = _two_checkpoints(tmp_path)
    _resign(tmp_path, NEW, apply)
    with pytest.raises(SnapshotCorruptError, match="manifest"):
        decode_manifest((tmp_path / step_dir(NEW) / MANIFEST).read_bytes(), "here")
    assert store.load().step == OLD


def test_resigned_manifest_with_a_long_file_name_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by benchmarks/bench_fuzz.py: a file name longer than the file system takes made
    the read raise OSError (ENAMETOOLONG) out of load()."""

    def edit(doc: dict[str, Any]) -> None:
        doc["ranks"][0]["file"] = "y" * 1000

    store, old = _two_checkpoints(tmp_path)
    _resign(tmp_path, NEW, edit)
    assert "is not 'rank-00000.bin'" in _load_falls_back(store, old, caplog)


# ---------------------------------------------------------------------------- codec
def test_raw_chunk_of_the_wrong_length_is_corrupt() -> None:
    payload = b"\x07" * 8
    info = ChunkInfo(
        offset=0,
        length=16,
        typesize=1,
        codec="raw",
        delta=False,
        enc_len=8,
        crc_enc=checksum(payload),
        crc_raw=0,
    )
    with pytest.raises(SnapshotCorruptError, match="raw"):
        decode_chunk(info, payload, memoryview(bytearray(16)), None)
    with pytest.raises(SnapshotCorruptError):
        decode([(info, payload)], bytearray(16), None)
    with pytest.raises(SnapshotCorruptError, match="raw"):
        ChunkInfo.from_json(info.to_json())


# ---------------------------------------------------------------------------- raw snapshots, DTensors
@pytest.mark.parametrize(
    ("meta", "data_len"),
    [
        ({"tree": {"__t__": 0}, "tensors": [["float32", [2], 0, 8]]}, 4),  # past the data
        ({"tree": {"__t__": 0}, "tensors": [["float32", [3], 0, 8]]}, 8),  # shape vs nbytes
        ({"tree": {"__t__": 0}, "tensors": [["float32", [2], 2, 8]]}, 16),  # misaligned
        ({"tree": {"__t__": 1}, "tensors": [["float32", [2], 0, 8]]}, 8),  # no tensor 1
        ({"tree": {"__t__": -1}, "tensors": [["float32", [2], 0, 8]]}, 8),  # silently the last one
        ({"tree": {"__t__": 0}, "tensors": [["float32", [2], 0]]}, 8),  # entry too short
        ({"tree": {"__t__": 0}, "tensors": [["nosuch", [2], 0, 8]]}, 8),
        ({"tree": {"__dict__": [[[1], 2]]}, "tensors": []}, 0),  # unhashable key
        ({"tree": {"__nd__": 0}, "tensors": [["bfloat16", [4], 0, 8]]}, 8),  # no numpy bfloat16
        ({"tensors": []}, 0),
        ([], 0),
    ],
)
def test_decode_raw_raises_only_the_corrupt_error(meta: Any, data_len: int) -> None:
    with pytest.raises(SnapshotCorruptError):
        decode_raw(_canonical(meta), bytearray(data_len))


def test_decode_raw_of_garbage_bytes() -> None:
    for meta in (b"\xff\xfe", b"[" * 100_000, b"{" + b'"a":' * 3):
        with pytest.raises(SnapshotCorruptError):
            decode_raw(meta, bytearray(8))


@pytest.mark.parametrize(
    "node",
    [
        {"__dt__": 0, "shape": [1e400], "stride": [1], "placements": [], "mesh": []},  # OverflowError
        {"__dt__": -1, "shape": [2], "stride": [1], "placements": [], "mesh": []},  # silently the last
        {"__dt__": True, "shape": [2], "stride": [1], "placements": [], "mesh": []},
        {"__dt__": 0, "shape": [2], "stride": [1], "placements": [], "mesh": [], "offset": 5},
    ],
)
def test_decode_dtensor_raises_only_the_corrupt_error(node: dict[str, Any]) -> None:
    with pytest.raises(SnapshotCorruptError):
        decode_dtensor(node, [torch.zeros(2)])


# ---------------------------------------------------------------------------- shared-memory slots
def _poke_header(path: Path, **fields: float) -> None:
    names = ["magic", "version", "state", "step", "data_len", "meta_len", "data_cap", "meta_cap"]
    names += ["written_at", "pinned", "writer_pid"]
    size = struct.calcsize(HEADER_FMT)
    with path.open("r+b") as f:
        raw = list(struct.unpack(HEADER_FMT, f.read(size)))
        for k, v in fields.items():
            raw[names.index(k)] = v
        f.seek(0)
        f.write(struct.pack(HEADER_FMT, *raw))


GARBAGE_HEADERS: dict[str, dict[str, int]] = {
    "version": {"version": 99},  # was SnapshotError from every probe, forever
    "state": {"state": 7},  # was ValueError
    "data_cap": {"data_cap": 1 << 60, "data_len": 1 << 59},  # was a read past the mapping
    "data_len": {"data_len": 1 << 40},
    "meta_len": {"meta_len": 1 << 40},
}


def _header(path: Path) -> tuple[Any, ...]:
    return struct.unpack(HEADER_FMT, path.read_bytes()[: struct.calcsize(HEADER_FMT)])


def _slot_of(tmp_path: Path, step: int) -> int:
    return next(i for i in range(2) if _header(slot_path(tmp_path, "t", 0, i))[3] == step)


def _written_store(tmp_path: Path) -> RankSnapshotStore:
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=0, num_slots=2)
    store.write(1, {"w": torch.arange(4.0)})
    store.write(2, {"w": torch.arange(4.0) + 1})
    return store


@pytest.mark.parametrize("kind", list(GARBAGE_HEADERS))
def test_garbage_slot_header_is_skipped_and_the_rank_writes_on(tmp_path: Path, kind: str) -> None:
    writer = _written_store(tmp_path)
    writer.close()
    newest = _slot_of(tmp_path, 2)
    _poke_header(slot_path(tmp_path, "t", 0, newest), **GARBAGE_HEADERS[kind])

    # The rank's replacement: the garbage slot reads as "no snapshot", the other one still works.
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=0, num_slots=2)
    try:
        assert store.complete_steps() == [1]
        assert store.info(newest) is None
        assert torch.equal(store.read(1)["w"], torch.arange(4.0))
        with pytest.raises(SnapshotMissingError):
            store.read(2)
        assert store.copy_out(1).step == 1
        # It writes on (into the garbage slot, which it re-initialises) and reads back.
        store.write(3, {"w": torch.arange(4.0) + 3})
        store.write(4, {"w": torch.arange(4.0) + 4})
        assert store.complete_steps() == [3, 4]
        assert torch.equal(store.read(4)["w"], torch.arange(4.0) + 4)
    finally:
        store.close()


def test_garbage_in_every_slot_header_reports_no_snapshot(tmp_path: Path) -> None:
    _written_store(tmp_path).close()
    for i in range(2):
        _poke_header(slot_path(tmp_path, "t", 0, i), version=1234, pinned=0xDEAD)
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=0, num_slots=2)
    try:
        assert store.complete_steps() == []
        with pytest.raises(SnapshotMissingError):
            store.read(2)
        store.write(5, {"w": torch.ones(3)})
        assert store.complete_steps() == [5]
    finally:
        store.close()


def test_pin_words_left_set_in_every_slot_do_not_wedge_the_writer(tmp_path: Path) -> None:
    """A reader that died holding its pins (or scribbled pin words) in every slot: the writer
    raised StopIteration on every write."""
    _written_store(tmp_path).close()
    for i in range(2):
        _poke_header(slot_path(tmp_path, "t", 0, i), pinned=3)
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=0, num_slots=2)
    try:
        store.write(3, {"w": torch.arange(4.0) + 3})
        assert 3 in store.complete_steps()
        assert torch.equal(store.read(3)["w"], torch.arange(4.0) + 3)
    finally:
        store.close()


def test_corrupt_meta_in_a_complete_slot_is_a_corrupt_error(tmp_path: Path) -> None:
    """The slot header is fine but the JSON meta behind it is scribbled over: was a bare
    JSONDecodeError / UnicodeDecodeError out of read()."""
    store = _written_store(tmp_path)
    try:
        path = slot_path(tmp_path, "t", 0, 0)
        raw = _header(path)
        assert raw[2] == SlotState.COMPLETE
        meta_at = 4096 + raw[6]
        with path.open("r+b") as f:
            f.seek(meta_at)
            f.write(b"\xff" * raw[5])
        with pytest.raises(SnapshotCorruptError, match=f"step {raw[3]}"):
            store.read(raw[3])
        snap = store.copy_out(raw[3])
        with pytest.raises(SnapshotCorruptError):
            snap.entries()
    finally:
        store.close()


def test_a_step_in_two_slots_reads_from_the_newest_write(tmp_path: Path) -> None:
    """A step redone after a rollback can be in two slots: read and copy_out used the first slot
    by index, which may hold the stale write (found by benchmarks/bench_fuzz.py)."""
    store = _written_store(tmp_path)
    try:
        stale, fresh = _slot_of(tmp_path, 1), _slot_of(tmp_path, 2)
        assert stale < fresh
        when = _header(slot_path(tmp_path, "t", 0, fresh))[8]
        _poke_header(slot_path(tmp_path, "t", 0, stale), step=2, written_at=when - 1.0)
        assert store.complete_steps() == [2, 2]
        assert torch.equal(store.read(2)["w"], torch.arange(4.0) + 1)
        assert np.array_equal(store.copy_out(2).data.view(np.float32)[:4], np.arange(4.0) + 1)
    finally:
        store.close()
