"""A data-parallel job's replicated state is persisted once per checkpoint, not once per rank
(shared chunks, format version 2), and stays exact when ranks differ; old checkpoints still load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from nonstop.errors import SnapshotCorruptError
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import MANIFEST, DurableStore, rank_file, step_dir
from nonstop.snapshot.durable.format import decode_manifest, encode_manifest
from nonstop.snapshot.store import decode_raw
from tests.persisting import Persisting, state_of, trained

WORLD = 3


def _bin_sizes(root: Path, step: int) -> list[int]:
    return [os.path.getsize(root / step_dir(step) / rank_file(r)) for r in range(WORLD)]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "dtype") and hasattr(a, "tolist"):  # a numpy array (RNG keys)
        return bool((a == b).all())
    return bool(a == b)


def _check_exact(root: Path, step: int, states: list[Any]) -> None:
    """Every rank of checkpoint ``step`` decodes to its own state, bit for bit, loaded whole and
    rank by rank (a single rank's load reads the lower rank's file it shares chunks of)."""
    store = DurableStore(root)
    whole = store.load(step)
    for r, st in enumerate(states):
        assert _equal(decode_raw(whole.meta(r), whole.data(r)), st)
        assert _equal(decode_raw(*store.load_rank(step, r)), st)
    assert store.verify(step) == []


@pytest.fixture
def job(tmp_path: Path) -> Any:
    p = Persisting(tmp_path, tmp_path / "ckpt", WORLD, CodecConfig(full_every=3))
    yield p
    p.close()


def test_replicated_ranks_are_stored_once_and_read_back_exact(tmp_path: Path, job: Persisting) -> None:
    root = tmp_path / "ckpt"
    model, opt = trained()
    states = [state_of(model, opt, 1, {"pos": 7}) for _ in range(WORLD)]
    res = job.persist(1, states)
    sizes = _bin_sizes(root, 1)
    assert sizes[1] == sizes[2] == 0 and sizes[0] == res.stored_bytes  # identical ranks: rank 0's file only
    _check_exact(root, 1, states)
    man = json.loads((root / step_dir(1) / MANIFEST).read_text())
    assert man["version"] == 2 and all(c.get("in") == 0 for c in man["ranks"][2]["chunks"])


def test_ranks_that_differ_keep_their_own_bytes_and_share_the_rest(tmp_path: Path, job: Persisting) -> None:
    """Per-rank extras and RNG, and a rank whose weights diverged: each loads back as its own."""
    root = tmp_path / "ckpt"
    model, opt = trained()
    other, other_opt = trained(seed=5)
    torch.manual_seed(11)
    states = [state_of(model, opt, 4, {"pos": 0, "buf": torch.arange(4)})]
    torch.manual_seed(12)  # rank 1: another RNG state, other extras, the same model
    states.append(state_of(model, opt, 4, {"pos": 1, "buf": torch.arange(4) + 1}))
    states.append(state_of(other, other_opt, 4, {"pos": 2, "buf": torch.arange(4) + 2}))  # diverged
    res = job.persist(4, states)
    sizes = _bin_sizes(root, 4)
    assert 0 < sizes[1] < sizes[0] // 4  # only the chunks holding its RNG and extras
    assert sizes[2] > sizes[0] // 2  # nothing of rank 2's model is rank 0's
    assert res.stored_bytes == sum(sizes)
    _check_exact(root, 4, states)


def test_deltas_are_shared_too_and_every_step_reads_back_exact(tmp_path: Path, job: Persisting) -> None:
    root = tmp_path / "ckpt"
    model, opt = trained()
    written: dict[int, list[Any]] = {}
    for step in (1, 2, 3, 4):  # full_every=3: a full base, two deltas over it, a full again
        model, opt = trained(steps=step)
        states = [state_of(model, opt, step, {"pos": step}) for _ in range(WORLD)]
        written[step] = states
        res = job.persist(step, states)
        assert _bin_sizes(root, step)[1:] == [0, 0], step
        assert res.full == (step in (1, 4))
    for step, states in written.items():
        _check_exact(root, step, states)


def test_a_corrupt_shared_chunk_fails_every_rank_using_it_and_load_falls_back(
    tmp_path: Path, job: Persisting
) -> None:
    root = tmp_path / "ckpt"
    model, opt = trained()
    job.persist(1, [state_of(model, opt, 1, {}) for _ in range(WORLD)])
    model, opt = trained(steps=2)
    job.persist(2, [state_of(model, opt, 2, {}) for _ in range(WORLD)])
    victim = root / step_dir(2) / rank_file(0)  # holds every rank's chunks
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    store = DurableStore(root)
    problems = store.verify(2)
    assert len(problems) == WORLD and all("crc" in p.lower() or "checksum" in p.lower() for p in problems)
    with pytest.raises(SnapshotCorruptError, match="rank 2"):
        store.load_rank(2, 2)
    assert store.load().step == 1  # the resume path skips it for the older good one
    victim.write_bytes(bytes(raw[: len(raw) // 3]))  # truncated: named as rank 0's file
    with pytest.raises(SnapshotCorruptError, match="rank 0's file"):
        store.load_rank(2, 1)


def _snaps(tmp: Path, states: list[Any]) -> list[Any]:
    """Each state snapshotted in its rank's slots and copied out (what a persister encodes)."""
    job = Persisting(tmp, tmp / "unused", len(states))
    try:
        for store, st in zip(job.stores, states, strict=True):
            store.write(1, st)
        return [s.copy_out(1) for s in job.stores]
    finally:
        job.close()


def test_a_version_1_checkpoint_still_loads_and_cannot_share(tmp_path: Path) -> None:
    """A checkpoint as nonstop wrote it before shared chunks: every rank's chunks encoded into its
    own file, manifest version 1."""
    from nonstop.snapshot.codec import Encoder, segments_for

    root = tmp_path / "ckpt"
    model, opt = trained()
    states = [state_of(model, opt, 1, {"pos": r}) for r in range(WORLD)]
    writer = DurableStore(root).begin(1, WORLD, "zstd")
    with Encoder(CodecConfig()) as enc:
        for snap in _snaps(tmp_path, states):
            chunks = enc.encode(snap.data, segments_for(snap.entries(), len(snap.data)))
            writer.add_rank(snap.rank, snap.meta, len(snap.data), chunks, None)
    writer.commit()
    path = root / step_dir(1) / MANIFEST
    m = decode_manifest(path.read_bytes(), "test")
    path.write_bytes(encode_manifest(m.step, m.world_size, m.created_at, m.codec, m.ranks, version=1))
    assert json.loads(path.read_text())["version"] == 1
    _check_exact(root, 1, states)
    # a version 1 manifest that names a shared chunk is not one a writer produced
    doc = json.loads(path.read_text())
    doc["ranks"][1]["chunks"][0]["in"] = 0
    with pytest.raises(SnapshotCorruptError):
        decode_manifest((json.dumps(doc, separators=(",", ":")) + "\n").encode(), "test")


def test_a_contributed_rank_that_shares_a_chunk_its_owner_lacks_is_refused(tmp_path: Path) -> None:
    """Nodes write their own ranks (persist rounds): the owner re-validates shared chunks."""
    from nonstop.snapshot.persist import RankEncoder

    root = tmp_path / "ckpt"
    model, opt = trained()
    snaps = _snaps(tmp_path, [state_of(model, opt, 1, {}) for _ in range(2)])
    owner = DurableStore(root)
    enc = RankEncoder(CodecConfig())
    try:
        for step in (1, 2):  # step 1 full, step 2 a delta over it: both shared
            writer = owner.begin(step, 2, "zstd")
            part = owner.contribute(step, 2, "zstd")
            enc.write(part, snaps)
            records = [part.record(0), part.record(1)]
            assert all("in" in c for c in records[1]["chunks"])
            if step == 2:  # a shared chunk at an offset of rank 0's file that holds no such chunk
                records[1]["chunks"][0]["file_offset"] += 1
            for rec in records:
                writer.adopt(rec)
            if step == 2:
                with pytest.raises(SnapshotCorruptError, match="shared chunk"):
                    writer.commit()
                writer.abort()
            else:
                writer.commit()
    finally:
        enc.close()
    assert owner.steps() == [1]
    assert [bytes(owner.load(1).data(r)) for r in range(2)] == [bytes(s.data) for s in snaps]


def test_ranks_with_nothing_in_common_share_nothing(tmp_path: Path) -> None:
    """As each rank of a sharded job holds its own shards: every rank's model and optimizer are
    its own chunks (at most a chunk of equal small values, e.g. the step counts, is shared)."""
    job = Persisting(tmp_path, tmp_path / "ckpt", 2)
    try:
        states = []
        for r in range(2):
            model, opt = trained(seed=10 + r)
            states.append(state_of(model, opt, 1, {"rank": r}))
        job.persist(1, states)
    finally:
        job.close()
    sizes = [os.path.getsize(tmp_path / "ckpt" / step_dir(1) / rank_file(r)) for r in range(2)]
    assert sizes[1] > sizes[0] * 0.9
    loaded = DurableStore(tmp_path / "ckpt").load(1)
    for r, st in enumerate(states):
        assert _equal(decode_raw(loaded.meta(r), loaded.data(r)), st)
