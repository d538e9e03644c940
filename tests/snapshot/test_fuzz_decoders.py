"""Fuzz targets, one per decoder of snapshot bytes from disk, shared memory or a peer (issue 17,
item 6): arbitrary bytes, and mutations of valid encodings -- bit flips, truncations, spliced
bytes, and overwrites of length and count fields (re-signed where a checksum would otherwise stop
the input at the door, so the mutation reaches the decoder behind it).

The property is the same for every target: the decoder returns a correct decode or raises
SnapshotCorruptError (SnapshotMissingError where "no snapshot" is the answer) -- never anything
else. ``benchmarks/bench_fuzz.py`` runs the same decoders over a million seeded inputs.

Each target runs 200 examples (the durable and slot ones, which touch files, 100); the file
takes about 20 s on two cores::

    .venv/bin/python -m pytest -q tests/snapshot/test_fuzz_decoders.py
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import struct
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from nonstop.errors import NonstopError, SnapshotCorruptError, SnapshotMissingError
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.api import HEADER_FMT, HEADER_SIZE, TensorEntry
from nonstop.snapshot.codec import (
    ChunkInfo,
    CodecConfig,
    Encoder,
    Segment,
    check_sizes,
    checksum,
    decode,
    decode_chunk,
    segments_for,
)
from nonstop.snapshot.durable import MANIFEST, DurableStore, step_dir
from nonstop.snapshot.durable.format import decode_manifest, encode_manifest
from nonstop.snapshot.flatten import flatten_state, unflatten_state
from nonstop.snapshot.sharded import decode_dtensor
from nonstop.snapshot.store import decode_raw, slot_path
from nonstop.snapshot.validate import parse_meta

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
FUZZ_FILES = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
MAX_OUT = 64 << 20  # a caller allocates what check_sizes let through; the fuzz caps it


# ---------------------------------------------------------------------------- mutations
NASTY_INTS = [0, 1, -1, 7, 63, 64, 4095, 4096, 2**31 - 1, 2**32, 2**53 + 1, 2**60, 2**63 - 1, 2**64, 10**30]
NASTY_VALUES: list[Any] = [
    *NASTY_INTS,
    None,
    True,
    False,
    0.5,
    -1.5,
    1e308,
    "",
    "x",
    "\ud800",
    [],
    {},
    [[[[[[[[]]]]]]]],
    {"__t__": 0},
    [0, 1, 2],
]


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


@st.composite
def byte_mutations(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` with bit flips, a truncation, spliced random bytes or an overwritten 8-byte word."""
    out = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "splice", "word", "extend"]))
        n = len(out)
        if kind == "flip" and n:
            pos = draw(st.integers(0, n - 1))
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del out[draw(st.integers(0, n)) :]
        elif kind == "splice":
            pos = draw(st.integers(0, n))
            end = draw(st.integers(pos, min(n, pos + 16)))
            out[pos:end] = draw(st.binary(max_size=16))
        elif kind == "word" and n >= 8:
            pos = draw(st.integers(0, n - 8))
            word = draw(st.sampled_from([x for x in NASTY_INTS if 0 <= x < 2**64]))
            out[pos : pos + 8] = struct.pack("<Q", word)
        elif kind == "extend":
            out += draw(st.binary(max_size=64))
    return bytes(out)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (the root included)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


@st.composite
def json_mutations(draw: st.DrawFn, valid: Any) -> Any:
    """A deep copy of the JSON document ``valid`` with 1-3 values replaced: by nasty values
    (huge or negative lengths, wrong types, deep nesting), by a neighbouring integer (an
    off-by-one length), or removed."""
    doc = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        old = doc
        for k in path:
            old = old[k]
        kind = draw(st.sampled_from(["nasty", "nudge", "drop"]))
        if kind == "drop" and path:
            parent = doc
            for k in path[:-1]:
                parent = parent[k]
            del parent[path[-1]]
        elif kind == "nudge" and isinstance(old, int) and not isinstance(old, bool):
            doc = _set(doc, path, old + draw(st.sampled_from([-64, -8, -1, 1, 8, 64, 2**40])))
        else:
            doc = _set(doc, path, copy.deepcopy(draw(st.sampled_from(NASTY_VALUES))))
    return doc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=20,
)


def only_corrupt(fn: Callable[[], Any], *also: type[BaseException]) -> Any:
    """``fn()``; None when it raised SnapshotCorruptError (or one of ``also``). Any other
    exception fails the test. Which it was is a hypothesis event (``--hypothesis-show-statistics``
    shows how many inputs got how far)."""
    try:
        result = fn()
    except (SnapshotCorruptError, *also) as e:
        event(type(e).__name__)
        return None
    event("decoded")
    return result


# ---------------------------------------------------------------------------- valid encodings
def _data(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(n // 4).astype(np.float32).tobytes()


RAW = _data(12_288, 1)
BASE = bytes(np.frombuffer(RAW, np.float32) + np.float32(1e-3))
ENTRIES = [TensorEntry(dtype="float32", shape=(len(RAW) // 4,), offset=0, nbytes=len(RAW))]
LOSSY_SEGS = [Segment(offset=0, length=len(RAW), typesize=4, lossy="linear", dtype="float32")]


def _encode(
    cfg: CodecConfig, base: bytes | None, segs: list[Segment] | None = None
) -> list[tuple[ChunkInfo, bytes]]:
    with Encoder(cfg) as enc:
        chunks = enc.encode(RAW, segs or segments_for(ENTRIES, len(RAW)), base)
    return [(info, bytes(p)) for info, p in chunks]


ENCODINGS: dict[str, tuple[list[tuple[ChunkInfo, bytes]], bytes | None]] = {
    "zstd+shuffle": (_encode(CodecConfig(chunk_bytes=4096), None), None),
    "lz4+bitshuffle": (_encode(CodecConfig(codec="lz4", shuffle="bit", chunk_bytes=4096), None), None),
    "raw": (_encode(CodecConfig(codec="none", chunk_bytes=4096), None), None),
    "sub-delta": (_encode(CodecConfig(chunk_bytes=4096), BASE), BASE),
    "xor-delta": (_encode(CodecConfig(delta="xor", chunk_bytes=4096), BASE), BASE),
    "lossy-q8": (_encode(CodecConfig(lossy=True, chunk_bytes=4096), None, LOSSY_SEGS), None),
    "lossy-q4-delta": (
        _encode(CodecConfig(lossy=True, lossy_bits=4, chunk_bytes=4096), BASE, LOSSY_SEGS),
        BASE,
    ),
}


def _decoded(chunks: list[tuple[ChunkInfo, bytes]], base: bytes | None) -> bytes:
    out = bytearray(sum(i.length for i, _ in chunks))
    decode(chunks, out, base)
    return bytes(out)


EXPECTED = {name: _decoded(chunks, base) for name, (chunks, base) in ENCODINGS.items()}


# ---------------------------------------------------------------------------- codec
@st.composite
def chunk_inputs(draw: st.DrawFn) -> tuple[str, int, dict[str, Any], bytes]:
    """(encoding, chunk index, the chunk's info JSON, its payload), either mutated."""
    name = draw(st.sampled_from(sorted(ENCODINGS)))
    chunks, _ = ENCODINGS[name]
    i = draw(st.integers(0, len(chunks) - 1))
    info, payload = chunks[i]
    doc = info.to_json()
    what = draw(st.sampled_from(["payload", "payload-resigned", "info", "both"]))
    if what in ("payload", "payload-resigned", "both"):
        payload = draw(byte_mutations(payload))
        if what != "payload":  # a payload whose crc_enc matches reaches the decompressor
            doc = {**doc, "crc_enc": checksum(payload), "enc_len": len(payload)}
    if what in ("info", "both"):
        doc = draw(json_mutations(doc))
    return name, i, doc, payload


@FUZZ
@given(case=chunk_inputs())
def test_fuzz_decode_chunk(case: tuple[str, int, dict[str, Any], bytes]) -> None:
    """As a reader decodes a chunk: its info parsed, its sizes checked, then decoded."""
    name, i, doc, payload = case
    chunks, base = ENCODINGS[name]
    info = only_corrupt(lambda: ChunkInfo.from_json(doc))
    if info is None or only_corrupt(lambda: check_sizes(info, payload) or True) is None:
        return
    if info.length > MAX_OUT:
        return
    out = bytearray(info.length)
    if only_corrupt(lambda: decode_chunk(info, payload, memoryview(out), base) or True) is None:
        return
    assert checksum(out) == info.crc_raw
    orig = chunks[i][0]
    if (info.offset, info.length, info.crc_raw) == (orig.offset, orig.length, orig.crc_raw):
        assert bytes(out) == EXPECTED[name][orig.offset : orig.offset + orig.length]


@FUZZ
@given(doc=json_values)
def test_fuzz_chunk_info_from_arbitrary_json(doc: Any) -> None:
    only_corrupt(lambda: ChunkInfo.from_json(doc))


@st.composite
def chunk_lists(draw: st.DrawFn) -> tuple[str, list[tuple[ChunkInfo, bytes]]]:
    """A whole encoding with chunks dropped, duplicated, swapped or mutated (as a peer or a
    file may deliver them)."""
    name = draw(st.sampled_from(sorted(ENCODINGS)))
    chunks = list(ENCODINGS[name][0])
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["drop", "dup", "swap-payloads", "mutate"]))
        j = draw(st.integers(0, len(chunks) - 1)) if chunks else 0
        if kind == "drop" and chunks:
            del chunks[j]
        elif kind == "dup" and chunks:
            chunks.insert(j, chunks[j])
        elif kind == "swap-payloads" and len(chunks) > 1:
            k = draw(st.integers(0, len(chunks) - 1))
            chunks[j], chunks[k] = (chunks[j][0], chunks[k][1]), (chunks[k][0], chunks[j][1])
        elif kind == "mutate" and chunks:
            doc = draw(json_mutations(chunks[j][0].to_json()))
            info = only_corrupt(lambda d=doc: ChunkInfo.from_json(d))
            if info is not None:
                chunks[j] = (info, draw(byte_mutations(chunks[j][1])))
    return name, chunks


@FUZZ
@given(case=chunk_lists())
def test_fuzz_decode(case: tuple[str, list[tuple[ChunkInfo, bytes]]]) -> None:
    name, chunks = case
    out = bytearray(len(EXPECTED[name]))
    if only_corrupt(lambda: decode(chunks, out, ENCODINGS[name][1]) or True) is not None:
        assert bytes(out) == EXPECTED[name]


# ---------------------------------------------------------------------------- durable manifests
def _rank_record_manifest() -> bytes:
    from nonstop.snapshot.durable.format import RankRecord

    chunks, pos, recs = ENCODINGS["zstd+shuffle"][0], 0, []
    for info, payload in chunks:
        recs.append((info, pos))
        pos += len(payload)
    meta = _canonical({"tree": {"__t__": 0}, "tensors": [e.to_json() for e in ENTRIES]})
    rank = RankRecord(
        rank=0,
        data_len=len(RAW),
        meta=meta,
        meta_crc=checksum(meta),
        base_step=None,
        file="rank-00000.bin",
        file_len=pos,
        chunks=tuple(recs),
    )
    return encode_manifest(7, 1, 1767225600.5, "zstd1+shuffle+sub", [rank])


MANIFEST_BYTES = _rank_record_manifest()


def _resigned(doc: Any) -> bytes:
    """``doc`` as manifest bytes with a valid manifest_crc (when it is an object)."""
    if isinstance(doc, dict):
        doc = {k: v for k, v in doc.items() if k != "manifest_crc"}
        try:
            return _canonical({**doc, "manifest_crc": zlib.crc32(_canonical(doc))}) + b"\n"
        except (ValueError, TypeError):
            pass
    return json.dumps(doc).encode("utf-8", "surrogatepass")


manifest_inputs = st.one_of(
    st.binary(max_size=512),
    byte_mutations(MANIFEST_BYTES),
    json_mutations(json.loads(MANIFEST_BYTES)).map(_resigned),
    st.just(b"[" * 100_000),
)


@FUZZ
@given(raw=manifest_inputs)
def test_fuzz_decode_manifest(raw: bytes) -> None:
    m = only_corrupt(lambda: decode_manifest(raw, "fuzz"))
    if m is not None:
        # re-encoded in the version it was read in (a reader accepts version 1 too: a mutation of
        # the version field, re-signed, is a valid version 1 manifest)
        assert encode_manifest(m.step, m.world_size, m.created_at, m.codec, m.ranks, m.version) == raw


_PRISTINE: dict[str, Path] = {}


def _pristine_checkpoints() -> Path:
    """A root with two checkpoints (steps 10 and 20) of one rank, built once."""
    if "root" not in _PRISTINE:
        root = Path(tempfile.mkdtemp(prefix="nonstop-fuzz-"))
        store = DurableStore(root, keep=5)
        for step in (10, 20):
            cfg = CodecConfig(chunk_bytes=4096)
            writer = store.begin(step, 1, cfg.describe())
            meta = _canonical(
                {"tree": {"w": {"__t__": 0}, "step": step}, "tensors": [e.to_json() for e in ENTRIES]}
            )
            with Encoder(cfg) as enc:
                writer.add_rank(
                    0,
                    meta,
                    len(RAW),
                    enc.encode(_data(len(RAW), step), segments_for(ENTRIES, len(RAW))),
                    None,
                )
            writer.commit()
        _PRISTINE["root"] = root
    return _PRISTINE["root"]


@pytest.fixture(scope="module", autouse=True)
def _cleanup_pristine() -> Any:
    yield
    if "root" in _PRISTINE:
        shutil.rmtree(_PRISTINE.pop("root"), ignore_errors=True)


@FUZZ_FILES
@given(data=st.data())
def test_fuzz_durable_load_falls_back(data: st.DataObject) -> None:
    """Checkpoint 20's manifest or chunk file mutated: load() returns step 20 or step 10, each
    intact, and never raises anything but the project's errors."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(_pristine_checkpoints(), root)
        target = data.draw(st.sampled_from(["manifest", "manifest-resigned", "bin"]))
        if target == "bin":
            path = root / step_dir(20) / "rank-00000.bin"
            path.write_bytes(data.draw(byte_mutations(path.read_bytes())))
        else:
            path = root / step_dir(20) / MANIFEST
            good = path.read_bytes()
            if target == "manifest":
                path.write_bytes(data.draw(byte_mutations(good)))
            else:
                path.write_bytes(_resigned(data.draw(json_mutations(json.loads(good)))))
        ck = only_corrupt(lambda: DurableStore(root).load(), SnapshotMissingError)
        assert ck is not None, "checkpoint 10 is intact: load() must fall back to it"
        assert ck.step in (10, 20) and bytes(ck.data(0)) == _data(len(RAW), ck.step)


def test_stored_strings_are_quoted_escaped_in_what_load_says(caplog: pytest.LogCaptureFixture) -> None:
    """A manifest string replaced by a lone surrogate (JSON's ``"\\ud800"``, which json.loads
    gives back as is) never reaches a message unescaped: such a message cannot be written to a
    UTF-8 log, and once broke the test runner's report (an xdist INTERNALERROR)."""
    good = json.loads((_pristine_checkpoints() / step_dir(20) / MANIFEST).read_bytes())
    said = []
    for path in _paths(good):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "ckpt"
            shutil.copytree(_pristine_checkpoints(), root)
            doc = _set(copy.deepcopy(good), path, "\ud800")
            (root / step_dir(20) / MANIFEST).write_bytes(_resigned(doc))
            caplog.clear()
            try:
                ck = DurableStore(root).load()
                said.append(f"step {ck.step if ck else None}")
            except NonstopError as e:
                said.append(str(e))
            said += [r.getMessage() for r in caplog.records]
    assert any("ud800" in m for m in said), "no mutation was quoted: the test reaches nothing"
    for m in said:
        m.encode("utf-8")  # raises on a lone surrogate


# ---------------------------------------------------------------------------- raw snapshots
STATE = {
    "model": {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)},
    "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [(1, "a")]},
    "np": np.arange(4, dtype=np.int64),
}


def _raw_snapshot() -> tuple[Any, bytes]:
    tree, tensors = flatten_state(STATE)
    entries, off, parts = [], 0, []
    for t in tensors:
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        pad = (-off) % 64
        parts.append(b"\0" * pad + b)
        off += pad
        entries.append(
            TensorEntry(
                dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), offset=off, nbytes=len(b)
            )
        )
        off += len(b)
    return {"tree": tree, "tensors": [e.to_json() for e in entries]}, b"".join(parts)


META_DOC, META_DATA = _raw_snapshot()

raw_inputs = st.one_of(
    st.tuples(st.binary(max_size=256), st.binary(max_size=256)),
    st.tuples(byte_mutations(_canonical(META_DOC)), st.just(META_DATA)),
    st.tuples(
        json_mutations(META_DOC).map(lambda d: json.dumps(d).encode("utf-8", "surrogatepass")),
        st.just(META_DATA),
    ),
    st.tuples(st.just(_canonical(META_DOC)), byte_mutations(META_DATA)),
)


@FUZZ
@given(case=raw_inputs)
def test_fuzz_decode_raw(case: tuple[bytes, bytes]) -> None:
    meta, data = case
    state = only_corrupt(lambda: decode_raw(meta, bytearray(data)))
    if state is not None and meta == _canonical(META_DOC) and data == META_DATA:
        assert torch.equal(state["model"]["w"], STATE["model"]["w"])


@FUZZ
@given(
    meta=st.one_of(
        st.binary(max_size=128), json_values.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass"))
    ),
    n=st.integers(0, 64),
)
def test_fuzz_parse_meta_and_unflatten(meta: bytes, n: int) -> None:
    parsed = only_corrupt(lambda: parse_meta(meta, n, "fuzz", "skipped"))
    if parsed is not None:
        tree, entries = parsed
        for e in entries:
            assert e.offset + e.nbytes <= n
        only_corrupt(lambda: unflatten_state(tree, [torch.zeros(1)] * len(entries)))


DT_NODE = {
    "__dt__": 0,
    "shape": [4, 2],
    "stride": [2, 1],
    "offset": [2, 0],
    "placements": ["Shard(dim=0)"],
    "mesh": [2],
    "dims": ["shard"],
}


@FUZZ
@given(
    node=st.one_of(json_mutations(DT_NODE), st.dictionaries(st.sampled_from(sorted(DT_NODE)), json_values))
)
def test_fuzz_decode_dtensor(node: Any) -> None:
    shard = only_corrupt(lambda: decode_dtensor(node, [torch.zeros(2, 2)]))
    if shard is not None:
        assert len(shard.global_shape) == len(shard.global_stride)
        assert len(shard.placements) == len(shard.mesh_shape)


# ---------------------------------------------------------------------------- shared-memory slots
@FUZZ_FILES
@given(data=st.data())
def test_fuzz_slot_header_and_meta(data: st.DataObject) -> None:
    """A slot's header (or its meta) scribbled over: the rank's store -- the writer's and a
    replacement's -- reads what is intact, reports the rest as missing or corrupt, and writes on."""
    with tempfile.TemporaryDirectory() as tmp:
        shm = Path(tmp)
        writer = RankSnapshotStore(shm_dir=shm, job_id="f", rank=0, num_slots=2)
        try:
            writer.write(1, {"w": torch.arange(4.0)})
            writer.write(2, {"w": torch.arange(4.0) + 1})
            victim = slot_path(shm, "f", 0, data.draw(st.integers(0, 1)))
            raw = bytearray(victim.read_bytes())
            where = data.draw(st.sampled_from(["header", "header-fields", "meta"]))
            if where == "header":
                raw[:HEADER_SIZE] = data.draw(byte_mutations(bytes(raw[:HEADER_SIZE]))).ljust(
                    HEADER_SIZE, b"\0"
                )[:HEADER_SIZE]
            elif where == "header-fields":
                fields = list(struct.unpack_from(HEADER_FMT, raw))
                for _ in range(data.draw(st.integers(1, 3))):
                    k = data.draw(st.integers(1, len(fields) - 1))
                    fields[k] = data.draw(st.sampled_from(_field_values(HEADER_FMT, k)))
                struct.pack_into(HEADER_FMT, raw, 0, *fields)
            else:
                meta_at = HEADER_SIZE + struct.unpack_from(HEADER_FMT, raw)[6]
                end = min(len(raw), meta_at + 256)
                raw[meta_at:end] = data.draw(byte_mutations(bytes(raw[meta_at:end]))).ljust(
                    end - meta_at, b"\0"
                )[: end - meta_at]
            victim.write_bytes(bytes(raw))
            for store in (writer, RankSnapshotStore(shm_dir=shm, job_id="f", rank=0, num_slots=2)):
                try:
                    steps = store.complete_steps()
                    for step in steps:
                        state = only_corrupt(lambda s=store, t=step: s.read(t), SnapshotMissingError)
                        if state is not None and step in (1, 2):
                            assert isinstance(state, dict)
                        only_corrupt(lambda s=store, t=step: s.copy_out(t).entries(), SnapshotMissingError)
                    step = 100 + (store is writer)
                    store.write(step, {"w": torch.arange(4.0) * step})
                    assert torch.equal(store.read(step)["w"], torch.arange(4.0) * step)
                finally:
                    if store is not writer:
                        store.close()
        finally:
            writer.close()


def _field_values(fmt: str, k: int) -> list[Any]:
    code = struct.Struct(fmt).format.lstrip("<")
    codes = [c for c in code if not c.isdigit()]
    c = codes[k]
    if c == "d":
        return [0.0, -1.0, 1e300, float("inf"), float("nan")]
    bits = {"I": 32, "i": 32, "q": 64, "Q": 64}[c]
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if c in "iq" else (0, 2**bits - 1)
    return sorted({max(lo, min(hi, v)) for v in (0, 1, 2, 3, 7, 64, 4096, 2**31, 2**40, hi, lo, -1)})


# ---------------------------------------------------------------------------- sanity of the harness
def test_mutations_reach_the_decoders() -> None:
    """The harness is not vacuous: the valid encodings decode, and a re-signed payload mutation
    gets past the checksum to the decompressor (which rejects it)."""
    assert dataclasses.asdict(decode_manifest(MANIFEST_BYTES, "x"))["step"] == 7
    info, payload = ENCODINGS["zstd+shuffle"][0][0]
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0xFF
    doc = {**info.to_json(), "crc_enc": checksum(bytes(bad))}
    with pytest.raises(SnapshotCorruptError, match=r"decompression|decoded crc32c|frame"):
        decode_chunk(ChunkInfo.from_json(doc), bytes(bad), memoryview(bytearray(info.length)), None)
    state = decode_raw(_canonical(META_DOC), bytearray(META_DATA))
    assert torch.equal(state["model"]["w"], STATE["model"]["w"])


def test_a_corrupt_trim_word_never_reaches_past_the_mapping(tmp_path: Path) -> None:
    """Found by test_fuzz_slot_header_and_meta: a slot file whose trim word was scribbled past the
    data area made the next trim ask madvise for more than the mapping (OverflowError in the
    writer). The word reads as the whole data area: the trim gives back only what the slot has."""
    import struct

    from nonstop.snapshot.slot import TRIM_MIN, TRIM_OFFSET, Slot

    slot = Slot(tmp_path / "nonstop-fz-r0-s0")
    try:
        slot.ensure_capacity(4 * TRIM_MIN, 100)
        assert slot._mm is not None
        struct.pack_into("<Q", slot._mm, TRIM_OFFSET, 1 << 62)
        freed = slot.trim(16)
        assert 0 < freed <= slot.data_cap
    finally:
        slot.close()
