"""The chunk format of :mod:`nonstop.snapshot.codec`: its value types, codec strings, checksums.

What a chunk *is*, independent of how it is produced: :class:`Segment` (a run of the
data buffer with one element size, as :func:`segments_for` lays them out),
:class:`CodecConfig` (how to encode), :class:`ChunkInfo` (how one chunk was encoded,
with its CRC-32C checksums, and its JSON form), the codec-string grammar
(``_parse`` / ``_plan_of``: the package docstring lists the strings) and the
lossy-format constants.

Contract: everything here is pure and thread-safe (the value types are frozen;
``_parse``'s cache is ``functools.lru_cache``, which is thread-safe). Nothing here
allocates or keeps a buffer: ``_u8`` returns a view of the caller's buffer, never a
copy, and the caller keeps owning it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import crc32c
import numpy as np
import numpy.typing as npt

from nonstop.errors import SnapshotCorruptError, UsageError
from nonstop.snapshot.api import TensorEntry

__all__ = [
    "LOSSY_BLOCK",
    "LOSSY_DTYPES",
    "LOSSY_KINDS",
    "LOSSY_MIN_ELEMS",
    "Buffer",
    "ChunkInfo",
    "CodecConfig",
    "Segment",
    "checksum",
    "element_size",
    "segments_for",
]


def _crc(data: Any) -> int:
    """CRC-32C (Castagnoli), hardware-accelerated (SSE4.2 / ARMv8) by the ``crc32c`` package:
    ~16 GB/s here against ~4 GB/s for ``zlib.crc32``; it releases the GIL on large buffers."""
    return int(crc32c.crc32c(data))


Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray[Any, Any]
"""Any C-contiguous bytes-like object; numpy arrays of any dtype are read as their bytes."""

_U8: TypeAlias = npt.NDArray[np.uint8]
_F32: TypeAlias = npt.NDArray[np.float32]

LOSSY_BLOCK = 256
"""Elements per quantisation block (one float32 scale each). Part of the lossy format."""
LOSSY_DTYPES = ("float32", "bfloat16", "float16")
"""The only dtypes lossy mode quantises; every other tensor stays lossless."""
LOSSY_MIN_ELEMS = 1024
"""Tensors with fewer elements stay lossless (counters, norms, biases: tiny and often must be exact)."""
LOSSY_KINDS = ("linear", "sqrt")
"""Values of ``Segment.lossy`` (and of :func:`segments_for`'s ``lossy`` mapping)."""

_CODECS = ("zstd", "lz4", "none")
_SHUFFLES = ("byte", "bit", "none")
_DELTAS = ("xor", "sub")
_TYPESIZES = (1, 2, 4, 8)
_MAX_CHUNK = 1 << 30  # blosc2 handles buffers < 2 GiB

_ELEM_SIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
    "complex32": 2,  # shuffled by component
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "complex64": 4,
    "float64": 8,
    "int64": 8,
    "uint64": 8,
    "complex128": 8,
}


def element_size(dtype: str) -> int:
    """Shuffle width of a torch dtype name: its element size, the component size for
    complex dtypes, 1 for names it does not know (always correct, just less compact)."""
    return _ELEM_SIZE.get(dtype, 1)


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A run ``[offset, offset + length)`` of the data buffer with one element size.

    ``length`` is a multiple of ``typesize``. ``lossy`` (``None``, ``"linear"`` or
    ``"sqrt"``) is honoured only when ``CodecConfig.lossy`` is set and ``dtype`` is one
    of :data:`LOSSY_DTYPES` with ``typesize`` its element size; otherwise the segment
    is encoded losslessly. ``"linear"``: the values (or value - base when a base is
    given) may be quantised. ``"sqrt"``: the values are non-negative (Adam's
    ``exp_avg_sq``) and are quantised as ``sqrt(value)`` (or ``sqrt(value) -
    sqrt(base)``); a chunk that holds a negative or non-finite value is kept lossless.
    """

    offset: int
    length: int
    typesize: int
    lossy: str | None = None
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        if not all(_is_int(v) for v in (self.offset, self.length, self.typesize)):
            raise UsageError("Segment offset, length and typesize must be ints")
        if self.typesize not in _TYPESIZES:
            raise UsageError(f"Segment typesize must be one of {_TYPESIZES}, got {self.typesize}")
        if self.offset < 0 or self.length < 0 or self.length % self.typesize:
            raise UsageError(
                f"Segment(offset={self.offset}, length={self.length}) must be non-negative with a "
                f"length that is a multiple of typesize {self.typesize}"
            )
        if self.lossy is not None and self.lossy not in LOSSY_KINDS:
            raise UsageError(f"Segment lossy must be None or one of {LOSSY_KINDS}, got {self.lossy!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, kw_only=True)
class CodecConfig:
    """How :class:`~nonstop.snapshot.codec.Encoder` encodes.

    * ``codec``: ``"zstd"`` | ``"lz4"`` | ``"none"`` (store raw); ``level``: 1-9
      (C-Blosc2's clevel; 1 is zstd level 1).
    * ``shuffle``: ``"byte"`` | ``"bit"`` | ``"none"``, by element size.
    * ``chunk_bytes``: upper bound of a chunk (64 B to 1 GiB, a multiple of 8);
      ``threads``: chunks encoded in parallel.
    * ``delta``: ``"sub"`` | ``"xor"``, the transform used when a base is given.
    * ``full_every``: for callers: encode a full (non-delta) base every M encodes.
    * ``lossy`` / ``lossy_bits`` (8 or 4): quantise the segments marked lossy.
    """

    codec: str = "zstd"
    level: int = 1
    shuffle: str = "byte"
    chunk_bytes: int = 4 << 20
    threads: int = 1
    full_every: int = 8
    lossy: bool = False
    lossy_bits: int = 8
    delta: str = "sub"

    def __post_init__(self) -> None:
        if self.codec not in _CODECS:
            raise UsageError(f"codec must be one of {', '.join(_CODECS)}, got {self.codec!r}")
        if self.shuffle not in _SHUFFLES:
            raise UsageError(f"shuffle must be one of {', '.join(_SHUFFLES)}, got {self.shuffle!r}")
        if self.delta not in _DELTAS:
            raise UsageError(f"delta must be one of {', '.join(_DELTAS)}, got {self.delta!r}")
        if not _is_int(self.level) or not 1 <= self.level <= 9:
            raise UsageError(f"level must be an int from 1 to 9 (use codec='none' for 0), got {self.level!r}")
        cb = self.chunk_bytes
        if not _is_int(cb) or not 64 <= cb <= _MAX_CHUNK or cb % 8:
            raise UsageError(f"chunk_bytes must be a multiple of 8 from 64 to {_MAX_CHUNK}, got {cb!r}")
        if not _is_int(self.threads) or not 1 <= self.threads <= 256:
            raise UsageError(f"threads must be an int from 1 to 256, got {self.threads!r}")
        if not _is_int(self.full_every) or self.full_every < 1:
            raise UsageError(f"full_every must be an int >= 1, got {self.full_every!r}")
        if not isinstance(self.lossy, bool):
            raise UsageError(f"lossy must be True or False, got {self.lossy!r}")
        if self.lossy_bits not in (4, 8) or not _is_int(self.lossy_bits):
            raise UsageError(f"lossy_bits must be 8 or 4, got {self.lossy_bits!r}")

    def codec_token(self) -> str:
        """The token of the compressor alone: ``"zstd1"``, ``"lz4-1"`` or ``"raw"``."""
        if self.codec == "none":
            return "raw"
        return f"zstd{self.level}" if self.codec == "zstd" else f"lz4-{self.level}"

    def describe(self) -> str:
        """One short string for manifests, e.g. ``"zstd1+shuffle+sub"``,
        ``"lz4-1+bitshuffle+xor"``, ``"zstd1+shuffle+sub+lossy8"`` (the delta transform is
        named even for full checkpoints: it is what deltas of this config use)."""
        parts = [self.codec_token()]
        if self.codec != "none" and self.shuffle != "none":
            parts.append("shuffle" if self.shuffle == "byte" else "bitshuffle")
        parts.append(self.delta)
        if self.lossy:
            parts.append(f"lossy{self.lossy_bits}")
        return "+".join(parts)


@dataclass(frozen=True, kw_only=True)
class ChunkInfo:
    """How one chunk ``[offset, offset + length)`` of the data buffer is encoded.

    ``codec`` is the chunk's own pipeline (package docstring); ``delta``: decoded
    against the same byte range of a base buffer; ``enc_len`` and ``crc_enc``: length
    and CRC-32C of the payload; ``crc_raw``: CRC-32C of the bytes the chunk
    decodes to (for a lossy chunk, the dequantised bytes).
    """

    offset: int
    length: int
    typesize: int
    codec: str
    delta: bool
    enc_len: int
    crc_enc: int
    crc_raw: int

    def to_json(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "length": self.length,
            "typesize": self.typesize,
            "codec": self.codec,
            "delta": self.delta,
            "enc_len": self.enc_len,
            "crc_enc": self.crc_enc,
            "crc_raw": self.crc_raw,
        }

    @classmethod
    def from_json(cls, d: Any) -> ChunkInfo:
        """Inverse of :meth:`to_json`; raises SnapshotCorruptError on anything malformed
        (missing or extra keys, wrong types, negative sizes, unknown codec string)."""
        if not isinstance(d, dict):
            raise SnapshotCorruptError(f"chunk manifest entry is {type(d).__name__}, expected an object")
        keys = ("offset", "length", "typesize", "codec", "delta", "enc_len", "crc_enc", "crc_raw")
        if set(d) != set(keys):
            raise SnapshotCorruptError(
                f"chunk manifest entry has keys {_brief(sorted(d))}, expected {sorted(keys)}"
            )
        for k in ("offset", "length", "typesize", "enc_len", "crc_enc", "crc_raw"):
            if not _is_int(d[k]) or d[k] < 0:
                raise SnapshotCorruptError(
                    f"chunk manifest entry: {k}={_brief(d[k])} is not a non-negative int"
                )
        for k in ("crc_enc", "crc_raw"):
            if d[k] > 0xFFFFFFFF:
                raise SnapshotCorruptError(f"chunk manifest entry: {k}={d[k]} is not a crc32")
        if d["typesize"] not in _TYPESIZES or d["length"] % d["typesize"]:
            raise SnapshotCorruptError(
                f"chunk manifest entry at offset {d['offset']}: typesize {d['typesize']} "
                f"does not fit length {d['length']}"
            )
        if not isinstance(d["delta"], bool):
            raise SnapshotCorruptError(f"chunk manifest entry: delta={_brief(d['delta'])} is not a bool")
        if not isinstance(d["codec"], str):
            raise SnapshotCorruptError(f"chunk manifest entry: codec={_brief(d['codec'])} is not a string")
        info = cls(**{k: d[k] for k in keys})
        _plan_of(info)  # validates the codec string against delta/typesize
        return info


# --------------------------------------------------------------------------- segments


def segments_for(
    entries: Sequence[TensorEntry], data_len: int, lossy: Mapping[int, str] | None = None
) -> list[Segment]:
    """Segments that cover ``[0, data_len)`` exactly, in offset order, without overlap.

    Consecutive tensors with the same element size (:func:`element_size`) share a
    segment. Alignment padding and any other uncovered bytes join the lossless segment
    before them, else the one after them, whose element size divides their length; else
    they form (or join) a typesize-1 segment. Padding never enters a lossy segment
    except between two tensors of that segment. ``lossy`` maps a tensor's index in ``entries`` to ``"linear"``
    or ``"sqrt"``; it is kept only for tensors of :data:`LOSSY_DTYPES` with at least
    :data:`LOSSY_MIN_ELEMS` elements (others are silently lossless). Consecutive lossy
    tensors of the same kind and dtype share a segment (with the padding between them);
    padding after them goes to a lossless segment.

    Raises UsageError if entries overlap, fall outside ``[0, data_len)``, or ``lossy``
    names an unknown tensor index or kind.
    """
    if not _is_int(data_len) or data_len < 0:
        raise UsageError(f"data_len must be a non-negative int, got {data_len!r}")
    marks = dict(lossy or {})
    for i, kind in marks.items():
        if not _is_int(i) or not 0 <= i < len(entries):
            raise UsageError(f"lossy names tensor {i!r}, but there are {len(entries)} tensors")
        if kind not in LOSSY_KINDS:
            raise UsageError(f"lossy kind of tensor {i} must be one of {LOSSY_KINDS}, got {kind!r}")

    # Pieces: [offset, length, typesize, lossy kind, dtype, is_gap]
    pieces: list[list[Any]] = []
    pos = 0
    for i in sorted(range(len(entries)), key=lambda j: (entries[j].offset, entries[j].nbytes)):
        e = entries[i]
        if e.nbytes == 0:
            continue
        if e.offset < pos or e.nbytes < 0 or e.offset + e.nbytes > data_len:
            raise UsageError(
                f"tensor {i} at [{e.offset}, {e.offset + e.nbytes}) overlaps another or lies outside "
                f"[0, {data_len}): pass the entries of one layout and its data length"
            )
        if e.offset > pos:
            pieces.append([pos, e.offset - pos, 1, None, "uint8", True])
        ts = element_size(e.dtype)
        if e.nbytes % ts:
            ts = 1
        mark = marks.get(i)
        if mark is not None and not (e.dtype in LOSSY_DTYPES and e.nbytes // ts >= LOSSY_MIN_ELEMS):
            mark = None
        pieces.append([e.offset, e.nbytes, ts, mark, e.dtype if mark else f"uint{8 * ts}", False])
        pos = e.offset + e.nbytes
    if pos < data_len:
        pieces.append([pos, data_len - pos, 1, None, "uint8", True])

    # Give each gap the key of a neighbour it can join.
    for j, p in enumerate(pieces):
        if not p[5]:
            continue
        prev = pieces[j - 1] if j > 0 else None
        nxt = pieces[j + 1] if j + 1 < len(pieces) else None
        if prev is not None and prev[3] is None and p[1] % prev[2] == 0:
            p[2:5] = prev[2:5]
        elif (
            prev is not None
            and prev[3] is not None
            and nxt is not None
            and nxt[3:5] == prev[3:5]
            and p[1] % prev[2] == 0
        ):
            p[2:5] = prev[2:5]
        elif nxt is not None and nxt[3] is None and p[1] % nxt[2] == 0:
            p[2:5] = nxt[2:5]

    out: list[list[Any]] = []
    for p in pieces:
        if out and out[-1][2:5] == p[2:5]:
            out[-1][1] += p[1]
        else:
            out.append(list(p))
    return [Segment(offset=p[0], length=p[1], typesize=p[2], lossy=p[3], dtype=p[4]) for p in out]


# --------------------------------------------------------------------------- helpers


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _u8(buf: Buffer, what: str, *, writable: bool = False) -> _U8:
    """A flat uint8 view (no copy) of ``buf``."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise UsageError(f"{what} must be C-contiguous")
        arr: _U8 = buf.reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise UsageError(f"{what} must be a C-contiguous bytes-like object: {e}") from None
    if writable and not arr.flags.writeable:
        raise UsageError(f"{what} must be writable (a bytearray, writable memoryview or numpy array)")
    return arr


def _corrupt(info: ChunkInfo, what: str) -> SnapshotCorruptError:
    return SnapshotCorruptError(
        f"chunk at offset {info.offset} (+{info.length} bytes, {_brief(info.codec)}): {what}"
    )


def _brief(v: object) -> str:
    """``repr(v)``, cut short: error messages quote stored values, which may be huge, and any
    string read from a file escaped (a lone surrogate from JSON's ``"\\ud800"`` cannot be
    written to a UTF-8 log or sent to a test runner)."""
    r = repr(v[:81] if isinstance(v, str) else v)
    return r if len(r) <= 80 else r[:80] + "..."


# --------------------------------------------------------------------------- codec strings


@dataclass(frozen=True)
class _Plan:
    delta: str | None  # lossless: "xor" / "sub" / None
    blosc: bool  # payload is a blosc2 frame (else raw)
    bits: int  # lossy: 8 or 4; 0 = lossless
    sqrt: bool
    dtype: str  # lossy element dtype


_CODEC_RE = re.compile(r"zstd[1-9]|lz4-[1-9]")
_LOSSY_RE = re.compile(r"q(8|4)(sqrt)?-(float32|bfloat16|float16)")


@functools.lru_cache(maxsize=256)
def _parse(codec: str) -> _Plan | None:
    toks = codec.split("+")
    if _LOSSY_RE.fullmatch(toks[0]):
        m = _LOSSY_RE.fullmatch(toks[0])
        assert m is not None
        if len(toks) != 2 or not (toks[1] == "raw" or _CODEC_RE.fullmatch(toks[1])):
            return None
        return _Plan(None, toks[1] != "raw", int(m.group(1)), m.group(2) is not None, m.group(3))
    delta = None
    if toks[0] in _DELTAS:
        delta, toks = toks[0], toks[1:]
    if toks == ["raw"]:
        return _Plan(delta, False, 0, False, "")
    if not toks or not _CODEC_RE.fullmatch(toks[0]) or len(toks) > 2:
        return None
    if len(toks) == 2 and toks[1] not in ("shuffle", "bitshuffle"):
        return None
    return _Plan(delta, True, 0, False, "")


def _lossy_body_len(length: int, typesize: int, bits: int) -> int:
    """Bytes of a lossy chunk's body before compression: a float32 scale per block of
    LOSSY_BLOCK elements, then the quantised values (``bits`` each)."""
    nb = -(-(length // typesize) // LOSSY_BLOCK)
    qlen = nb * LOSSY_BLOCK if bits == 8 else (nb * LOSSY_BLOCK + 1) // 2
    return 4 * nb + qlen


def _plan_of(info: ChunkInfo) -> _Plan:
    """The decoding plan of ``info``, once its fields are known to agree with each other and
    with its codec string: SnapshotCorruptError otherwise. Besides the codec string, the sizes:
    no chunk decodes to more than an encoder writes (1 GiB), a payload stored as is is exactly
    as long as what it decodes to, and a compressed one is shorter (the encoder stores a chunk
    that does not shrink as is)."""
    plan = _parse(info.codec)
    if plan is None:
        raise _corrupt(info, "unknown codec string")
    if plan.bits:
        if element_size(plan.dtype) != info.typesize:
            raise _corrupt(info, f"lossy dtype {plan.dtype} does not match typesize {info.typesize}")
    elif (plan.delta is not None) != info.delta:
        raise _corrupt(info, f"delta={info.delta} contradicts the codec string")
    if info.length > _MAX_CHUNK or info.length % info.typesize:
        raise _corrupt(info, f"a chunk decodes to at most {_MAX_CHUNK} bytes, whole elements")
    body = _lossy_body_len(info.length, info.typesize, plan.bits) if plan.bits else info.length
    if not plan.blosc and info.enc_len != body:
        raise _corrupt(info, f"a raw payload must be exactly {body} bytes, enc_len says {info.enc_len}")
    if plan.blosc and info.enc_len >= body:
        raise _corrupt(
            info,
            f"a compressed payload is shorter than the {body} bytes it decodes to, "
            f"enc_len says {info.enc_len}",
        )
    return plan


def checksum(data: Buffer) -> int:
    """CRC-32C of ``data``'s bytes (the checksum used by ChunkInfo)."""
    return _crc(_u8(data, "data").data)
