"""What ``bench_fuzz.py`` feeds the decoders: valid samples of every format nonstop decodes
(codec chunks and encodings, snapshot metas, DTensor nodes) and the mutations made of them (bytes
flipped, cut, spliced; JSON fields replaced by nasty values, re-signed where a MAC guards them)."""

from __future__ import annotations

import copy
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.codec import (
    ChunkInfo,
    CodecConfig,
    Encoder,
    Segment,
    decode,
    segments_for,
)
from nonstop.snapshot.flatten import flatten_state

NASTY_INTS = [0, 1, -1, 7, 63, 64, 255, 4095, 4096, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**60]
NASTY_INTS += [2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -(2**63)]
WORDS = [x for x in NASTY_INTS if 0 <= x < 2**64]


def nasty_value(rng: random.Random) -> Any:
    pick = rng.randrange(12)
    if pick < 5:
        return rng.choice(NASTY_INTS)
    if pick == 5:
        return rng.choice([None, True, False, 0.5, -1.5, 1e308, -0.0])
    if pick == 6:
        return rng.choice(["", "x", "\ud800", "Shard(dim=-1)", "zstd1+shuffle", "q8-float32+raw"])
    if pick == 7:
        return [] if rng.random() < 0.5 else {}
    if pick == 8:
        deep: Any = []
        for _ in range(rng.choice([8, 100, 400])):  # deeper: see mutate_bytes (json.dumps recurses)
            deep = [deep]
        return deep
    if pick == 9:
        return [rng.choice(NASTY_INTS) for _ in range(rng.randrange(5))]
    if pick == 10:
        return {"__t__": rng.choice([0, -1, 10**9])}
    return "y" * rng.choice([1, 1000, 100_000])


# ---------------------------------------------------------------------------- mutations
def mutate_bytes(b: bytes, rng: random.Random) -> bytes:
    """``b`` with 1-4 byte-level mutations (or, rarely, replaced by random bytes)."""
    if rng.random() < 0.05:
        return rng.randbytes(rng.randrange(0, 2 * len(b) + 16))
    out = bytearray(b)
    for _ in range(rng.randint(1, 4)):
        n = len(out)
        kind = rng.randrange(9)
        if kind <= 2 and n:  # bit flips, the most common corruption
            for _ in range(rng.randint(1, 8)):
                out[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif kind == 3:
            del out[rng.randint(0, n) :]
        elif kind == 4:
            pos = rng.randint(0, n)
            end = min(n, pos + rng.randrange(32))
            out[pos:end] = rng.randbytes(rng.randrange(32))
        elif kind == 5 and n:
            size = rng.choice([1, 2, 4, 8])
            if n >= size:
                pos = rng.randrange(n - size + 1)
                word = rng.choice(WORDS) & ((1 << (8 * size)) - 1)
                out[pos : pos + size] = word.to_bytes(size, "little")
        elif kind == 6 and n:
            pos = rng.randrange(n)
            end = min(n, pos + rng.randrange(1, 64))
            out[pos:pos] = out[pos:end]  # duplicate a range
        elif kind == 7 and n:
            pos = rng.randrange(n)
            end = min(n, pos + rng.randrange(1, 64))
            out[pos:end] = bytes([rng.choice([0, 0xFF])]) * (end - pos)
        elif kind == 8 and rng.random() < 0.1:  # nesting deeper than any parser's recursion limit
            pos = rng.randint(0, n)
            out[pos:pos] = rng.choice([b"[", b'{"a":']) * rng.choice([1000, 100_000])
        else:
            out += rng.randbytes(rng.randrange(1, 64))
    return bytes(out)


def _paths(obj: Any, prefix: tuple[Any, ...], out: list[tuple[Any, ...]]) -> None:
    out.append(prefix)
    if len(prefix) >= 16:  # not into a deeply nested value an earlier mutation put there
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _paths(v, (*prefix, k), out)
    elif isinstance(obj, list) and len(obj) < 64:
        for i, v in enumerate(obj):
            _paths(v, (*prefix, i), out)


def mutate_json(doc: Any, rng: random.Random) -> Any:
    """A copy of ``doc`` (shallow enough to deep-copy) with 1-3 values replaced by nasty ones,
    nudged (an int +-1/8/64/2**40) or removed."""
    doc = copy.deepcopy(doc)
    for _ in range(rng.randint(1, 3)):
        paths: list[tuple[Any, ...]] = []
        _paths(doc, (), paths)
        path = rng.choice(paths)
        if not path:
            doc = nasty_value(rng)
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        old = parent[path[-1]]
        kind = rng.randrange(4)
        if kind == 0:
            del parent[path[-1]]
        elif kind == 1 and isinstance(old, int) and not isinstance(old, bool):
            parent[path[-1]] = old + rng.choice([-64, -8, -1, 1, 8, 64, 2**40])
        else:
            parent[path[-1]] = nasty_value(rng)
    return doc


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def json_bytes(doc: Any) -> bytes:
    return json.dumps(doc).encode("utf-8", "surrogatepass")


def resigned(doc: Any) -> bytes:
    """Manifest bytes of ``doc`` with a matching manifest_crc (when it is an object)."""
    if isinstance(doc, dict):
        body = {k: v for k, v in doc.items() if k != "manifest_crc"}
        try:
            return canonical({**body, "manifest_crc": zlib.crc32(canonical(body))}) + b"\n"
        except (ValueError, TypeError, RecursionError):
            pass
    try:
        return json_bytes(doc)
    except RecursionError:
        return b"[" * 10_000


# ---------------------------------------------------------------------------- valid samples
def floats(n_bytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(n_bytes // 4).astype(np.float32).tobytes()


RAW = floats(12_288, 1)
BASE = (np.frombuffer(RAW, np.float32) + np.float32(1e-3)).tobytes()
ENTRIES = [TensorEntry(dtype="float32", shape=(len(RAW) // 4,), offset=0, nbytes=len(RAW))]


def _encode(cfg: CodecConfig, base: bytes | None, lossy: bool = False) -> list[tuple[ChunkInfo, bytes]]:
    segs = (
        [Segment(offset=0, length=len(RAW), typesize=4, lossy="linear", dtype="float32")]
        if lossy
        else segments_for(ENTRIES, len(RAW))
    )
    with Encoder(cfg) as enc:
        return [(info, bytes(p)) for info, p in enc.encode(RAW, segs, base)]


@dataclass
class Encoding:
    chunks: list[tuple[ChunkInfo, bytes]]
    base: bytes | None
    expected: bytes = b""

    def __post_init__(self) -> None:
        out = bytearray(len(RAW))
        decode(self.chunks, out, self.base)
        self.expected = bytes(out)


def encodings() -> dict[str, Encoding]:
    small = 4096
    return {
        "zstd+shuffle": Encoding(_encode(CodecConfig(chunk_bytes=small), None), None),
        "lz4+bitshuffle": Encoding(
            _encode(CodecConfig(codec="lz4", shuffle="bit", chunk_bytes=small), None), None
        ),
        "raw": Encoding(_encode(CodecConfig(codec="none", chunk_bytes=small), None), None),
        "sub-delta": Encoding(_encode(CodecConfig(chunk_bytes=small), BASE), BASE),
        "xor-delta": Encoding(_encode(CodecConfig(delta="xor", chunk_bytes=small), BASE), BASE),
        "lossy-q8": Encoding(_encode(CodecConfig(lossy=True, chunk_bytes=small), None, True), None),
        "lossy-q4-delta": Encoding(
            _encode(CodecConfig(lossy=True, lossy_bits=4, chunk_bytes=small), BASE, True), BASE
        ),
    }


def snapshot_meta() -> tuple[bytes, bytes]:
    state = {
        "model": {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [(1, "a")]},
        "np": np.arange(4, dtype=np.int64),
    }
    tree, tensors = flatten_state(state)
    entries, parts, off = [], [], 0
    for t in tensors:
        b = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        pad = (-off) % 64
        parts.append(b"\0" * pad + b)
        off += pad
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(TensorEntry(dtype=dtype, shape=tuple(t.shape), offset=off, nbytes=len(b)))
        off += len(b)
    return canonical({"tree": tree, "tensors": [e.to_json() for e in entries]}), b"".join(parts)


DT_NODE = {
    "__dt__": 0,
    "shape": [4, 2],
    "stride": [2, 1],
    "offset": [2, 0],
    "placements": ["Shard(dim=0)"],
    "mesh": [2],
    "dims": ["shard"],
}
