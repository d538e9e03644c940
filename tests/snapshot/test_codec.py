"""nonstop.snapshot.codec: lossless round trips, segment layout, corruption detection, the config.
Lossy bounds: ``test_codec_lossy.py``."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nonstop.errors import SnapshotCorruptError, UsageError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.codec import (
    LOSSY_MIN_ELEMS,
    ChunkInfo,
    CodecConfig,
    Encoder,
    Segment,
    checksum,
    decode,
    decode_chunk,
    element_size,
    segments_for,
)
from nonstop.snapshot.flatten import flatten_state
from tests.codec_fakes import align, layout, roundtrip

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- lossless property


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[Segment], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Random segments (typesizes 1/2/4/8) over float-like data, plus a nearby base."""
    segs, off = [], 0
    for _ in range(draw(st.integers(0, 5))):
        ts = draw(st.sampled_from([1, 2, 4, 8]))
        n = ts * draw(st.integers(0, 200))
        segs.append(Segment(offset=off, length=n, typesize=ts))
        off += n
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    style = draw(st.sampled_from(["floats", "random", "zeros"]))
    if style == "floats":
        vals = rng.standard_normal(off // 4 + 1).astype(np.float32)
        raw = vals.view(np.uint8)[:off].copy()
        base_vals = vals + rng.standard_normal(len(vals)).astype(np.float32) * np.float32(1e-3)
        base = base_vals.view(np.uint8)[:off].copy()
    elif style == "random":
        raw = rng.integers(0, 256, off, dtype=np.uint8)
        base = rng.integers(0, 256, off, dtype=np.uint8)
    else:
        raw = np.zeros(off, np.uint8)
        base = np.zeros(off, np.uint8)
        base[::7] = 1
    return segs, raw, base


configs = st.builds(
    CodecConfig,
    codec=st.sampled_from(["zstd", "lz4", "none"]),
    level=st.integers(1, 3),
    shuffle=st.sampled_from(["byte", "bit", "none"]),
    chunk_bytes=st.integers(8, 80).map(lambda k: 8 * k),
    threads=st.sampled_from([1, 2]),
    delta=st.sampled_from(["xor", "sub"]),
)


@FAST
@given(
    layout=layouts(),
    cfg=configs,
    use_base=st.booleans(),
    kind=st.sampled_from(["bytes", "bytearray", "memoryview", "ndarray"]),
    dec_threads=st.sampled_from([1, 3]),
)
def test_lossless_roundtrip_is_byte_exact(
    layout: tuple[list[Segment], np.ndarray[Any, Any], np.ndarray[Any, Any]],
    cfg: CodecConfig,
    use_base: bool,
    kind: str,
    dec_threads: int,
) -> None:
    segs, raw_arr, base_arr = layout
    raw: Any = {
        "bytes": raw_arr.tobytes(),
        "bytearray": bytearray(raw_arr.tobytes()),
        "memoryview": memoryview(bytearray(raw_arr.tobytes())),
        "ndarray": raw_arr,
    }[kind]
    base = base_arr.tobytes() if use_base else None
    chunks, out = roundtrip(cfg, raw, segs, base, threads=dec_threads)
    assert out.tobytes() == raw_arr.tobytes()
    # Chunks tile the buffer, never straddle a segment, respect chunk_bytes and typesize.
    pos = 0
    for info, payload in chunks:
        assert info.offset == pos and 0 < info.length <= cfg.chunk_bytes
        seg = next(s for s in segs if s.offset <= info.offset < s.offset + s.length)
        assert info.offset + info.length <= seg.offset + seg.length
        assert info.typesize == seg.typesize and info.length % info.typesize == 0
        assert info.delta is use_base
        assert info.enc_len == len(payload) and info.crc_enc == checksum(payload)
        assert info.crc_raw == checksum(raw_arr[info.offset : info.offset + info.length].tobytes())
        assert ChunkInfo.from_json(json.loads(json.dumps(info.to_json()))) == info
        pos += info.length
    assert pos == len(raw_arr)


def test_segments_longer_than_a_chunk_split_unevenly() -> None:
    raw = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    segs = [Segment(offset=0, length=1000, typesize=4), Segment(offset=1000, length=3000, typesize=4)]
    chunks, out = roundtrip(CodecConfig(chunk_bytes=448), raw, segs)
    assert [i.length for i, _ in chunks] == [448, 448, 104] + [448] * 6 + [312]
    assert out.tobytes() == raw.tobytes()


def test_compresses_structured_data_and_stores_noise_raw() -> None:
    rng = np.random.default_rng(2)
    smooth = np.repeat(rng.standard_normal(1 << 12).astype(np.float32), 16)
    noise = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    raw = np.concatenate([smooth.view(np.uint8), noise])
    segs = [
        Segment(offset=0, length=smooth.nbytes, typesize=4),
        Segment(offset=smooth.nbytes, length=1 << 16, typesize=1),
    ]
    chunks, out = roundtrip(CodecConfig(chunk_bytes=1 << 20), raw, segs)
    assert out.tobytes() == raw.tobytes()
    (c_smooth, p_smooth), (c_noise, p_noise) = chunks
    assert c_smooth.codec == "zstd1+shuffle" and len(p_smooth) < smooth.nbytes / 4
    assert c_noise.codec == "raw" and bytes(p_noise) == noise.tobytes()


@pytest.mark.parametrize("delta", ["xor", "sub"])
def test_delta_of_nearby_state_is_smaller_than_full(delta: str) -> None:
    rng = np.random.default_rng(3)
    prev = rng.standard_normal(1 << 16).astype(np.float32)
    cur = prev * np.float32(1 + 1e-4) + rng.standard_normal(prev.size).astype(np.float32) * np.float32(1e-6)
    segs = [Segment(offset=0, length=cur.nbytes, typesize=4)]
    cfg = CodecConfig(delta=delta)
    full, _ = roundtrip(cfg, cur, segs)
    chunks, out = roundtrip(cfg, cur, segs, base=prev)
    assert out.tobytes() == cur.tobytes()
    assert chunks[0][0].codec == f"{delta}+zstd1+shuffle"
    assert sum(i.enc_len for i, _ in chunks) < 0.8 * sum(i.enc_len for i, _ in full)


def test_parallel_encode_is_deterministic() -> None:
    raw = np.random.default_rng(4).standard_normal(50_000).astype(np.float32)
    segs = [Segment(offset=0, length=raw.nbytes, typesize=4)]
    one, _ = roundtrip(CodecConfig(chunk_bytes=4096), raw, segs)
    two, _ = roundtrip(CodecConfig(chunk_bytes=4096, threads=3), raw, segs)
    assert one == two


def test_encode_rejects_bad_inputs() -> None:
    raw = np.zeros(64, np.uint8)
    with Encoder(CodecConfig()) as enc:
        with pytest.raises(UsageError, match="cover"):
            enc.encode(raw, [Segment(offset=0, length=32, typesize=1)])
        with pytest.raises(UsageError, match="tile"):
            enc.encode(
                raw, [Segment(offset=0, length=64, typesize=1), Segment(offset=32, length=32, typesize=1)]
            )
        with pytest.raises(UsageError, match="same layout"):
            enc.encode(raw, [Segment(offset=0, length=64, typesize=1)], base=np.zeros(65, np.uint8))
        with pytest.raises(UsageError, match="C-contiguous"):
            enc.encode(np.zeros(128, np.uint8)[::2], [Segment(offset=0, length=64, typesize=1)])
    with pytest.raises(UsageError):
        Segment(offset=0, length=6, typesize=4)
    with pytest.raises(UsageError):
        Segment(offset=0, length=8, typesize=3)
    with pytest.raises(UsageError):
        Segment(offset=0, length=8, typesize=4, lossy="log")


# --------------------------------------------------------------------------- segments_for

DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64", "int32", "complex64", "foo8"]


@st.composite
def entry_lists(draw: st.DrawFn) -> tuple[list[TensorEntry], int, dict[int, str]]:
    entries, off = [], draw(st.sampled_from([0, 0, 0, 64]))
    for _ in range(draw(st.integers(0, 8))):
        dtype = draw(st.sampled_from(DTYPES))
        width = {"complex64": 8, "foo8": 3}.get(dtype, element_size(dtype))
        numel = draw(st.sampled_from([0, 1, 3, 100, LOSSY_MIN_ELEMS - 1, LOSSY_MIN_ELEMS, 3000]))
        entries.append(TensorEntry(dtype=dtype, shape=(numel,), offset=off, nbytes=numel * width))
        off = align(off + numel * width) + draw(st.sampled_from([0, 0, 64]))
    end = max((e.offset + e.nbytes for e in entries), default=0)
    data_len = end + draw(st.sampled_from([0, 0, 5, 64]))
    lossy = {i: draw(st.sampled_from(["linear", "sqrt"])) for i in range(len(entries)) if draw(st.booleans())}
    return entries, data_len, lossy


@FAST
@given(case=entry_lists())
def test_segments_cover_data_exactly_and_group_maximally(
    case: tuple[list[TensorEntry], int, dict[int, str]],
) -> None:
    entries, data_len, lossy = case
    segs = segments_for(entries, data_len, lossy)
    pos = 0
    for s in segs:
        assert s.offset == pos and s.length > 0 and s.length % s.typesize == 0
        pos += s.length
    assert pos == data_len
    for a, b in itertools.pairwise(segs):  # maximal: neighbours differ in their key
        assert (a.typesize, a.lossy, a.dtype) != (b.typesize, b.lossy, b.dtype)
    for i, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        (seg,) = [s for s in segs if s.offset <= e.offset < s.offset + s.length]
        assert e.offset + e.nbytes <= seg.offset + seg.length, "a tensor never straddles segments"
        want_lossy = lossy.get(i) if e.dtype in ("float32", "bfloat16", "float16") else None
        if e.nbytes // element_size(e.dtype) < LOSSY_MIN_ELEMS:
            want_lossy = None
        assert seg.lossy == want_lossy
        if want_lossy is not None:
            assert seg.dtype == e.dtype and seg.typesize == element_size(e.dtype)
        elif e.dtype != "foo8":
            assert seg.typesize == element_size(e.dtype)
    # Lossy segments hold only their tensors (and padding between them): no foreign tensor bytes.
    for s in segs:
        if s.lossy is not None:
            inside = [
                i for i, e in enumerate(entries) if e.nbytes and s.offset <= e.offset < s.offset + s.length
            ]
            assert all(lossy.get(i) == s.lossy and entries[i].dtype == s.dtype for i in inside)


def test_segments_of_a_real_training_state() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    _, tensors = flatten_state({"model": model.state_dict(), "optimizer": opt.state_dict()})
    tensors.append(torch.zeros(5, dtype=torch.int64))
    tensors.append(torch.zeros(3, dtype=torch.uint8))
    entries, buf = layout(tensors)
    segs = segments_for(entries, len(buf))
    # float32 tensors (params, moments, step counters) share one segment; then int64; then uint8.
    assert [(s.typesize, s.dtype) for s in segs] == [(4, "uint32"), (8, "uint64"), (1, "uint8")]
    assert segs[-1].offset + segs[-1].length == len(buf)
    _, out = roundtrip(CodecConfig(chunk_bytes=1024), buf, segs)
    assert out.tobytes() == buf.tobytes()


def test_segments_for_rejects_bad_input() -> None:
    a = TensorEntry(dtype="float32", shape=(4,), offset=0, nbytes=16)
    b = TensorEntry(dtype="float32", shape=(4,), offset=8, nbytes=16)
    with pytest.raises(UsageError, match="overlaps"):
        segments_for([a, b], 64)
    with pytest.raises(UsageError, match="outside"):
        segments_for([a], 8)
    with pytest.raises(UsageError, match="tensor 5"):
        segments_for([a], 16, {5: "linear"})
    with pytest.raises(UsageError, match="kind"):
        segments_for([a], 16, {0: "cubic"})


# --------------------------------------------------------------------------- corruption


def _one_chunk(base: bool = False, delta: str = "xor") -> tuple[ChunkInfo, bytes, np.ndarray[Any, Any], Any]:
    rng = np.random.default_rng(5)
    raw = np.repeat(rng.standard_normal(512).astype(np.float32), 4)
    b = (raw + np.float32(1e-3)).tobytes() if base else None
    with Encoder(CodecConfig(delta=delta)) as enc:
        ((info, payload),) = enc.encode(raw, [Segment(offset=0, length=raw.nbytes, typesize=4)], b)
    assert info.codec.endswith("zstd1+shuffle")
    return info, payload, raw, b


@pytest.mark.parametrize("where", [0, 17, -1])
def test_flipped_payload_byte_is_detected(where: int) -> None:
    info, payload, raw, _ = _one_chunk()
    bad = bytearray(payload)
    bad[where] ^= 0x01
    out = np.empty(info.length, np.uint8)
    with pytest.raises(SnapshotCorruptError, match=r"offset 0.*crc32"):
        decode_chunk(info, bytes(bad), out, None)
    decode_chunk(info, payload, out, None)  # the intact payload still decodes
    assert out.tobytes() == raw.tobytes()


def test_truncated_payload_is_detected() -> None:
    info, payload, _, _ = _one_chunk()
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        decode_chunk(info, payload[:-1], np.empty(info.length, np.uint8), None)


@pytest.mark.parametrize("delta", ["xor", "sub"])
def test_wrong_base_fails_the_raw_checksum(delta: str) -> None:
    info, payload, raw, base = _one_chunk(base=True, delta=delta)
    assert info.delta
    wrong = bytearray(base)
    wrong[100] ^= 0x40
    out = np.empty(info.length, np.uint8)
    with pytest.raises(SnapshotCorruptError, match=r"decoded crc32.*wrong base"):
        decode_chunk(info, payload, out, bytes(wrong))
    decode_chunk(info, payload, out, base)
    assert out.tobytes() == raw.tobytes()


def test_delta_chunk_needs_a_base() -> None:
    info, payload, _, base = _one_chunk(base=True)
    out = np.empty(info.length, np.uint8)
    with pytest.raises(SnapshotCorruptError, match="no base"):
        decode_chunk(info, payload, out, None)
    with pytest.raises(SnapshotCorruptError, match="base is only"):
        decode_chunk(info, payload, out, base[:-8])


def test_lying_checksums_are_still_caught() -> None:
    """A payload whose crc_enc was recomputed (a bug upstream, not bit rot) must still not
    decode to wrong bytes: the frame's own size and crc_raw catch it."""
    info, payload, _, _ = _one_chunk()
    big = np.zeros(4 * info.length, np.uint8).tobytes()
    with Encoder(CodecConfig()) as enc:
        ((_, frame),) = enc.encode(big, [Segment(offset=0, length=len(big), typesize=4)])
    forged = dataclasses.replace(info, enc_len=len(frame), crc_enc=checksum(frame))
    with pytest.raises(SnapshotCorruptError, match="frame says"):
        decode_chunk(forged, frame, np.empty(info.length, np.uint8), None)
    bad = bytearray(payload)
    bad[-1] ^= 0xFF
    forged = dataclasses.replace(info, crc_enc=checksum(bad))
    with pytest.raises(SnapshotCorruptError):
        decode_chunk(forged, bytes(bad), np.empty(info.length, np.uint8), None)


def test_decode_requires_chunks_to_tile_the_output() -> None:
    raw = np.arange(1000, dtype=np.float32)
    with Encoder(CodecConfig(chunk_bytes=1024)) as enc:
        chunks = enc.encode(raw, [Segment(offset=0, length=raw.nbytes, typesize=4)])
    out = np.empty(raw.nbytes, np.uint8)
    with pytest.raises(SnapshotCorruptError, match="gap at offset 1024"):
        decode(chunks[:1] + chunks[2:], out, None)
    with pytest.raises(SnapshotCorruptError, match="overlap"):
        decode([*chunks, chunks[1]], out, None)
    with pytest.raises(SnapshotCorruptError, match="cover"):
        decode(chunks[:-1], out, None)
    decode(list(reversed(chunks)), out, None, threads=2)
    assert out.tobytes() == raw.tobytes()
    with pytest.raises(UsageError, match="writable"):
        decode(chunks, raw.tobytes(), None)


def test_decode_reports_a_bad_chunk_among_good_ones_in_parallel() -> None:
    raw = np.arange(4000, dtype=np.float32)
    with Encoder(CodecConfig(chunk_bytes=1024)) as enc:
        chunks = enc.encode(raw, [Segment(offset=0, length=raw.nbytes, typesize=4)])
    info, payload = chunks[5]
    chunks[5] = (info, payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(SnapshotCorruptError, match=f"offset {info.offset}"):
        decode(chunks, np.empty(raw.nbytes, np.uint8), None, threads=4)


def test_chunkinfo_json_validation() -> None:
    info, _, _, _ = _one_chunk()
    good = info.to_json()
    assert ChunkInfo.from_json(good) == info
    bad_cases: list[Any] = [
        [1, 2],
        {k: v for k, v in good.items() if k != "crc_raw"},
        {**good, "extra": 1},
        {**good, "offset": -1},
        {**good, "length": "12"},
        {**good, "enc_len": True},
        {**good, "crc_enc": 2**32},
        {**good, "typesize": 3},
        {**good, "length": good["length"] + 1},
        {**good, "delta": 1},
        {**good, "codec": 7},
        {**good, "codec": "gzip9"},
        {**good, "codec": "zstd1+shuffle+shuffle"},
        {**good, "codec": "xor+zstd1+shuffle"},  # delta token with delta False
        {**good, "codec": "q8-float64+zstd1"},
        {**good, "codec": "q8-bfloat16+zstd1"},  # typesize 4 is not bfloat16's
    ]
    for d in bad_cases:
        with pytest.raises(SnapshotCorruptError):
            ChunkInfo.from_json(d)


def test_checksum_is_crc32c() -> None:
    data = np.arange(100, dtype=np.float64)
    assert checksum(data) == crc32c.crc32c(data.tobytes()) == checksum(memoryview(data.tobytes()))
    assert checksum(b"") == 0


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codec": "gzip"},
        {"level": 0},
        {"level": 10},
        {"level": 1.5},
        {"shuffle": "nibble"},
        {"chunk_bytes": 32},
        {"chunk_bytes": 1001},
        {"chunk_bytes": 2**31},
        {"threads": 0},
        {"threads": True},
        {"full_every": 0},
        {"lossy": 1},
        {"lossy_bits": 2},
        {"delta": "add"},
    ],
)
def test_codec_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError) as exc:
        CodecConfig(**kwargs)
    assert "\n" not in str(exc.value)
    assert next(iter(kwargs)) in str(exc.value)


def test_codec_config_describe() -> None:
    assert CodecConfig().describe() == "zstd1+shuffle+sub"
    assert CodecConfig(codec="lz4", shuffle="bit", delta="xor").describe() == "lz4-1+bitshuffle+xor"
    assert CodecConfig(codec="none").describe() == "raw+sub"
    assert CodecConfig(delta="sub", lossy=True, lossy_bits=4).describe() == "zstd1+shuffle+sub+lossy4"
    with pytest.raises(dataclasses.FrozenInstanceError):
        CodecConfig().level = 2  # type: ignore[misc]
