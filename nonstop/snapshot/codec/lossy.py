"""The lossy path of :mod:`nonstop.snapshot.codec`: block-wise quantisation of float tensors.

A lossy chunk's body is one float32 scale per block of :data:`LOSSY_BLOCK` elements
followed by the integer codes (``lossy_bits`` 8: one byte each; 4: two per byte,
``_pack4``), compressed without shuffle. ``_lossy_encode`` quantises the values (or
their difference to the base; for ``"sqrt"`` segments their square roots) and
``_lossy_decode`` reverses it; the error bound is stated in
:func:`~nonstop.snapshot.codec.decode_chunk`.

Contract: thread-safe, no state of its own. ``_lossy_encode`` reads its inputs and
returns a fresh payload; ``_lossy_decode`` writes only into the ``out`` it is given
and decompresses into the calling thread's scratch slot 0 (see
:mod:`nonstop.snapshot.codec.lossless`). ``_to_f32`` of a float32 buffer is a view of
it, not a copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from nonstop.snapshot.codec.format import (
    _F32,
    _U8,
    LOSSY_BLOCK,
    ChunkInfo,
    CodecConfig,
    Segment,
    _corrupt,
    _crc,
    _lossy_body_len,
    _Plan,
)
from nonstop.snapshot.codec.lossless import _SCRATCH, _blosc_compress, _blosc_decompress

__all__: list[str] = []


def _to_f32(raw: _U8, dtype: str) -> _F32:
    """Element values of ``raw`` (bytes of ``dtype``) as float32 (a view for float32)."""
    if dtype == "float32":
        return raw.view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _from_f32(y: _F32, dtype: str) -> _U8:
    """Bytes of ``y`` rounded (to nearest, ties to even) to ``dtype``. ``y`` is finite."""
    if dtype == "float32":
        return y.view(np.uint8)
    if dtype == "float16":
        return y.astype(np.float16).view(np.uint8)
    u = y.view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    return r.astype(np.uint16).view(np.uint8)


def _blocks(x: _F32) -> _F32:
    """``x`` as rows of LOSSY_BLOCK, the last one zero-padded (a copy only if padding is needed)."""
    nb = -(-len(x) // LOSSY_BLOCK)
    if nb * LOSSY_BLOCK == len(x):
        return x.reshape(nb, LOSSY_BLOCK)
    padded = np.zeros(nb * LOSSY_BLOCK, np.float32)
    padded[: len(x)] = x
    return padded.reshape(nb, LOSSY_BLOCK)


def _quantise(q_in: _F32, bits: int, unsigned: bool) -> tuple[_F32, npt.NDArray[Any]]:
    """Per-block scales and the integer codes (int8 / uint8, one per padded element)."""
    qmax = (1 << bits) - 1 if unsigned else (1 << (bits - 1)) - 1
    blk = _blocks(q_in)
    absmax = np.abs(blk).max(axis=1)
    scale = (absmax / np.float32(qmax)).astype(np.float32)
    scale[scale < np.finfo(np.float32).smallest_subnormal] = np.finfo(np.float32).smallest_subnormal
    scale[absmax == 0] = np.float32(1.0)
    q = np.rint(blk / scale[:, None])
    np.clip(q, 0 if unsigned else -qmax, qmax, out=q)
    return scale, q.astype(np.uint8 if unsigned else np.int8).reshape(-1)


def _dequantise(scale: _F32, q: npt.NDArray[Any], n: int) -> _F32:
    deq = q.astype(np.float32).reshape(len(scale), LOSSY_BLOCK)
    deq *= scale[:, None]
    return deq.reshape(-1)[:n]


def _pack4(q: npt.NDArray[Any]) -> _U8:
    u = q.view(np.uint8) & np.uint8(0x0F)
    if len(u) % 2:
        u = np.append(u, np.uint8(0))
    return (u[0::2] | (u[1::2] << np.uint8(4))).astype(np.uint8)


def _unpack4(packed: _U8, n: int, signed: bool) -> npt.NDArray[Any]:
    out = np.empty(2 * len(packed), np.uint8)
    out[0::2] = packed & np.uint8(0x0F)
    out[1::2] = packed >> np.uint8(4)
    out = out[:n]
    if signed:
        return ((out ^ np.uint8(8)).view(np.int8) - np.int8(8)).astype(np.int8)
    return out


def _reconstruct(deq: _F32, base32: _F32 | None, sqrt: bool) -> _F32:
    """The float32 values a lossy chunk decodes to, before rounding to its dtype."""
    if not sqrt:
        return deq if base32 is None else base32 + deq
    s = deq if base32 is None else np.maximum(np.sqrt(base32) + deq, np.float32(0))
    return s * s


def _lossy_encode(
    x_raw: _U8, b_raw: _U8 | None, seg: Segment, cfg: CodecConfig
) -> tuple[str, bytes, int] | None:
    """``(codec, payload, crc_raw)`` of a lossy chunk, or None to keep it lossless."""
    x = _to_f32(x_raw, seg.dtype)
    b = None if b_raw is None else _to_f32(b_raw, seg.dtype)
    sqrt = seg.lossy == "sqrt"
    with np.errstate(all="ignore"):
        if sqrt:
            if not (np.all(x >= 0) and np.isfinite(x).all()):
                return None
            if b is not None and not (np.all(b >= 0) and np.isfinite(b).all()):
                return None
            v = np.sqrt(x)
            if b is not None:
                v -= np.sqrt(b)
        else:
            v = x if b is None else x - b
        if not np.isfinite(v).all():
            return None
        scale, q = _quantise(v, cfg.lossy_bits, unsigned=sqrt and b is None)
        y = _reconstruct(_dequantise(scale, q, len(x)), b, sqrt)
        if not np.isfinite(y).all():
            return None
        out = _from_f32(y, seg.dtype)
        if seg.dtype != "float32" and not np.isfinite(_to_f32(out, seg.dtype)).all():
            return None
    qbytes = q.view(np.uint8) if cfg.lossy_bits == 8 else _pack4(q)
    body = np.concatenate([scale.view(np.uint8), qbytes])
    token = f"q{cfg.lossy_bits}{'sqrt' if sqrt else ''}-{seg.dtype}"
    comp = _blosc_compress(body, 1, cfg, "none")
    if comp is None:
        return f"{token}+raw", body.tobytes(), _crc(out.data)
    return f"{token}+{cfg.codec_token()}", comp, _crc(out.data)


def _lossy_decode(info: ChunkInfo, plan: _Plan, payload: _U8, out: _U8, base: _U8 | None) -> None:
    n = info.length // info.typesize
    nb = -(-n // LOSSY_BLOCK)
    body_len = _lossy_body_len(info.length, info.typesize, plan.bits)
    if plan.blosc:
        body = _SCRATCH.get(0, body_len)
        _blosc_decompress(info, payload, body)
    else:
        if len(payload) != body_len:
            raise _corrupt(info, f"lossy body is {len(payload)} bytes, expected {body_len}")
        body = payload
    scale = body[: 4 * nb].copy().view(np.float32)
    qb = body[4 * nb :]
    unsigned = plan.sqrt and not info.delta
    q = (
        qb.view(np.uint8 if unsigned else np.int8)
        if plan.bits == 8
        else _unpack4(qb, nb * LOSSY_BLOCK, not unsigned)
    )
    base32 = None if base is None else _to_f32(base, plan.dtype)
    with np.errstate(all="ignore"):
        y = _reconstruct(_dequantise(scale, q, n), base32, plan.sqrt)
        out[:] = _from_f32(y, plan.dtype)
