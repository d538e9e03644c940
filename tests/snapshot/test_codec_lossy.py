"""nonstop.snapshot.codec, lossy: the quantisation error stays within the documented bound (and the
bound is tight), checksums cover lossy chunks, values it cannot quantise fall back to lossless."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from nonstop.errors import SnapshotCorruptError
from nonstop.snapshot.codec import (
    LOSSY_BLOCK,
    ChunkInfo,
    CodecConfig,
    Encoder,
    Segment,
    checksum,
    decode_chunk,
    segments_for,
)
from tests.codec_fakes import layout, roundtrip

EPS = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
TINY = {"float32": 2.0**-149, "bfloat16": 2.0**-133, "float16": 2.0**-24}  # smallest subnormals


def _as_f64(raw: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    t = torch.from_numpy(raw.copy()).view(getattr(torch, dtype))
    return t.double().numpy()


def _check_bound(
    chunks: list[tuple[ChunkInfo, bytes]],
    segs: list[Segment],
    raw: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    base: np.ndarray[Any, Any] | None,
    bits: int,
) -> tuple[int, float]:
    """Check decode_chunk's documented bound element by element; lossless chunks must be exact.

    Returns (number of lossy chunks, largest error as a fraction of its block's step Δ).
    """
    lossy_chunks, worst = 0, 0.0
    for info, _ in chunks:
        sl = slice(info.offset, info.offset + info.length)
        assert checksum(out[sl].tobytes()) == info.crc_raw
        if not info.codec.startswith("q"):
            assert out[sl].tobytes() == raw[sl].tobytes(), info
            continue
        lossy_chunks += 1
        seg = next(s for s in segs if s.offset <= info.offset < s.offset + s.length)
        x, y = _as_f64(raw[sl], seg.dtype), _as_f64(out[sl], seg.dtype)
        b = _as_f64(base[sl], seg.dtype) if base is not None else np.zeros_like(x)
        sqrt = seg.lossy == "sqrt"
        qmax = 2 ** (bits - 1) - 1 if (base is not None or not sqrt) else 2**bits - 1
        v = np.sqrt(x) - np.sqrt(b) if sqrt else x - b
        pad = (-len(v)) % LOSSY_BLOCK
        step = np.abs(np.concatenate([v, np.zeros(pad)])).reshape(-1, LOSSY_BLOCK).max(axis=1) / qmax
        step = np.repeat(step, LOSSY_BLOCK)[: len(v)]
        eps, tiny = EPS[seg.dtype], TINY[seg.dtype]
        if sqrt:
            err = np.abs(np.sqrt(y) - np.sqrt(x))
            slack = 4 * eps * (np.sqrt(x) + np.sqrt(b)) + np.sqrt(tiny)
        else:
            err, slack = np.abs(y - x), 4 * eps * (np.abs(x) + np.abs(b)) + tiny
        bound = 0.501 * step + slack
        assert (err <= bound).all(), (info, float((err - bound).max()))
        with np.errstate(divide="ignore", invalid="ignore"):
            worst = max(worst, float(np.nanmax(np.where(step > 0, err / step, 0))))
    return lossy_chunks, worst


def _adam_like(dtype: str, seed: int, n: int = 3000) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(previous, current) [param, exp_avg, exp_avg_sq, step] with consecutive-step-like changes."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    p = torch.randn(n, generator=g) * 0.05
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) ** 4 * 1e-6
    grad = torch.randn(n, generator=g) * 1e-3
    p2, m2, v2 = p - 1e-3 * torch.sign(m), 0.9 * m + 0.1 * grad, 0.999 * v + 0.001 * grad**2
    step = torch.tensor(7.0)
    prev = [p.to(dt), m.to(dt), v.to(dt), step]
    cur = [p2.to(dt), m2.to(dt), v2.to(dt), step + 1]
    return prev, cur


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("with_base", [False, True])
def test_lossy_error_stays_within_the_documented_bound(dtype: str, bits: int, with_base: bool) -> None:
    prev, cur = _adam_like(dtype, seed=bits)
    entries, raw = layout(cur)
    _, base = layout(prev)
    segs = segments_for(entries, len(raw), {0: "linear", 1: "linear", 2: "sqrt", 3: "linear"})
    # Padding after a lossy run stays lossless; the step counter (too small) stays exact.
    assert [(s.lossy, s.dtype) for s in segs] == [
        ("linear", dtype),
        (None, "uint8"),
        ("sqrt", dtype),
        (None, "uint32"),
    ]
    cfg = CodecConfig(lossy=True, lossy_bits=bits, chunk_bytes=4096)
    b = base if with_base else None
    chunks, out = roundtrip(cfg, raw, segs, b)
    n_lossy, _ = _check_bound(chunks, segs, raw, out, b, bits)
    assert n_lossy >= 3
    kinds = {i.codec.split("+")[0] for i, _ in chunks}
    assert f"q{bits}-{dtype}" in kinds and f"q{bits}sqrt-{dtype}" in kinds
    assert all(i.delta is with_base for i, _ in chunks)
    lossless, _ = roundtrip(dataclasses.replace(cfg, lossy=False), raw, segs, b)
    size, lossless_size = sum(i.enc_len for i, _ in chunks), sum(i.enc_len for i, _ in lossless)
    assert size < (0.5 if dtype == "float32" else 0.9) * lossless_size
    if not with_base:
        assert out.tobytes() != raw.tobytes()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["linear", "sqrt"])
def test_lossy_bound_is_tight(bits: int, kind: str) -> None:
    """On uniform values the error reaches close to half a step: the bound is not vacuous."""
    x = (
        np.random.default_rng(bits)
        .uniform(0 if kind == "sqrt" else -1, 1, 8 * LOSSY_BLOCK)
        .astype(np.float32)
    )
    segs = [Segment(offset=0, length=x.nbytes, typesize=4, lossy=kind, dtype="float32")]
    chunks, out = roundtrip(CodecConfig(lossy=True, lossy_bits=bits), x, segs)
    n_lossy, worst = _check_bound(chunks, segs, x.view(np.uint8), out, None, bits)
    assert n_lossy == 1 and 0.45 < worst <= 0.501


def test_lossy_ignored_unless_enabled() -> None:
    _, cur = _adam_like("float32", seed=1)
    entries, raw = layout(cur)
    segs = segments_for(entries, len(raw), {0: "linear", 1: "linear", 2: "sqrt"})
    chunks, out = roundtrip(CodecConfig(lossy=False), raw, segs)
    assert out.tobytes() == raw.tobytes()
    assert not any(i.codec.startswith("q") for i, _ in chunks)


def test_lossy_chunk_is_verified_by_its_checksum() -> None:
    prev, cur = _adam_like("float32", seed=2)
    entries, raw = layout(cur)
    _, base = layout(prev)
    segs = segments_for(entries, len(raw), {0: "linear"})
    with Encoder(CodecConfig(lossy=True)) as enc:
        chunks = enc.encode(raw, segs, base)
    info, payload = chunks[0]
    assert info.codec == "q8-float32+zstd1" and info.delta
    out = np.empty(info.length, np.uint8)
    decode_chunk(info, payload, out, base)
    assert checksum(out) == info.crc_raw
    assert out.tobytes() != raw[: info.length].tobytes()  # really lossy
    other = base.copy()
    other[8:12] = np.frombuffer(np.float32(3.0).tobytes(), np.uint8)
    with pytest.raises(SnapshotCorruptError, match="wrong base"):
        decode_chunk(info, payload, out, other)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 4
    with pytest.raises(SnapshotCorruptError, match="payload crc32"):
        decode_chunk(info, bytes(bad), out, base)


def test_lossy_falls_back_to_lossless_for_values_it_cannot_quantise() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal(4 * LOSSY_BLOCK).astype(np.float32)
    y = np.abs(x)
    y[10] = -1.0  # sqrt segment with a negative value
    x[20] = np.nan  # linear segment with a NaN
    raw = np.concatenate([x.view(np.uint8), y.view(np.uint8)])
    segs = [
        Segment(offset=0, length=x.nbytes, typesize=4, lossy="linear", dtype="float32"),
        Segment(offset=x.nbytes, length=y.nbytes, typesize=4, lossy="sqrt", dtype="float32"),
    ]
    chunks, out = roundtrip(CodecConfig(lossy=True), raw, segs)
    assert len(chunks) == 2 and not any(i.codec.startswith("q") for i, _ in chunks)
    assert out.tobytes() == raw.tobytes()


def test_lossy_all_zero_and_tiny_blocks() -> None:
    x = np.zeros(3 * LOSSY_BLOCK + 5, np.float32)
    x[LOSSY_BLOCK : 2 * LOSSY_BLOCK] = np.float32(1e-42)  # subnormal block
    x[-5:] = [1.0, -2.0, 3.0, -4.0, 5.0]
    segs = [Segment(offset=0, length=x.nbytes, typesize=4, lossy="linear", dtype="float32")]
    for bits in (8, 4):
        chunks, out = roundtrip(CodecConfig(lossy=True, lossy_bits=bits), x, segs)
        assert chunks[0][0].codec.startswith(f"q{bits}-")
        y = out.view(np.float32)
        assert (y[:LOSSY_BLOCK] == 0).all() and (y[2 * LOSSY_BLOCK : -5] == 0).all()
        assert np.abs(y[LOSSY_BLOCK : 2 * LOSSY_BLOCK] - x[LOSSY_BLOCK : 2 * LOSSY_BLOCK]).max() <= 1e-44
        qmax = 2 ** (bits - 1) - 1
        assert np.abs(y[-5:] - x[-5:]).max() <= 0.501 * 5.0 / qmax


def test_bfloat16_rounding_matches_torch() -> None:
    from nonstop.snapshot.codec.lossy import _from_f32

    rng = np.random.default_rng(7)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(np.float32)
    x[:4] = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x00008000], np.uint32).view(np.float32)  # ties
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.uint8).numpy()
    assert _from_f32(x, "bfloat16").tobytes() == want.tobytes()
