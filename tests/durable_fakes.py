"""Durable-tier test helpers: rank snapshots shaped as RankSnapshotStore writes them, checkpoints
of them (full and delta) persisted through the real writer, and the checks the durable tests share."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nonstop.errors import UsageError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.codec import CodecConfig, Encoder, segments_for
from nonstop.snapshot.durable import (
    DurableStore,
)

REPO = Path(__file__).resolve().parent.parent
WORLD = 3
CHUNK = 16 << 10  # small chunks: every rank has several

RankData = tuple[bytes, bytearray, list[TensorEntry]]


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def make_rank(seed: int, *, sizes: tuple[int, ...] = (3000, 517, 9000, 1)) -> RankData:
    """A rank snapshot like RankSnapshotStore writes: float32 tensors at 64-byte aligned
    offsets (zero padding between them) and the JSON meta describing them."""
    rng = np.random.default_rng(seed)
    entries, off = [], 0
    for n in sizes:
        entries.append(TensorEntry(dtype="float32", shape=(n,), offset=off, nbytes=4 * n))
        off = _align(off + 4 * n)
    data_len = entries[-1].offset + entries[-1].nbytes
    data = bytearray(data_len)
    for e in entries:
        vals = rng.standard_normal(e.shape[0]).astype(np.float32)
        data[e.offset : e.offset + e.nbytes] = vals.tobytes()
    meta = {"tree": {"seed": seed, "name": f"rank-{seed}"}, "tensors": [e.to_json() for e in entries]}
    return json.dumps(meta, separators=(",", ":")).encode(), data, entries


def perturb(base: RankData, seed: int) -> RankData:
    """Same layout as ``base``, a few values changed (as after one optimizer step)."""
    meta_b, data_b, entries = base
    rng = np.random.default_rng(seed)
    data = bytearray(data_b)
    for e in entries:
        vals = np.frombuffer(bytes(data[e.offset : e.offset + e.nbytes]), dtype=np.float32).copy()
        idx = rng.integers(0, len(vals), size=max(1, len(vals) // 50))
        vals[idx] += np.float32(0.5)
        data[e.offset : e.offset + e.nbytes] = vals.tobytes()
    meta = json.loads(meta_b)
    meta["tree"]["seed"] = seed
    return json.dumps(meta, separators=(",", ":")).encode(), data, entries


def full_ckpt(step: int, world: int = WORLD) -> list[RankData]:
    return [make_rank(step * 100 + r) for r in range(world)]


def delta_ckpt(step: int, base: list[RankData]) -> list[RankData]:
    return [perturb(b, step * 100 + r) for r, b in enumerate(base)]


def persist(
    store: DurableStore,
    step: int,
    ranks: list[RankData],
    *,
    base: tuple[int, list[RankData]] | None = None,
    codec: str = "zstd",
) -> None:
    cfg = CodecConfig(codec=codec, chunk_bytes=CHUNK)
    writer = store.begin(step, len(ranks), cfg.describe())
    for r, (meta, data, entries) in enumerate(ranks):
        enc = Encoder(cfg)
        try:
            base_data = None if base is None else bytes(base[1][r][1])
            chunks = enc.encode(bytes(data), segments_for(entries, len(data)), base=base_data)
        finally:
            enc.close()
        written = writer.add_rank(r, meta, len(data), chunks, None if base is None else base[0])
        assert written == sum(len(p) for _, p in chunks)
    writer.commit()


def assert_loaded(store: DurableStore, step: int | None, expect_step: int, ranks: list[RankData]) -> None:
    ck = store.load(step)
    assert ck.step == expect_step
    assert ck.world_size == len(ranks)
    for r, (meta, data, _) in enumerate(ranks):
        assert ck.meta(r) == meta
        assert bytes(ck.data(r)) == bytes(data), f"rank {r} data differs"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "nonstop.durable" and r.levelno >= logging.WARNING
    ]


@contextlib.contextmanager
def misuse(match: str | None = None) -> Iterator[None]:
    """API misuse raises a plain ValueError: UsageError (a ValueError too) is reserved for
    what a person typed."""
    with pytest.raises(ValueError, match=match) as ei:
        yield
    assert not isinstance(ei.value, UsageError), repr(ei.value)


def flip_byte(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x5A
    path.write_bytes(bytes(raw))
