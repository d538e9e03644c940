"""The lossless path of :mod:`nonstop.snapshot.codec`: delta transforms and C-Blosc2.

* delta: ``_xor_into`` (bitwise XOR) and ``_sub_encode`` / ``_sub_decode_inplace``
  (per-element integer difference, zig-zag folded), both exactly reversible;
* shuffle + compression: ``_blosc_compress`` / ``_blosc_decompress`` over C-Blosc2
  (``blosc2``), imported on first use by ``_b2`` (or ahead of time by :func:`preload`).

Contract: every function here is thread-safe. ``_b2`` imports ``blosc2`` once under a
lock and switches on its GIL release (``blosc2.set_releasegil(True)``, process-wide),
which is what lets the encode and decode thread pools scale. Buffers: the functions
write only into the ``out`` (and ``tmp``) arrays their caller passes and own nothing;
``_blosc_compress`` returns fresh ``bytes``. ``_SCRATCH`` holds per-thread scratch
buffers (``threading.local``), reused by the next call *on the same thread*: a view
from ``_SCRATCH.get`` is valid until that thread asks for the same slot again, so a
caller copies out (``tobytes``) whatever it hands back. Slot 0 holds a chunk's
delta (encode) or a lossy chunk's decompressed body (decode); slot 1 the temporary
of the sub transform.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from nonstop.snapshot.codec.format import _U8, ChunkInfo, CodecConfig, _corrupt

__all__ = ["preload"]

_BLOSC_BLOCKSIZE = 256 << 10  # measured: faster than blosc2's automatic choice at zstd/lz4 level 1


def preload() -> None:
    """Import the compression library now (~0.3 s), e.g. before a first time-critical encode."""
    _b2()


# --------------------------------------------------------------------------- blosc2

_blosc2: Any = None
_blosc2_lock = threading.Lock()


def _b2() -> Any:
    """``blosc2``, imported on first use (import takes ~0.3 s) with GIL release switched on."""
    global _blosc2
    if _blosc2 is None:
        with _blosc2_lock:
            if _blosc2 is None:
                import blosc2

                blosc2.set_releasegil(True)
                _blosc2 = blosc2
    return _blosc2


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


class _Scratch(threading.local):
    """Per-thread reusable buffers, grown on demand."""

    def __init__(self) -> None:
        self.bufs: list[_U8] = []

    def get(self, k: int, n: int) -> _U8:
        while len(self.bufs) <= k:
            self.bufs.append(np.empty(0, np.uint8))
        if len(self.bufs[k]) < n:
            self.bufs[k] = np.empty(max(n, 64), np.uint8)
        return self.bufs[k][:n]


_SCRATCH = _Scratch()


def _xor_into(a: _U8, b: _U8, out: _U8) -> None:
    """``out = a ^ b`` bytewise, 8 bytes at a time."""
    n8 = len(a) // 8 * 8
    if n8:
        np.bitwise_xor(a[:n8].view(np.uint64), b[:n8].view(np.uint64), out=out[:n8].view(np.uint64))
    if n8 < len(a):
        np.bitwise_xor(a[n8:], b[n8:], out=out[n8:])


def _sub_encode(x: _U8, b: _U8, ts: int, out: _U8, tmp: _U8) -> None:
    """``out = zigzag(x - b)`` per ``ts``-byte integer (wrapping)."""
    s, t = out.view(_SINT[ts]), tmp.view(_SINT[ts])
    np.subtract(x.view(_SINT[ts]), b.view(_SINT[ts]), out=s)
    np.right_shift(s, 8 * ts - 1, out=t)
    np.left_shift(s, 1, out=s)
    np.bitwise_xor(s, t, out=s)


def _sub_decode_inplace(z: _U8, b: _U8, ts: int, tmp: _U8) -> None:
    """``z = b + unzigzag(z)`` per ``ts``-byte integer (wrapping), in place."""
    u, t = z.view(_UINT[ts]), tmp.view(_UINT[ts])
    np.bitwise_and(u, 1, out=t)
    np.negative(t, out=t)
    np.right_shift(u, 1, out=u)
    np.bitwise_xor(u, t, out=u)
    np.add(u, b.view(_UINT[ts]), out=u)


def _blosc_compress(data: _U8, ts: int, cfg: CodecConfig, shuffle: str) -> bytes | None:
    """The blosc2 frame of ``data``, or None when it does not shrink (or codec is none)."""
    if cfg.codec == "none" or len(data) == 0:
        return None
    b2 = _b2()
    filt = {"byte": b2.Filter.SHUFFLE, "bit": b2.Filter.BITSHUFFLE, "none": b2.Filter.NOFILTER}[shuffle]
    out: bytes = b2.compress2(
        data,
        typesize=ts,
        clevel=cfg.level,
        codec=b2.Codec.ZSTD if cfg.codec == "zstd" else b2.Codec.LZ4,
        filters=[filt],
        nthreads=1,
        blocksize=_BLOSC_BLOCKSIZE,
    )
    return out if len(out) < len(data) else None


def _blosc_check(info: ChunkInfo, payload: _U8, n_out: int) -> None:
    """SnapshotCorruptError unless ``payload``'s blosc2 frame header says it holds exactly
    ``n_out`` bytes compressed into exactly ``len(payload)`` (reads the header only)."""
    b2 = _b2()
    try:
        nbytes, cbytes, _ = b2.get_cbuffer_sizes(payload)
    except Exception as e:  # too short or not a blosc2 frame
        raise _corrupt(info, f"bad compressed frame ({type(e).__name__})") from None
    if nbytes != n_out or cbytes != len(payload):
        raise _corrupt(info, f"frame says {nbytes} bytes from {cbytes}, expected {n_out} from {len(payload)}")


def _blosc_decompress(info: ChunkInfo, payload: _U8, out: _U8) -> None:
    b2 = _b2()
    _blosc_check(info, payload, len(out))
    try:
        b2.decompress2(payload, dst=out, nthreads=1)
    except Exception as e:
        raise _corrupt(info, f"decompression failed ({type(e).__name__}: {e})") from None
