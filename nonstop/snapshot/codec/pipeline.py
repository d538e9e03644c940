"""The front end of :mod:`nonstop.snapshot.codec`: :class:`Encoder`, :func:`decode_chunk`, :func:`decode`.

:class:`Encoder` cuts a data buffer into chunks along its segments and encodes each
one (lossy where allowed and worthwhile, else delta + shuffle + compression), adding
the checksums; :func:`decode_chunk` checks and decodes one chunk, :func:`decode` a
whole buffer.

Contract: an :class:`Encoder` is used by one thread at a time; it owns a thread pool
(``config.threads`` > 1) until :meth:`Encoder.close`. :func:`decode_chunk` and
:func:`decode` are thread-safe (:func:`decode` runs a pool of its own per call).
Buffers: the caller owns ``raw``, ``base`` and ``out``; neither input is modified. A
payload of a chunk stored raw without a delta is a view of ``raw`` (no copy), every
other payload is fresh ``bytes``. Decoding writes only into ``out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from nonstop.errors import NonstopError, SnapshotCorruptError, UsageError
from nonstop.snapshot.codec.format import (
    _U8,
    LOSSY_BLOCK,
    LOSSY_DTYPES,
    Buffer,
    ChunkInfo,
    CodecConfig,
    Segment,
    _corrupt,
    _crc,
    _is_int,
    _lossy_body_len,
    _Plan,
    _plan_of,
    _u8,
    element_size,
)
from nonstop.snapshot.codec.lossless import (
    _SCRATCH,
    _blosc_check,
    _blosc_compress,
    _blosc_decompress,
    _sub_decode_inplace,
    _sub_encode,
    _xor_into,
)
from nonstop.snapshot.codec.lossy import _lossy_decode, _lossy_encode
from nonstop.snapshot.validate import RESIDUAL

__all__ = ["Encoder", "check_chunks", "check_sizes", "decode", "decode_chunk"]


class Encoder:
    """Encodes data buffers chunk by chunk with ``config.threads`` threads.

    Not thread-safe (one ``encode`` at a time); :meth:`close` stops its threads.
    """

    def __init__(self, config: CodecConfig) -> None:
        if not isinstance(config, CodecConfig):
            raise UsageError(f"Encoder needs a CodecConfig, got {type(config).__name__}")
        self.config = config
        self._pool = (
            ThreadPoolExecutor(config.threads, thread_name_prefix="nonstop-encode")
            if config.threads > 1
            else None
        )

    def __enter__(self) -> Encoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def encode(
        self, raw: Buffer, segments: Sequence[Segment], base: Buffer | None = None
    ) -> list[tuple[ChunkInfo, Buffer]]:
        """Encode ``raw``; return ``(info, payload)`` per chunk, in offset order.

        ``segments`` must tile ``[0, len(raw))`` exactly (as :func:`segments_for` does).
        Each segment is cut into chunks of at most ``chunk_bytes`` (a multiple of its
        typesize; for lossy segments, of whole quantisation blocks when one fits).
        With ``base`` (same length as ``raw``), every chunk is a delta chunk.

        Lossy delta chunks decode to ``base + dequantised(raw - base)`` with the base
        *given at decode*, and their ``crc_raw`` is computed with the base given here:
        pass the base as the reader will have it (for a lossy base, its decoded bytes),
        else the chunk fails its checksum at decode. Neither buffer is modified; both
        must stay unchanged until ``encode`` returns, and ``raw`` until the payloads are
        used: a chunk stored raw without a delta is a view of ``raw``, not a copy.
        """
        cfg = self.config
        r = _u8(raw, "raw")
        b = None if base is None else _u8(base, "base")
        if b is not None and len(b) != len(r):
            raise UsageError(f"base is {len(b)} bytes but raw is {len(r)}: a base must have the same layout")
        pos = 0
        jobs: list[tuple[int, int, Segment]] = []
        for seg in sorted(segments, key=lambda s: s.offset):
            if not isinstance(seg, Segment) or seg.offset != pos:
                raise UsageError(
                    f"segments must tile [0, {len(r)}) without gaps or overlap; "
                    f"expected one starting at {pos}: build them with segments_for()"
                )
            pos = seg.end
            step = cfg.chunk_bytes // seg.typesize * seg.typesize
            if self._lossy_ok(seg) and cfg.chunk_bytes >= LOSSY_BLOCK * seg.typesize:
                step = cfg.chunk_bytes // (LOSSY_BLOCK * seg.typesize) * (LOSSY_BLOCK * seg.typesize)
            jobs.extend((off, min(step, seg.end - off), seg) for off in range(seg.offset, seg.end, step))
        if pos != len(r):
            raise UsageError(
                f"segments cover [0, {pos}) but raw is {len(r)} bytes: build them with segments_for()"
            )

        def one(job: tuple[int, int, Segment]) -> tuple[ChunkInfo, Buffer]:
            off, n, seg = job
            return self._encode_chunk(r[off : off + n], None if b is None else b[off : off + n], off, seg)

        if self._pool is None or len(jobs) < 2:
            return [one(j) for j in jobs]
        return list(self._pool.map(one, jobs))

    def _lossy_ok(self, seg: Segment) -> bool:
        return (
            self.config.lossy
            and seg.lossy is not None
            and seg.dtype in LOSSY_DTYPES
            and element_size(seg.dtype) == seg.typesize
        )

    def _encode_chunk(self, x: _U8, b: _U8 | None, off: int, seg: Segment) -> tuple[ChunkInfo, Buffer]:
        cfg, ts, n = self.config, seg.typesize, len(x)
        got = _lossy_encode(x, b, seg, cfg) if self._lossy_ok(seg) else None
        payload: Buffer
        if got is not None:
            codec, payload, crc_raw = got
        else:
            crc_raw = _crc(x.data)
            data, prefix = x, ""
            if b is not None:
                data = _SCRATCH.get(0, n)
                if cfg.delta == "xor":
                    _xor_into(x, b, data)
                else:
                    _sub_encode(x, b, ts, data, _SCRATCH.get(1, n))
                prefix = cfg.delta + "+"
            comp = _blosc_compress(data, ts, cfg, cfg.shuffle)
            if comp is None:
                # Stored as is. Without a delta this is a view of the caller's buffer (no copy:
                # fresh memory costs a page fault per 4 KiB); a delta lives in per-thread scratch.
                codec, payload = prefix + "raw", (x if b is None else data.tobytes())
            else:
                shuf = {"byte": "+shuffle", "bit": "+bitshuffle", "none": ""}[cfg.shuffle]
                codec, payload = prefix + cfg.codec_token() + shuf, comp
        info = ChunkInfo(
            offset=off,
            length=n,
            typesize=ts,
            codec=codec,
            delta=b is not None,
            enc_len=len(payload),
            crc_enc=_crc(payload),
            crc_raw=crc_raw,
        )
        return info, payload


# --------------------------------------------------------------------------- decoding


def decode_chunk(
    info: ChunkInfo, payload: Buffer, out: memoryview | np.ndarray[Any, Any], base: Buffer | None
) -> None:
    """Decode one chunk into ``out`` (writable, exactly ``info.length`` bytes).

    ``base`` is the whole base buffer (the chunk uses ``base[info.offset :
    info.offset + info.length]``); it is needed only for delta chunks and must not
    overlap ``out``. Before decoding, the payload's length and ``crc_enc`` are
    checked; after, ``crc_raw``.
    Any mismatch, a malformed payload, a codec string that this version does not
    know, or a delta chunk without (or with too short) a base raises
    SnapshotCorruptError with one line naming the chunk; ``out`` is then undefined.

    Lossy chunks: with ``Δ = max|v| / qmax`` over the chunk's block of
    :data:`LOSSY_BLOCK` elements holding the element, ``qmax = 2**(bits-1) - 1``
    (``2**bits - 1`` for sqrt chunks without a base), ``ε`` the unit roundoff of the
    dtype (2**-24 float32, 2**-8 bfloat16, 2**-11 float16), ``x`` the encoded value
    and ``b`` its base value (0 without a base), the decoded value ``y`` satisfies

    * ``"linear"`` (``v = x - b``): ``|y - x| <= 0.501 Δ + 4 ε (|x| + |b|)``;
    * ``"sqrt"`` (``v = √x - √b``): ``|√y - √x| <= 0.501 Δ + 4 ε (√x + √b)``,

    plus ``μ`` (linear) or ``√μ`` (sqrt) for the rounding of results in the dtype's
    subnormal range, ``μ`` its smallest subnormal; provided the base given at decode is
    the base given at encode (else the chunk fails ``crc_raw``).
    """
    plan = _plan_of(info)
    o = _u8(out, "out", writable=True)
    if len(o) != info.length:
        raise UsageError(f"out is {len(o)} bytes, chunk at offset {info.offset} decodes to {info.length}")
    try:
        _decode_checked(info, plan, payload, o, base)
    except NonstopError:
        raise
    except MemoryError:
        raise _corrupt(info, "decoding it needs more memory than is free (MemoryError)") from None
    except RESIDUAL as e:
        raise _corrupt(
            info, f"cannot decode ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from None


def _decode_checked(info: ChunkInfo, plan: _Plan, payload: Buffer, o: _U8, base: Buffer | None) -> None:
    p = _u8(payload, "payload")
    if len(p) != info.enc_len:
        raise _corrupt(info, f"payload is {len(p)} bytes, expected {info.enc_len} (truncated?)")
    got = _crc(p.data)
    if got != info.crc_enc:
        raise _corrupt(info, f"payload crc32c {got:#010x}, expected {info.crc_enc:#010x}")
    b = None
    if info.delta:
        if base is None:
            raise _corrupt(info, "delta chunk but no base buffer given")
        full_base = _u8(base, "base")
        if len(full_base) < info.offset + info.length:
            raise _corrupt(info, f"delta chunk but the base is only {len(full_base)} bytes")
        b = full_base[info.offset : info.offset + info.length]
    if plan.bits:
        _lossy_decode(info, plan, p, o, b)
    else:
        if plan.blosc:
            _blosc_decompress(info, p, o)
        else:
            o[:] = p
        if b is not None:
            if plan.delta == "xor":
                _xor_into(o, b, o)
            else:
                _sub_decode_inplace(o, b, info.typesize, _SCRATCH.get(1, info.length))
    got = _crc(o.data)
    if got != info.crc_raw:
        raise _corrupt(info, f"decoded crc32c {got:#010x}, expected {info.crc_raw:#010x} (wrong base?)")


def check_sizes(info: ChunkInfo, payload: Buffer) -> None:
    """Check, without decoding, that ``payload`` can be ``info``'s: the codec string and sizes
    of ``info`` agree, the payload is ``enc_len`` bytes, and a compressed payload's frame
    header announces what ``info`` says it decodes to. SnapshotCorruptError otherwise.

    Cheap (no checksum, no decompression): a reader runs it over every chunk before it
    allocates the buffer the chunks claim to fill, so a length field is never trusted alone."""
    plan = _plan_of(info)
    p = _u8(payload, "payload")
    if len(p) != info.enc_len:
        raise _corrupt(info, f"payload is {len(p)} bytes, expected {info.enc_len} (truncated?)")
    if plan.blosc:
        body = _lossy_body_len(info.length, info.typesize, plan.bits) if plan.bits else info.length
        _blosc_check(info, p, body)


def _check_tiling(chunks: Sequence[tuple[ChunkInfo, Buffer]], data_len: int) -> None:
    pos = 0
    for info, _ in sorted(chunks, key=lambda c: c[0].offset):
        if info.offset != pos:
            what = "overlap" if info.offset < pos else "gap"
            raise SnapshotCorruptError(
                f"chunks do not tile the data: {what} at offset {min(pos, info.offset)}"
            )
        pos += info.length
    if pos != data_len:
        raise SnapshotCorruptError(f"chunks cover {pos} bytes but the data is {data_len} bytes")


def check_chunks(chunks: Sequence[tuple[ChunkInfo, Buffer]], data_len: int) -> None:
    """Check, without decoding, that ``chunks`` can decode to ``data_len`` bytes: they tile
    ``[0, data_len)`` exactly and each passes :func:`check_sizes`. SnapshotCorruptError
    otherwise. What a reader runs before it allocates the ``data_len`` bytes a header claims."""
    _check_tiling(chunks, data_len)
    for info, payload in chunks:
        check_sizes(info, payload)


def decode(
    chunks: Sequence[tuple[ChunkInfo, Buffer]],
    out: memoryview | bytearray | np.ndarray[Any, Any],
    base: Buffer | None,
    threads: int = 1,
) -> None:
    """Decode ``chunks`` into ``out`` (writable, the full data length) with ``threads`` threads.

    The chunks must tile ``[0, len(out))`` exactly (any order); a gap, an overlap or a
    chunk past the end raises SnapshotCorruptError, as does any chunk failing
    :func:`decode_chunk` (the first failure is raised after all chunks ran; ``out`` is
    then undefined).
    """
    o = _u8(out, "out", writable=True)
    if not _is_int(threads) or threads < 1:
        raise UsageError(f"threads must be an int >= 1, got {threads!r}")
    _check_tiling(chunks, len(o))
    ordered = sorted(chunks, key=lambda c: c[0].offset)

    def one(c: tuple[ChunkInfo, Buffer]) -> None:
        info, payload = c
        decode_chunk(info, payload, o[info.offset : info.offset + info.length], base)

    if threads == 1 or len(ordered) < 2:
        for c in ordered:
            one(c)
        return
    with ThreadPoolExecutor(min(threads, len(ordered)), thread_name_prefix="nonstop-decode") as pool:
        futures = [pool.submit(one, c) for c in ordered]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
