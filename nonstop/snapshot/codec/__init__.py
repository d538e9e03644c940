"""Background encoding of a snapshot's data area: delta, shuffle, compress, checksum.

A rank's snapshot data area is one flat byte buffer of tensors (see
:mod:`nonstop.snapshot.api`). To replicate or persist it, :class:`Encoder` cuts it
into **chunks** and encodes each one on its own, in parallel threads:

1. *delta* (optional): when a ``base`` buffer of the same layout is given, every
   chunk is encoded against the same byte range of ``base``. ``CodecConfig.delta``
   picks the transform, both exactly reversible: ``"sub"`` (default: per element,
   the integer difference of the bit patterns, zig-zag folded so that small changes
   of either sign give small numbers) or ``"xor"`` (bitwise XOR). On trained fp32
   Adam state ``sub`` compresses 1.42x against 1.39x for XOR, bf16 2.49x vs 2.28x
   (``benchmarks/bench_encode.py``).
2. *shuffle*: byte shuffle (or bit shuffle) by element size, so that the bytes of
   equal significance (sign and exponent, high mantissa, ...) sit together.
3. *compression*: zstd or lz4. Steps 2 and 3 are done by C-Blosc2 (``blosc2``); a
   chunk that does not shrink is stored as is (``"raw"``).
4. *checksums*: CRC-32C of the payload (checked before decoding) and of the
   bytes the chunk decodes to (checked after). A decode never hands back wrong
   bytes silently: it raises :class:`~nonstop.errors.SnapshotCorruptError`.

Lossy mode (``CodecConfig(lossy=True)``; off by default) quantises the floating
tensors that the caller marks (:func:`segments_for`'s ``lossy``) block-wise to
``lossy_bits`` integers; see :func:`decode_chunk` for the error bound it keeps.

Each :class:`ChunkInfo` says how its chunk was encoded (``codec``), so a chunk is
decoded without the config that made it. Codec strings are ``+``-joined tokens:

* lossless: ``[xor|sub+](raw | zstd<L>[+shuffle|+bitshuffle] | lz4-<L>[+...])``,
  e.g. ``"zstd1+shuffle"``, ``"xor+zstd1+shuffle"``, ``"raw"``; a delta token
  is present exactly when ``delta`` is true;
* lossy: ``q<bits>[sqrt]-<dtype>+(zstd<L> | lz4-<L> | raw)``, e.g.
  ``"q8-float32+zstd1"``, ``"q4sqrt-bfloat16+zstd1"``.

Threading: an :class:`Encoder` may be used by one thread at a time (it owns a
thread pool); :func:`decode_chunk`, :func:`decode` and :func:`checksum` are
thread-safe. C-Blosc2 is told to release the GIL during (de)compression
(``blosc2.set_releasegil(True)``, a process-wide switch set on first use), which
is what lets the thread pool scale.

Modules: :mod:`~nonstop.snapshot.codec.format` (the chunk format: value types, codec
strings, checksums, segment layout), :mod:`~nonstop.snapshot.codec.lossless` (delta
transforms, C-Blosc2), :mod:`~nonstop.snapshot.codec.lossy` (quantisation) and
:mod:`~nonstop.snapshot.codec.pipeline` (:class:`Encoder`, :func:`decode_chunk`,
:func:`decode`, :func:`check_sizes`). Import from this package; the modules are its internals.
"""

from nonstop.snapshot.codec.format import (
    LOSSY_BLOCK,
    LOSSY_DTYPES,
    LOSSY_KINDS,
    LOSSY_MIN_ELEMS,
    Buffer,
    ChunkInfo,
    CodecConfig,
    Segment,
    checksum,
    element_size,
    segments_for,
)
from nonstop.snapshot.codec.lossless import preload
from nonstop.snapshot.codec.pipeline import Encoder, check_chunks, check_sizes, decode, decode_chunk

__all__ = [
    "LOSSY_BLOCK",
    "LOSSY_DTYPES",
    "LOSSY_KINDS",
    "LOSSY_MIN_ELEMS",
    "Buffer",
    "ChunkInfo",
    "CodecConfig",
    "Encoder",
    "Segment",
    "check_chunks",
    "check_sizes",
    "checksum",
    "decode",
    "decode_chunk",
    "element_size",
    "preload",
    "segments_for",
]
