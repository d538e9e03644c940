"""The durable tier's on-disk format: the spec, the names of its files, the manifest and rank
records (plain values), and the manifest's encoding, decoding and validation.

On-disk format, version 2 (nothing is pickled; every file is raw bytes or JSON)::

    <root>/
      latest                        "step-000000000120\\n": the committed checkpoint. Written LAST.
      step-000000000120/
        rank-00000.bin              rank 0's encoded chunks, concatenated in manifest order
        rank-00001.bin
        ...
        manifest.json               written once every rank's .bin is durable

``manifest.json`` is one line of canonical JSON (keys in the order below, separators
``,`` and ``:``, ASCII only) followed by ``\\n``::

    {"format": "nonstop-checkpoint", "version": 2, "step": 120, "world_size": 2,
     "created_at": 1767225600.5, "codec": "<CodecConfig.describe()>",
     "ranks": [{"rank": 0, "data_len": N, "meta": "<the rank's meta JSON, as a string>",
                "meta_crc": C, "base_step": null | 110, "file": "rank-00000.bin",
                "file_len": L, "chunks": [{<ChunkInfo.to_json()>, "file_offset": O}, ...]},
               ...],
     "manifest_crc": M}

``manifest_crc`` is the zlib CRC-32 of the canonical JSON of the document without that last
key. A reader re-serialises what it parsed and requires the file to be byte-identical to
it and the CRC to match, so a change of any byte of the manifest is detected. Each chunk
carries the CRC of its stored payload and of its decoded bytes; chunks tile the ``.bin``
file exactly (``file_offset`` ascending, no gaps, ``file_len`` in total).

**Shared chunks** (version 2): a chunk entry with ``"in": R`` (a lower rank of the same
checkpoint) has its payload in rank R's file at ``file_offset``, where rank R's own entry lists
the identical chunk (same info, same offset). It decodes exactly like one of the rank's own
chunks (a delta against the rank's own base). A writer shares a chunk only when the rank's own
encoding of it would have been that payload byte for byte: the same data bytes, and for a delta
the same base bytes (:class:`~nonstop.snapshot.persist.RankEncoder`). So a data-parallel job's
replicated model and optimizer are stored once per checkpoint (in the lowest rank's file), while
what differs between ranks (RNG, extras, a diverged rank, every shard of a sharded job) is each
rank's own. Shared chunks are left out of the tiling of the rank's own file; a bad shared
payload fails its checksums for every rank that uses it. Version 1 (no shared chunks) is still
read.

A rank's checkpoint is either FULL (``base_step`` null) or a DELTA whose delta chunks apply
to the same rank of checkpoint ``base_step``. Chains have depth 1: the writer accepts a
delta only against a committed FULL checkpoint of that rank with the identical tensor layout
(same ``data_len`` and ``meta["tensors"]``); retention never deletes a base that a retained
checkpoint needs.

Commit protocol (one writer per root at a time): every ``.bin`` is written and made durable
(local disks: a temporary name, fsync, rename, fsync of the directory; object stores publish
an object whole when its upload completes; on other fsspec file systems an object being
written may be visible early, which the checksums and the write order make harmless);
then ``manifest.json``, whose presence marks the step committed; then ``latest``; then
retention removes checkpoints that
are neither among the ``keep`` newest (up to the one just committed) nor a base of one of
them, abandoned step directories (no manifest at two looks), checkpoints newer than the
one just committed only when the writer resumed away from them (a superseded timeline:
``Catalog.resumed_from``), and leftover temporary files; a step whose manifest cannot be
read keeps itself and everything older for that pass. A crash at any point leaves the
previously committed checkpoint loadable:
``latest`` changes only by an atomic replace once the new checkpoint is complete, and
nothing ``latest`` depends on is removed before ``latest`` moves.

Loading with ``step=None`` starts at the step ``latest`` names (or, when ``latest`` is
missing or unreadable, the newest step with a manifest) and falls back to older committed
steps, logging one warning line per unusable checkpoint on the ``nonstop.durable`` logger.

Contract of this module: pure functions and immutable values, no I/O, safe from any thread.
:func:`decode_manifest` accepts exactly the bytes :func:`encode_manifest` produces for a
valid checkpoint and raises :class:`~nonstop.errors.SnapshotCorruptError` (one line, naming
where) for anything else.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nonstop.errors import SnapshotCorruptError
from nonstop.snapshot.codec import ChunkInfo

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LATEST",
    "LATEST_RE",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "READ_VERSIONS",
    "TMP_MARK",
    "Manifest",
    "ManifestError",
    "RankRecord",
    "check_coverage",
    "check_shared",
    "decode_manifest",
    "encode_manifest",
    "layout_of",
    "one_line",
    "parse_step_dir",
    "rank_doc",
    "rank_file",
    "rank_from_doc",
    "step_dir",
]

FORMAT_NAME = "nonstop-checkpoint"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # what a reader accepts; writers write FORMAT_VERSION
SHARED_KEY = "in"  # a chunk entry's owner rank, when its payload is in another rank's file
LATEST = "latest"
MANIFEST = "manifest.json"
TMP_MARK = ".tmp-"  # in the name of every object being written (never in a committed file's name)
LATEST_RE = re.compile(r"^(step-\d{12,})\n?$")
MAX_MANIFEST_BYTES = 1 << 30
"""Largest manifest a reader parses (about 150 bytes per chunk: 7M chunks, 28 TB in 4 MiB chunks)."""
_STEP_RE = re.compile(r"^step-(\d{12,})$")


def step_dir(step: int) -> str:
    """Name of the directory of checkpoint ``step``."""
    return f"step-{step:012d}"


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s chunk file inside a step directory."""
    return f"rank-{rank:05d}.bin"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory's name; None when ``name`` is not one."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines included) as one space: error
    messages that quote stored or foreign text stay one line."""
    return " ".join(str(text).split())


def layout_of(meta: bytes) -> Any:
    """The part of a meta that defines the data layout (``tensors``); None when absent or when
    the meta does not parse (whatever its bytes: never raises)."""
    try:
        obj = json.loads(meta)
    except (ValueError, RecursionError, MemoryError):  # UnicodeDecodeError is a ValueError
        return None
    return obj.get("tensors") if isinstance(obj, dict) else None


# ---------------------------------------------------------------------------- records
@dataclass(frozen=True)
class RankRecord:
    """One rank's entry of a manifest: where its chunks are and what they decode to."""

    rank: int
    data_len: int
    meta: bytes
    meta_crc: int
    base_step: int | None
    file: str
    file_len: int
    chunks: tuple[tuple[ChunkInfo, int], ...]  # (info, offset in its owner's file), data order
    owners: tuple[int, ...] = ()  # the rank whose file holds each chunk (empty: all this rank's)

    def owner(self, i: int) -> int:
        """The rank whose file holds chunk ``i``'s payload."""
        return self.owners[i] if self.owners else self.rank


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint's manifest, decoded and validated."""

    step: int
    world_size: int
    created_at: float
    codec: str
    ranks: tuple[RankRecord, ...]
    version: int = FORMAT_VERSION


class ManifestError(Exception):
    """A manifest field (or a rank entry given to a writer) is malformed. Never escapes the
    durable tier: readers turn it into SnapshotCorruptError, writers into ValueError."""


# ---------------------------------------------------------------------------- encoding
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def rank_doc(r: RankRecord) -> dict[str, Any]:
    """A rank's manifest entry (plain JSON types)."""
    return {
        "rank": r.rank,
        "data_len": r.data_len,
        "meta": r.meta.decode("utf-8"),
        "meta_crc": r.meta_crc,
        "base_step": r.base_step,
        "file": r.file,
        "file_len": r.file_len,
        "chunks": [
            {
                **info.to_json(),
                "file_offset": off,
                **({SHARED_KEY: r.owner(i)} if r.owner(i) != r.rank else {}),
            }
            for i, (info, off) in enumerate(r.chunks)
        ],
    }


def encode_manifest(
    step: int,
    world_size: int,
    created_at: float,
    codec: str,
    ranks: Sequence[RankRecord],
    version: int = FORMAT_VERSION,
) -> bytes:
    """The bytes of ``manifest.json`` (see the module doc); ``version`` only to re-encode an
    older checkpoint's manifest (a version 1 manifest has no shared chunks)."""
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": version,
        "step": step,
        "world_size": world_size,
        "created_at": created_at,
        "codec": codec,
        "ranks": [rank_doc(r) for r in ranks],
    }
    crc = zlib.crc32(_canonical(body))
    return _canonical({**body, "manifest_crc": crc}) + b"\n"


# ---------------------------------------------------------------------------- decoding
def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ManifestError(f"field {key!r} is missing")
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise ManifestError(f"field {key!r} has the wrong type")
    return v


def _nonneg(d: dict[str, Any], key: str) -> int:
    v: int = _get(d, key, int)
    if v < 0:
        raise ManifestError(f"field {key!r} is negative")
    return v


def decode_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate the bytes of a ``manifest.json``; ``where`` names it in errors.
    SnapshotCorruptError unless ``raw`` is byte-identical to a valid manifest's encoding: for
    any bytes (more than :data:`MAX_MANIFEST_BYTES`, nested too deeply, too large to parse).
    Every size in a manifest that it returns is consistent: the chunks tile the file and the
    data, and each chunk's sizes agree with its codec (a raw payload is as long as what it
    decodes to; no chunk decodes to more than 1 GiB). A reader still checks them against the
    files (:func:`~nonstop.snapshot.codec.check_chunks`) before it allocates ``data_len``."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise SnapshotCorruptError(
            f"{where}: manifest is {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} a valid one has"
        )
    try:
        return _decode_manifest(raw, where)
    except SnapshotCorruptError:
        raise
    except (RecursionError, MemoryError) as e:
        raise SnapshotCorruptError(f"{where}: manifest cannot be parsed ({type(e).__name__})") from None


def _decode_manifest(raw: bytes, where: str) -> Manifest:
    try:
        doc = json.loads(raw)
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise SnapshotCorruptError(f"{where}: manifest is not valid JSON (truncated or corrupt)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SnapshotCorruptError(f"{where}: not a {FORMAT_NAME} manifest")
    version = doc.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise SnapshotCorruptError(
            f"{where}: manifest format version {ascii(version)[:40]}, "
            f"this nonstop reads versions {', '.join(map(str, READ_VERSIONS))}"
        )
    try:
        canonical = _canonical(doc) + b"\n"
    except ValueError:
        canonical = b""
    crc = doc.pop("manifest_crc", None)
    if raw != canonical or not isinstance(crc, int) or crc != zlib.crc32(_canonical(doc)):
        raise SnapshotCorruptError(f"{where}: manifest fails its checksum (manifest_crc)")
    try:
        m = _manifest_from_doc(doc)
        again = encode_manifest(m.step, m.world_size, m.created_at, m.codec, m.ranks, m.version)
    except (ManifestError, SnapshotCorruptError, ValueError, TypeError, KeyError, OverflowError) as e:
        raise SnapshotCorruptError(f"{where}: manifest: {one_line(e)}") from None
    if again != raw:  # a key missing, one too many, or a value of another spelling (5 for 5.0)
        raise SnapshotCorruptError(f"{where}: manifest: its fields are not those of a valid manifest")
    return m


def _manifest_from_doc(doc: dict[str, Any]) -> Manifest:
    version = _nonneg(doc, "version")
    step = _nonneg(doc, "step")
    world_size = _nonneg(doc, "world_size")
    created_at = float(_get(doc, "created_at", (int, float)))
    codec = _get(doc, "codec", str)
    ranks_raw = _get(doc, "ranks", list)
    if world_size < 1 or len(ranks_raw) != world_size:
        raise ManifestError(f"world_size {world_size} but {len(ranks_raw)} rank entries")
    ranks = []
    for i, rd in enumerate(ranks_raw):
        if not isinstance(rd, dict):
            raise ManifestError(f"rank entry {i} is not an object")
        try:
            ranks.append(rank_from_doc(rd, i, step, shared=version >= 2))
        except ManifestError as e:
            raise ManifestError(f"rank {i}: {e}") from None
    check_shared(ranks)
    return Manifest(
        step=step,
        world_size=world_size,
        created_at=created_at,
        codec=codec,
        ranks=tuple(ranks),
        version=version,
    )


def rank_from_doc(rd: dict[str, Any], i: int, step: int, *, shared: bool = True) -> RankRecord:
    """Validate rank ``i``'s entry of checkpoint ``step`` (see :func:`rank_doc`); ``shared``:
    whether its chunks may be in a lower rank's file (version 2; :func:`check_shared` checks
    those against the owner's entry). ManifestError (or SnapshotCorruptError from a chunk's own
    decoding) when malformed."""
    if _nonneg(rd, "rank") != i:
        raise ManifestError("entries are out of rank order")
    data_len = _nonneg(rd, "data_len")
    meta = _get(rd, "meta", str).encode("utf-8")
    meta_crc = _nonneg(rd, "meta_crc")
    base_step = rd.get("base_step")
    if base_step is not None and (not isinstance(base_step, int) or isinstance(base_step, bool)):
        raise ManifestError("field 'base_step' has the wrong type")
    if base_step is not None and not 0 <= base_step < step:
        raise ManifestError(f"base_step {base_step} is not an older step")
    file = _get(rd, "file", str)
    if file != rank_file(i):  # the only name a writer gives it (a long one failed the read: OSError)
        raise ManifestError(f"file {file[:80]!r} is not {rank_file(i)!r}")
    file_len = _nonneg(rd, "file_len")
    chunks = []
    owners = []
    pos = 0
    for cd in _get(rd, "chunks", list):
        if not isinstance(cd, dict):
            raise ManifestError("a chunk entry is not an object")
        cd = dict(cd)
        off = cd.pop("file_offset", None)
        owner = cd.pop(SHARED_KEY, i)
        info = ChunkInfo.from_json(cd)  # SnapshotCorruptError on bad input
        if owner != i:
            if not shared:
                raise ManifestError(f"a chunk entry has {SHARED_KEY!r}, which format version 1 has not")
            if not isinstance(owner, int) or isinstance(owner, bool) or not 0 <= owner < i:
                raise ManifestError(f"a shared chunk's owner {str(owner)[:40]} is not a lower rank")
            if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                raise ManifestError("a shared chunk's file_offset is not a non-negative int")
        elif off != pos:
            raise ManifestError("chunks do not tile the file")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > data_len:
            raise ManifestError(
                f"chunk [{info.offset}, +{info.length}) lies outside the data ({data_len} bytes)"
            )
        if info.delta and base_step is None:
            raise ManifestError("a delta chunk but no base_step")
        owners.append(owner)
        if owner == i:
            chunks.append((info, pos))
            pos += info.enc_len
        else:
            chunks.append((info, off))
    if [c.offset for c, _ in chunks] != sorted(c.offset for c, _ in chunks):
        raise ManifestError("chunks are not in data order")
    if pos != file_len:
        raise ManifestError(f"chunks cover {pos} bytes of the {file_len}-byte file")
    check_coverage([info for info, _ in chunks], data_len)
    return RankRecord(
        rank=i,
        data_len=data_len,
        meta=meta,
        meta_crc=meta_crc,
        base_step=base_step,
        file=file,
        file_len=file_len,
        chunks=tuple(chunks),
        owners=tuple(owners) if any(o != i for o in owners) else (),
    )


def check_shared(ranks: Sequence[RankRecord]) -> None:
    """Every shared chunk of ``ranks`` (indexed by rank) must be one its owner's file holds: the
    owner's own entry lists the identical chunk at that file offset (ManifestError otherwise)."""
    own: dict[int, set[tuple[ChunkInfo, int]]] = {}
    for r in ranks:
        if not r.owners:
            continue
        for i, (info, off) in enumerate(r.chunks):
            o = r.owner(i)
            if o == r.rank:
                continue
            if o >= len(ranks) or ranks[o].rank != o:
                raise ManifestError(
                    f"rank {r.rank}: a shared chunk's owner rank {o} is not in the checkpoint"
                )
            if o not in own:
                owner = ranks[o]
                own[o] = {c for k, c in enumerate(owner.chunks) if owner.owner(k) == o}
            if (info, off) not in own[o]:
                raise ManifestError(
                    f"rank {r.rank}: shared chunk at data offset {info.offset} is not rank {o}'s chunk "
                    f"at file offset {off}"
                )


def check_coverage(infos: Sequence[ChunkInfo], data_len: int) -> None:
    """The chunks' data ranges must not overlap and must cover ``[0, data_len)`` exactly
    (ManifestError otherwise)."""
    pos = 0
    for info in sorted(infos, key=lambda c: c.offset):
        if info.offset != pos:
            what = "overlap" if info.offset < pos else "leave a gap"
            raise ManifestError(f"chunks {what} at data offset {min(pos, info.offset)}")
        pos = info.offset + info.length
    if pos != data_len:
        raise ManifestError(f"chunks cover {pos} of {data_len} data bytes")
