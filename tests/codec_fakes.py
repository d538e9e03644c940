"""Codec test helpers: tensors laid out as RankSnapshotStore lays them out (64-byte aligned), and an
encode-then-decode round trip through the real codec."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from nonstop.snapshot.api import ALIGN, TensorEntry
from nonstop.snapshot.codec import (
    ChunkInfo,
    CodecConfig,
    Encoder,
    Segment,
    decode,
)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(tensors: list[torch.Tensor]) -> tuple[list[TensorEntry], np.ndarray[Any, Any]]:
    """Entries and data buffer laid out like RankSnapshotStore (64-byte aligned offsets)."""
    entries, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        entries.append(
            TensorEntry(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), offset=off, nbytes=n)
        )
        off = align(off + n)
    data_len = entries[-1].offset + entries[-1].nbytes if entries else 0
    buf = np.zeros(data_len, np.uint8)
    for e, t in zip(entries, tensors, strict=True):
        buf[e.offset : e.offset + e.nbytes] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return entries, buf


def roundtrip(
    cfg: CodecConfig, raw: Any, segs: list[Segment], base: Any = None, threads: int = 1
) -> tuple[list[tuple[ChunkInfo, bytes]], np.ndarray[Any, Any]]:
    with Encoder(cfg) as enc:
        chunks = enc.encode(raw, segs, base)
    out = np.full(len(raw_bytes(raw)), 0xAB, np.uint8)
    decode(chunks, out, base, threads=threads)
    return chunks, out


def raw_bytes(raw: Any) -> bytes:
    return raw.tobytes() if isinstance(raw, np.ndarray) else bytes(raw)
