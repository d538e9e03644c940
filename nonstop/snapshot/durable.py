"""The durable tier: whole-job checkpoints (every rank of one step) on a local disk or any
fsspec URL, written atomically, checksummed end to end, retained, and loaded with fallback
to the next good checkpoint.

On-disk format, version 1 (nothing is pickled; every file is raw bytes or JSON)::

    <root>/
      latest                        "step-000000000120\\n": the committed checkpoint. Written LAST.
      step-000000000120/
        rank-00000.bin              rank 0's encoded chunks, concatenated in manifest order
        rank-00001.bin
        ...
        manifest.json               written once every rank's .bin is durable

``manifest.json`` is one line of canonical JSON (keys in the order below, separators
``,`` and ``:``, ASCII only) followed by ``\\n``::

    {"format": "nonstop-checkpoint", "version": 1, "step": 120, "world_size": 2,
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
them, abandoned (manifest-less) step directories, checkpoints newer than the one just
committed (a superseded timeline: training resumed from an older step), and leftover
temporary files. A crash at any point leaves the previously committed checkpoint loadable:
``latest`` changes only by an atomic replace once the new checkpoint is complete, and
nothing ``latest`` depends on is removed before ``latest`` moves.

Loading with ``step=None`` starts at the step ``latest`` names (or, when ``latest`` is
missing or unreadable, the newest step with a manifest) and falls back to older committed
steps, logging one warning line per unusable checkpoint on the ``nonstop.durable`` logger.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError, UsageError
from nonstop.snapshot import codec as _codec
from nonstop.snapshot.codec import Buffer, ChunkInfo

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointWriter",
    "DurableStore",
    "FsspecStorage",
    "LoadedCheckpoint",
    "LATEST",
    "MANIFEST",
    "LocalStorage",
    "Storage",
    "format_inspect",
    "open_storage",
    "rank_file",
    "step_dir",
]

log = logging.getLogger("nonstop.durable")

FORMAT_NAME = "nonstop-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d{12,})$")
_LATEST_RE = re.compile(r"^(step-\d{12,})\n?$")
_TMP_MARK = ".tmp-"
_MAX_IO = 1 << 30  # bytes per read/write syscall (Linux caps one call just under 2 GiB)
_STAGE = 8 << 20  # O_DIRECT staging buffer; also the throttle's granularity
_DIRECT_ALIGN = 4096  # O_DIRECT needs block-aligned sizes and offsets; 4 KiB suits every device

CrashHook = Callable[[str], None]


def step_dir(step: int) -> str:
    """Name of the directory of checkpoint ``step``."""
    return f"step-{step:012d}"


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s chunk file inside a step directory."""
    return f"rank-{rank:05d}.bin"


def _parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------- storage
@runtime_checkable
class Storage(Protocol):
    """Where checkpoints live. Paths are relative to ``url`` and use ``/``."""

    url: str

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        """Write the whole object ``path`` from ``chunks``; return its size. The object is
        durable when this returns and is never visible under ``path`` half-written."""
        ...

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``path`` (to its end when ``length`` is
        None; shorter when the object is). SnapshotMissingError if it does not exist."""
        ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path``, sorted; ``[]`` when it does not exist."""
        ...

    def remove_tree(self, path: str) -> None:
        """Remove the object or directory tree ``path``; no error when it does not exist."""
        ...

    def size(self, path: str) -> int:
        """Size of object ``path``; SnapshotMissingError if it does not exist."""
        ...


def _check_rel(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    if path.startswith("/") or any(p in (".", "..") for p in parts):
        raise SnapshotError(f"storage path {path!r} must be relative and stay below the root")
    return parts


def _byte_view(chunk: Buffer) -> memoryview:
    """The bytes of a C-contiguous buffer, without a copy."""
    mv = chunk.data if isinstance(chunk, np.ndarray) else memoryview(chunk)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _set_direct(fd: int, on: bool) -> bool:
    """Switch O_DIRECT on ``fd`` on or off; return whether it is on."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError:
        if on:
            return False
        raise
    return on


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage:
    """A directory on a local (or locally mounted) file system, through plain ``os`` calls.

    An object is written to a temporary name in its directory, fsynced, renamed over the
    final name, and the directory is fsynced. Where the file system supports it (Linux,
    ``direct=True``) the data is copied into reused, page-aligned staging buffers and
    written with ``O_DIRECT`` in large sequential writes, the copy of one buffer
    overlapping the write of the other: that runs at the device's sequential speed, needs
    no page-cache allocation (slow on some VMs), and does not evict the training job's page
    cache. Elsewhere large buffered writes straight from the caller's buffers.
    ``max_bytes_per_s`` caps the write rate (all writes of this instance together) so that
    persisting never starves the training job's I/O.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes_per_s: float | None = None,
        direct: bool = True,
    ) -> None:
        root_s = os.fspath(root)
        if not root_s:
            raise UsageError("checkpoint location is empty: pass a directory path or an fsspec URL")
        if os.path.exists(root_s) and not os.path.isdir(root_s):
            raise UsageError(f"checkpoint location {root_s} is a file, not a directory: pass a directory")
        if max_bytes_per_s is not None and not max_bytes_per_s > 0:
            raise UsageError(f"max_bytes_per_s must be > 0 (got {max_bytes_per_s!r}); omit it for no limit")
        self.url = root_s
        self.root = os.path.abspath(root_s)
        self.max_bytes_per_s = max_bytes_per_s
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._tb_lock = threading.Lock()
        self._tb_next = 0.0
        self._stage_lock = threading.Lock()
        self._stages: tuple[mmap.mmap, mmap.mmap] | None = None
        self._writer: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def _abs(self, path: str) -> str:
        return os.path.join(self.root, *_check_rel(path))

    def _makedirs(self, d: str) -> None:
        missing: list[str] = []
        while not os.path.isdir(d):
            missing.append(d)
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
        for m in reversed(missing):
            try:
                os.mkdir(m)
            except FileExistsError:
                pass
            _fsync_dir(os.path.dirname(m))  # make the new directory entry durable

    def _throttle(self, n: int) -> None:
        rate = self.max_bytes_per_s
        if rate is None:
            return
        with self._tb_lock:
            now = time.monotonic()
            self._tb_next = max(self._tb_next, now) + n / rate
            delay = self._tb_next - now
        if delay > 0:
            time.sleep(delay)

    def _write_all(self, fd: int, mv: memoryview) -> int:
        """Buffered write of all of ``mv`` (in throttle-sized pieces when throttled)."""
        piece = _STAGE if self.max_bytes_per_s is not None else _MAX_IO
        n, off = len(mv), 0
        while off < n:
            done = os.write(fd, mv[off : off + piece])
            if done <= 0:
                raise OSError(f"short write to {self.url}")
            off += done
            self._throttle(done)
        return n

    def _write_staged(self, fd: int, view: memoryview, direct: bool) -> bool:
        """Write an aligned staged block, with O_DIRECT while ``direct``; return whether
        O_DIRECT is still on (it is switched off where the file system refuses it)."""
        off = 0
        while off < len(view):
            try:
                done = os.write(fd, view[off:])
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    direct = _set_direct(fd, False)
                    continue
                raise
            if done <= 0:
                raise OSError(f"short write to {self.url}")
            off += done
            if off < len(view) and direct:  # a short direct write leaves us unaligned
                direct = _set_direct(fd, False)
        self._throttle(len(view))
        return direct

    def _write_direct(self, fd: int, chunks: Iterable[Buffer]) -> int:
        """Copy ``chunks`` into two alternating page-aligned staging buffers; while one is
        being filled, a helper thread writes the other with O_DIRECT (the copy overlaps
        the device write). The unaligned tail goes through the page cache."""
        with self._stage_lock:
            if self._stages is None:  # page-aligned and reused: no page faults after the first use
                self._stages = (mmap.mmap(-1, _STAGE), mmap.mmap(-1, _STAGE))
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="nonstop-durable-write")
            views = [memoryview(b) for b in self._stages]
            pending: Future[bool] | None = None
            try:
                direct = _set_direct(fd, True)
                cur, fill, total = 0, 0, 0
                for chunk in chunks:
                    mv = _byte_view(chunk)
                    pos, n = 0, len(mv)
                    while pos < n:
                        k = min(_STAGE - fill, n - pos)
                        views[cur][fill : fill + k] = mv[pos : pos + k]
                        fill += k
                        pos += k
                        if fill == _STAGE:
                            if pending is not None:
                                direct = pending.result()
                            pending = self._writer.submit(self._write_staged, fd, views[cur], direct)
                            cur, fill = 1 - cur, 0
                    total += n
                if pending is not None:
                    direct, pending = pending.result(), None
                aligned = fill // _DIRECT_ALIGN * _DIRECT_ALIGN
                if aligned:
                    direct = self._write_staged(fd, views[cur][:aligned], direct)
                if fill > aligned:
                    if direct:
                        direct = _set_direct(fd, False)
                    self._write_all(fd, views[cur][aligned:fill])
                return total
            finally:
                if pending is not None:  # never leave a write in flight on a buffer or fd we give up
                    wait([pending])
                for v in views:
                    v.release()

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        final = self._abs(path)
        parent = os.path.dirname(final)
        self._makedirs(parent)
        tmp = f"{final}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        total = 0
        try:
            if self.direct:
                total = self._write_direct(fd, chunks)
            else:
                for chunk in chunks:
                    total += self._write_all(fd, _byte_view(chunk))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(parent)
        return total

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        p = self._abs(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise SnapshotMissingError(f"{self.url}/{path} is a directory, not an object")
            end = st.st_size
            if length is not None:
                end = min(end, offset + length)
            want = max(0, end - offset)
            if want <= _MAX_IO:
                return os.pread(fd, want, offset)  # one read, no extra copy
            parts, pos = [], offset
            while pos < end:
                got = os.pread(fd, min(_MAX_IO, end - pos), pos)
                if not got:
                    break
                parts.append(got)
                pos += len(got)
            return b"".join(parts)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(self._abs(path))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_tree(self, path: str) -> None:
        p = self._abs(path)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass

    def size(self, path: str) -> int:
        try:
            return os.stat(self._abs(path)).st_size
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None


def _fsspec_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec.core
    except ImportError:
        raise UsageError(f"checkpoint URL {url} needs fsspec: pip install fsspec") from None
    protocol = url.split("://", 1)[0]
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ValueError as e:
        raise UsageError(f"checkpoint URL {url}: unknown protocol {protocol!r} ({_one_line(e)})") from None
    except ImportError as e:
        raise UsageError(f"checkpoint URL {url}: {_one_line(e)}") from None
    return fs, str(root).rstrip("/")


class FsspecStorage:
    """Any fsspec file system (``memory://``, ``s3://``, ``gs://``, ``file://``, ...).

    Object stores publish an object whole when its writer closes, so a reader never sees a
    partial object; on fsspec's local file system the object is written to a temporary name,
    fsynced and moved into place. A failed write is discarded, never published.
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        if "://" not in url:
            raise UsageError(f"FsspecStorage needs a URL with a protocol (got {url!r}); use LocalStorage")
        self.url = url.rstrip("/")
        self.fs, self.root = _fsspec_fs(url, storage_options)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._local = "file" in protocols or "local" in protocols

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _full(self, path: str) -> str:
        parts = _check_rel(path)
        return "/".join([self.root, *parts]) if parts else self.root

    def write(self, path: str, chunks: Iterable[Buffer]) -> int:
        full = self._full(path)
        parent = full.rsplit("/", 1)[0]
        target = f"{full}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}" if self._local else full
        if self._local:
            self.fs.makedirs(parent, exist_ok=True)
        f = self.fs.open(target, "wb")
        total = 0
        try:
            for chunk in chunks:
                mv = _byte_view(chunk)
                f.write(mv)
                total += len(mv)
            if self._local:
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            discard = getattr(f, "discard", None)
            try:
                if callable(discard):
                    discard()
                f.close()
            finally:
                if self.fs.exists(target):
                    self.fs.rm(target)
            raise
        f.close()
        if self._local:
            self.fs.mv(target, full)
            _fsync_dir(parent)
        return total

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self._full(path)
        end = None if length is None else offset + length
        try:
            return bytes(self.fs.cat_file(full, start=offset, end=end))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def listdir(self, path: str) -> list[str]:
        full = self._full(path)
        try:
            self.fs.invalidate_cache(full)
            entries = self.fs.ls(full, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != full}
        return sorted(n for n in names if n)

    def remove_tree(self, path: str) -> None:
        full = self._full(path)
        try:
            if self.fs.exists(full):
                self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._full(path)))
        except (FileNotFoundError, NotADirectoryError):
            raise SnapshotMissingError(f"{self.url}/{path} does not exist") from None


def open_storage(url: str | os.PathLike[str], **kw: Any) -> Storage:
    """Storage for ``url``: a plain path or ``file://`` URL gives :class:`LocalStorage`
    (keyword ``max_bytes_per_s``), any other fsspec protocol :class:`FsspecStorage` (keywords
    are fsspec storage options). UsageError for an empty location or unknown protocol."""
    s = os.fspath(url)
    if not isinstance(s, str) or not s.strip():
        raise UsageError("checkpoint location is empty: pass a directory path or an fsspec URL")
    if s.startswith("file://"):
        return LocalStorage(s[len("file://") :] or "/", **kw)
    if "://" not in s:
        return LocalStorage(s, **kw)
    protocol = s.split("://", 1)[0]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", protocol):
        raise UsageError(f"checkpoint URL {s}: malformed protocol {protocol!r}")
    return FsspecStorage(s, **kw)


# ---------------------------------------------------------------------------- manifest
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def _layout_of(meta: bytes) -> Any:
    """The part of a meta that defines the data layout (``tensors``); None when absent."""
    try:
        obj = json.loads(meta)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj.get("tensors") if isinstance(obj, dict) else None


@dataclass(frozen=True)
class _RankRecord:
    rank: int
    data_len: int
    meta: bytes
    meta_crc: int
    base_step: int | None
    file: str
    file_len: int
    chunks: tuple[tuple[ChunkInfo, int], ...]  # (info, offset in file)


@dataclass(frozen=True)
class _Manifest:
    step: int
    world_size: int
    created_at: float
    codec: str
    ranks: tuple[_RankRecord, ...]


def _rank_doc(r: _RankRecord) -> dict[str, Any]:
    """A rank's manifest entry (plain JSON types)."""
    return {
        "rank": r.rank,
        "data_len": r.data_len,
        "meta": r.meta.decode("utf-8"),
        "meta_crc": r.meta_crc,
        "base_step": r.base_step,
        "file": r.file,
        "file_len": r.file_len,
        "chunks": [{**info.to_json(), "file_offset": off} for info, off in r.chunks],
    }


def _encode_manifest(
    step: int, world_size: int, created_at: float, codec: str, ranks: Sequence[_RankRecord]
) -> bytes:
    body: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "created_at": created_at,
        "codec": codec,
        "ranks": [_rank_doc(r) for r in ranks],
    }
    crc = zlib.crc32(_canonical(body))
    return _canonical({**body, "manifest_crc": crc}) + b"\n"


class _Bad(Exception):
    """Internal: a manifest field is malformed."""


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise _Bad(f"field {key!r} is missing")
    v = d[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
        raise _Bad(f"field {key!r} has the wrong type")
    return v


def _nonneg(d: dict[str, Any], key: str) -> int:
    v: int = _get(d, key, int)
    if v < 0:
        raise _Bad(f"field {key!r} is negative")
    return v


def _decode_manifest(raw: bytes, where: str) -> _Manifest:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise SnapshotCorruptError(f"{where}: manifest is not valid JSON (truncated or corrupt)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise SnapshotCorruptError(f"{where}: not a {FORMAT_NAME} manifest")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise SnapshotCorruptError(
            f"{where}: manifest format version {version!r}, this nonstop reads version {FORMAT_VERSION}"
        )
    try:
        canonical = _canonical(doc) + b"\n"
    except ValueError:
        canonical = b""
    crc = doc.pop("manifest_crc", None)
    if raw != canonical or not isinstance(crc, int) or crc != zlib.crc32(_canonical(doc)):
        raise SnapshotCorruptError(f"{where}: manifest fails its checksum (manifest_crc)")
    try:
        return _manifest_from_doc(doc)
    except (_Bad, SnapshotCorruptError, ValueError, TypeError, KeyError) as e:
        raise SnapshotCorruptError(f"{where}: manifest: {_one_line(e)}") from None


def _manifest_from_doc(doc: dict[str, Any]) -> _Manifest:
    step = _nonneg(doc, "step")
    world_size = _nonneg(doc, "world_size")
    created_at = float(_get(doc, "created_at", (int, float)))
    codec = _get(doc, "codec", str)
    ranks_raw = _get(doc, "ranks", list)
    if world_size < 1 or len(ranks_raw) != world_size:
        raise _Bad(f"world_size {world_size} but {len(ranks_raw)} rank entries")
    ranks = []
    for i, rd in enumerate(ranks_raw):
        if not isinstance(rd, dict):
            raise _Bad(f"rank entry {i} is not an object")
        try:
            ranks.append(_rank_from_doc(rd, i, step))
        except _Bad as e:
            raise _Bad(f"rank {i}: {e}") from None
    return _Manifest(step=step, world_size=world_size, created_at=created_at, codec=codec, ranks=tuple(ranks))


def _rank_from_doc(rd: dict[str, Any], i: int, step: int) -> _RankRecord:
    if _nonneg(rd, "rank") != i:
        raise _Bad("entries are out of rank order")
    data_len = _nonneg(rd, "data_len")
    meta = _get(rd, "meta", str).encode("utf-8")
    meta_crc = _nonneg(rd, "meta_crc")
    base_step = rd.get("base_step")
    if base_step is not None and (not isinstance(base_step, int) or isinstance(base_step, bool)):
        raise _Bad("field 'base_step' has the wrong type")
    if base_step is not None and not 0 <= base_step < step:
        raise _Bad(f"base_step {base_step} is not an older step")
    file = _get(rd, "file", str)
    if not file or "/" in file or file in (".", "..") or _TMP_MARK in file:
        raise _Bad(f"bad file name {file!r}")
    file_len = _nonneg(rd, "file_len")
    chunks = []
    pos = 0
    for cd in _get(rd, "chunks", list):
        if not isinstance(cd, dict):
            raise _Bad("a chunk entry is not an object")
        cd = dict(cd)
        off = cd.pop("file_offset", None)
        info = ChunkInfo.from_json(cd)  # SnapshotCorruptError on bad input
        if off != pos:
            raise _Bad("chunks do not tile the file")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > data_len:
            raise _Bad(f"chunk [{info.offset}, +{info.length}) lies outside the data ({data_len} bytes)")
        if info.delta and base_step is None:
            raise _Bad("a delta chunk but no base_step")
        chunks.append((info, pos))
        pos += info.enc_len
    if pos != file_len:
        raise _Bad(f"chunks cover {pos} bytes of the {file_len}-byte file")
    _check_coverage([info for info, _ in chunks], data_len)
    return _RankRecord(
        rank=i,
        data_len=data_len,
        meta=meta,
        meta_crc=meta_crc,
        base_step=base_step,
        file=file,
        file_len=file_len,
        chunks=tuple(chunks),
    )


def _check_coverage(infos: Sequence[ChunkInfo], data_len: int) -> None:
    """The chunks' data ranges must not overlap and must cover ``[0, data_len)`` exactly."""
    pos = 0
    for info in sorted(infos, key=lambda c: c.offset):
        if info.offset != pos:
            what = "overlap" if info.offset < pos else "leave a gap"
            raise _Bad(f"chunks {what} at data offset {min(pos, info.offset)}")
        pos = info.offset + info.length
    if pos != data_len:
        raise _Bad(f"chunks cover {pos} of {data_len} data bytes")


# ---------------------------------------------------------------------------- store
@dataclass(frozen=True)
class LoadedCheckpoint:
    """A whole-job checkpoint read back: ``ranks[r]`` is rank ``r``'s (meta, raw data)."""

    step: int
    world_size: int
    codec: str
    created_at: float
    ranks: list[tuple[bytes, bytearray]]

    def meta(self, rank: int) -> bytes:
        return self.ranks[rank][0]

    def data(self, rank: int) -> bytearray:
        return self.ranks[rank][1]


class CheckpointWriter:
    """Writes one checkpoint: :meth:`add_rank` for every rank, then :meth:`commit`.
    Made by :meth:`DurableStore.begin`; usable as a context manager (aborts on error).

    Several writers (processes, nodes) can share one checkpoint: the owner calls
    :meth:`DurableStore.begin`, each contributor :meth:`DurableStore.contribute`,
    adds its ranks and hands the owner :meth:`record` of each; the owner
    :meth:`adopt` s them (re-validated, files checked) and commits. A contributor
    never commits nor removes anything but its own files (on abort)."""

    def __init__(
        self,
        store: DurableStore,
        step: int,
        world_size: int,
        codec: str,
        crash_hook: CrashHook | None,
        *,
        part: bool = False,
    ) -> None:
        self.store = store
        self.step = step
        self.world_size = world_size
        self.codec = codec
        self.part = part
        self._crash_hook = crash_hook
        self._dir = step_dir(step)
        self._ranks: dict[int, _RankRecord] = {}
        self._bases: dict[int, _Manifest] = {}
        self._state = "open"

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None and self._state == "open":
            self.abort()

    def _hook(self, phase: str) -> None:
        if self._crash_hook is not None:
            self._crash_hook(phase)

    def _check_open(self) -> None:
        if self._state != "open":
            raise UsageError(f"checkpoint step {self.step} writer is already {self._state}")

    def _check_base(self, rank: int, meta: bytes, data_len: int, base_step: int) -> None:
        if not 0 <= base_step < self.step:
            raise UsageError(f"rank {rank}: base_step {base_step} must be an older step than {self.step}")
        base = self._bases.get(base_step)
        if base is None:
            try:
                base = self.store._read_manifest(base_step)
            except SnapshotError as e:
                raise UsageError(
                    f"rank {rank}: base checkpoint step {base_step} is not usable ({_one_line(e)}); "
                    "write a full checkpoint"
                ) from None
            self._bases[base_step] = base
        if rank >= base.world_size:
            raise UsageError(f"rank {rank}: base checkpoint step {base_step} has no rank {rank}")
        brec = base.ranks[rank]
        if brec.base_step is not None:
            raise UsageError(
                f"rank {rank}: base checkpoint step {base_step} is itself a delta (of step "
                f"{brec.base_step}); a delta must reference a FULL checkpoint"
            )
        if brec.data_len != data_len or _layout_of(brec.meta) != _layout_of(meta):
            raise UsageError(
                f"rank {rank}: tensor layout differs from base checkpoint step {base_step}; "
                "write a full checkpoint"
            )

    def add_rank(
        self,
        rank: int,
        meta: bytes,
        data_len: int,
        chunks: Sequence[tuple[ChunkInfo, Buffer]],
        base_step: int | None,
    ) -> int:
        """Write rank ``rank``'s chunk file (durable when this returns); return its size.

        ``chunks`` are the (info, payload) pairs of an :class:`~nonstop.snapshot.codec.Encoder`
        for this rank's data of ``data_len`` bytes; ``base_step`` the committed FULL
        checkpoint their delta chunks apply to (ignored when no chunk is a delta)."""
        self._check_open()
        if not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank} is outside world size {self.world_size}")
        if rank in self._ranks:
            raise UsageError(f"rank {rank} was already added to checkpoint step {self.step}")
        meta = bytes(meta)
        try:
            meta_text = meta.decode("utf-8")
            json.loads(meta_text)
        except (UnicodeDecodeError, ValueError):
            raise UsageError(f"rank {rank}: meta must be the snapshot's JSON meta (UTF-8 JSON)") from None
        infos = [info for info, _ in chunks]
        try:
            _check_coverage(infos, data_len)
        except _Bad as e:
            raise UsageError(f"rank {rank}: {e}") from None
        for info, payload in chunks:
            if len(_byte_view(payload)) != info.enc_len:
                raise UsageError(f"rank {rank}: payload of chunk at {info.offset} is not enc_len bytes")
        if not any(info.delta for info in infos):
            base_step = None
        elif base_step is None:
            raise UsageError(f"rank {rank}: delta chunks need a base_step")
        else:
            self._check_base(rank, meta, data_len, base_step)

        hook = self._hook

        def payloads() -> Iterator[Buffer]:
            first = True
            for _, payload in chunks:
                yield payload
                if first:
                    first = False
                    hook("bin_partial")
            if first:
                hook("bin_partial")

        name = rank_file(rank)
        written = self.store.storage.write(f"{self._dir}/{name}", payloads())
        self._hook("bin_written")
        offsets, pos = [], 0
        for info in infos:
            offsets.append((info, pos))
            pos += info.enc_len
        self._ranks[rank] = _RankRecord(
            rank=rank,
            data_len=data_len,
            meta=meta,
            meta_crc=_codec.checksum(meta),
            base_step=base_step,
            file=name,
            file_len=written,
            chunks=tuple(offsets),
        )
        return written

    def record(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s manifest entry (JSON-safe), for the checkpoint's owner to :meth:`adopt`."""
        if rank not in self._ranks:
            raise UsageError(f"rank {rank} was not added to checkpoint step {self.step}")
        return _rank_doc(self._ranks[rank])

    def adopt(self, doc: Any) -> int:
        """Take a rank written by a contributor (its :meth:`record`); return the rank.

        The entry is validated like a manifest's, its file must exist with the recorded
        size, and a delta must reference a usable FULL base: a bad or foreign entry raises
        :class:`SnapshotCorruptError` (the checkpoint cannot commit without that rank)."""
        self._check_open()
        where = f"{self.store._where(self.step)} contributed rank"
        rank_v = doc.get("rank") if isinstance(doc, dict) else None
        if not isinstance(rank_v, int) or isinstance(rank_v, bool):
            raise SnapshotCorruptError(f"{where}: not a rank entry")
        rank = rank_v
        if not 0 <= rank < self.world_size or rank in self._ranks:
            raise SnapshotCorruptError(f"{where} {rank}: outside world size {self.world_size} or added twice")
        try:
            rec = _rank_from_doc(doc, rank, self.step)
        except (_Bad, SnapshotCorruptError, ValueError, TypeError, KeyError) as e:
            raise SnapshotCorruptError(f"{where} {rank}: {_one_line(e)}") from None
        if rec.file != rank_file(rank):
            raise SnapshotCorruptError(f"{where} {rank}: file {rec.file!r} is not {rank_file(rank)!r}")
        if _codec.checksum(rec.meta) != rec.meta_crc:
            raise SnapshotCorruptError(f"{where} {rank}: meta fails its checksum")
        try:
            size = self.store.storage.size(f"{self._dir}/{rec.file}")
        except SnapshotMissingError:
            raise SnapshotCorruptError(f"{where} {rank}: its file is missing") from None
        if size != rec.file_len:
            raise SnapshotCorruptError(f"{where} {rank}: file is {size} bytes, the entry says {rec.file_len}")
        if rec.base_step is not None:
            try:
                self._check_base(rank, rec.meta, rec.data_len, rec.base_step)
            except UsageError as e:
                raise SnapshotCorruptError(f"{where} {rank}: {e}") from None
        self._ranks[rank] = rec
        return rank

    def commit(self) -> None:
        """Write the manifest, then ``latest``, then apply retention. Every rank must have
        been added (or adopted); a contributor's writer cannot commit."""
        self._check_open()
        if self.part:
            raise UsageError(f"checkpoint step {self.step}: a contributor cannot commit; its owner does")
        missing = [r for r in range(self.world_size) if r not in self._ranks]
        if missing:
            raise UsageError(f"checkpoint step {self.step}: ranks {missing} were not added; cannot commit")
        self._hook("bins_done")
        manifest = _encode_manifest(
            self.step,
            self.world_size,
            time.time(),
            self.codec,
            [self._ranks[r] for r in range(self.world_size)],
        )
        half = len(manifest) // 2

        def manifest_parts() -> Iterator[bytes]:
            yield manifest[:half]
            self._hook("manifest_partial")
            yield manifest[half:]

        storage = self.store.storage
        storage.write(f"{self._dir}/{MANIFEST}", manifest_parts())
        self._hook("manifest_written")
        storage.write(LATEST, [f"{self._dir}\n".encode()])
        self._state = "committed"
        self._hook("latest_written")
        try:
            self.store._retain(self.step, self._hook)
        except (OSError, SnapshotError) as e:
            # The checkpoint is committed; failing to delete old ones must not fail the persist.
            log.warning("retention in %s failed (old checkpoints kept): %s", self.store.url, _one_line(e))
        self._hook("retention_done")

    def abort(self) -> None:
        """Drop this checkpoint: remove what was written of it (a contributor: only its own
        rank files). Idempotent."""
        if self._state != "open":
            return
        self._state = "aborted"
        if not self.part:
            self.store.storage.remove_tree(self._dir)
            return
        for rank in self._ranks:
            self.store.storage.remove_tree(f"{self._dir}/{rank_file(rank)}")


class DurableStore:
    """Whole-job checkpoints under one root (a path or fsspec URL, or a :class:`Storage`).

    ``keep`` committed checkpoints are retained, plus the bases they need. ``threads``
    decoder threads are used when loading (default: the CPU count, at most 8).
    ``_crash_hook`` (tests only) is called with the name of each phase of a persist
    (``bin_partial``, ``bin_written``, ``bins_done``, ``manifest_partial``,
    ``manifest_written``, ``latest_written``, ``retention_partial``, ``retention_done``)."""

    def __init__(
        self,
        url_or_storage: str | os.PathLike[str] | Storage,
        *,
        keep: int = 3,
        threads: int | None = None,
        _crash_hook: CrashHook | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise UsageError(f"keep must be an integer >= 1 (got {keep!r})")
        if threads is None:
            threads = min(8, os.cpu_count() or 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise UsageError(f"threads must be an integer >= 1 (got {threads!r})")
        if isinstance(url_or_storage, str | os.PathLike):
            self.storage: Storage = open_storage(url_or_storage)
        elif isinstance(url_or_storage, Storage):
            self.storage = url_or_storage
        else:
            raise UsageError(f"checkpoint location must be a path, URL or Storage (got {url_or_storage!r})")
        self.url = self.storage.url
        self.keep = keep
        self.threads = threads
        self._crash_hook = _crash_hook

    def __repr__(self) -> str:
        return f"DurableStore({self.url!r}, keep={self.keep})"

    def _where(self, step: int) -> str:
        return f"checkpoint step {step} ({self.url.rstrip('/')}/{step_dir(step)})"

    # -- listing -------------------------------------------------------------------
    def _step_dirs(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for name in self.storage.listdir(""):
            s = _parse_step_dir(name)
            if s is not None:
                out[s] = name
        return out

    def steps(self) -> list[int]:
        """Committed steps (manifest present), ascending."""
        return sorted(s for s, d in self._step_dirs().items() if self.storage.exists(f"{d}/{MANIFEST}"))

    def _read_latest(self) -> tuple[int | None, str | None]:
        """(step named by ``latest``, problem): (None, None) when there is no ``latest``."""
        try:
            raw = self.storage.read(LATEST, 0, 256)
        except SnapshotMissingError:
            return None, None
        try:
            m = _LATEST_RE.match(raw.decode("ascii"))
        except UnicodeDecodeError:
            m = None
        if m is None:
            return None, f"{self.url.rstrip('/')}/{LATEST} is corrupt ({raw[:40]!r})"
        return int(m.group(1)[len("step-") :]), None

    def latest_step(self) -> int | None:
        """The step ``latest`` names; when it is missing or corrupt, the newest committed step."""
        step, _ = self._read_latest()
        if step is not None:
            return step
        committed = self.steps()
        return committed[-1] if committed else None

    def world_size_at(self, step: int) -> int:
        """How many ranks committed checkpoint ``step`` holds (reads its manifest only)."""
        return self._read_manifest(step).world_size

    def _read_manifest(self, step: int) -> _Manifest:
        where = self._where(step)
        try:
            raw = self.storage.read(f"{step_dir(step)}/{MANIFEST}")
        except SnapshotMissingError:
            raise SnapshotMissingError(f"{where}: no manifest (not committed)") from None
        m = _decode_manifest(raw, where)
        if m.step != step:
            raise SnapshotCorruptError(f"{where}: manifest is for step {m.step}")
        return m

    # -- writing -------------------------------------------------------------------
    def begin(self, step: int, world_size: int, codec: str) -> CheckpointWriter:
        """Start writing checkpoint ``step``. An existing directory of that step is removed
        first when it is abandoned, corrupt or not the current checkpoint (nor its base);
        overwriting the current good checkpoint is refused (UsageError)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be an integer >= 0 (got {step!r})")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"world_size must be an integer >= 1 (got {world_size!r})")
        name = step_dir(step)
        if self.storage.exists(name):
            if (
                self.storage.exists(f"{name}/{MANIFEST}")
                and step in self._protected()
                and not self.verify(step)
            ):
                raise UsageError(f"{self._where(step)} is already committed and in use; persist a newer step")
            self.storage.remove_tree(name)
        return CheckpointWriter(self, step, world_size, codec, self._crash_hook)

    def contribute(self, step: int, world_size: int, codec: str) -> CheckpointWriter:
        """Write some ranks of checkpoint ``step``, which another writer opened with
        :meth:`begin` and will commit (see :class:`CheckpointWriter`). Nothing is removed first."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be an integer >= 0 (got {step!r})")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"world_size must be an integer >= 1 (got {world_size!r})")
        return CheckpointWriter(self, step, world_size, codec, self._crash_hook, part=True)

    def _protected(self) -> set[int]:
        """The checkpoint ``latest`` names and the bases it needs."""
        step, _ = self._read_latest()
        if step is None:
            return set()
        out = {step}
        try:
            out |= {r.base_step for r in self._read_manifest(step).ranks if r.base_step is not None}
        except SnapshotError:
            pass
        return out

    def _retain(self, current: int, hook: CrashHook) -> None:
        dirs = self._step_dirs()
        committed = sorted(
            (s for s, d in dirs.items() if s <= current and self.storage.exists(f"{d}/{MANIFEST}")),
            reverse=True,
        )
        keep = set(committed[: self.keep]) | {current}
        needed = set(keep)
        for s in keep:
            try:
                needed |= {r.base_step for r in self._read_manifest(s).ranks if r.base_step is not None}
            except SnapshotError:
                pass  # an unreadable checkpoint cannot load anyway: its bases are not needed for it
        first = True
        for s in sorted(dirs, reverse=True):  # dependents (newer) before their bases
            if s in needed:
                continue
            # Un-commit first, so a crash mid-removal never leaves a manifest naming lost files.
            self.storage.remove_tree(f"{dirs[s]}/{MANIFEST}")
            if first:
                first = False
                hook("retention_partial")
            self.storage.remove_tree(dirs[s])
        for name in self.storage.listdir(""):
            if _TMP_MARK in name:
                self.storage.remove_tree(name)

    # -- reading -------------------------------------------------------------------
    def _rank_data(self, m: _Manifest, rec: _RankRecord, base: bytearray | None) -> bytearray:
        where = f"{self._where(m.step)} rank {rec.rank}"
        path = f"{step_dir(m.step)}/{rec.file}"
        try:
            blob = self.storage.read(path)
        except SnapshotMissingError:
            raise SnapshotCorruptError(f"{where}: {rec.file} is missing") from None
        if len(blob) != rec.file_len:
            what = "truncated" if len(blob) < rec.file_len else "longer than recorded"
            raise SnapshotCorruptError(
                f"{where}: {rec.file} is {what} ({len(blob)} bytes, manifest says {rec.file_len})"
            )
        if _codec.checksum(rec.meta) != rec.meta_crc:
            raise SnapshotCorruptError(f"{where}: meta fails its checksum")
        mv = memoryview(blob)
        chunks = [(info, mv[off : off + info.enc_len]) for info, off in rec.chunks]
        out = bytearray(rec.data_len)
        try:
            _codec.decode(chunks, out, base, threads=self.threads)
        except SnapshotCorruptError as e:
            raise SnapshotCorruptError(f"{where}: {rec.file}: {_one_line(e)}") from None
        except (ValueError, RuntimeError, OverflowError, IndexError, KeyError) as e:
            raise SnapshotCorruptError(
                f"{where}: {rec.file}: cannot decode ({type(e).__name__}: {_one_line(e)})"
            ) from None
        return out

    def _load_rank(self, m: _Manifest, rank: int, bases: dict[int, _Manifest]) -> tuple[bytes, bytearray]:
        if not 0 <= rank < m.world_size:
            raise SnapshotMissingError(
                f"{self._where(m.step)} has no rank {rank} (world size {m.world_size})"
            )
        rec = m.ranks[rank]
        base_data = None
        if rec.base_step is not None:
            where = f"{self._where(m.step)} rank {rank}"
            b = rec.base_step
            bm = bases.get(b)
            if bm is None:
                try:
                    bm = self._read_manifest(b)
                except SnapshotError as e:
                    raise SnapshotCorruptError(
                        f"{where}: its base checkpoint step {b} is unusable ({_one_line(e)})"
                    ) from None
                bases[b] = bm
            if rank >= bm.world_size:
                raise SnapshotCorruptError(f"{where}: its base checkpoint step {b} has no rank {rank}")
            brec = bm.ranks[rank]
            if brec.base_step is not None:
                raise SnapshotCorruptError(f"{where}: its base checkpoint step {b} is not a full checkpoint")
            if brec.data_len != rec.data_len or _layout_of(brec.meta) != _layout_of(rec.meta):
                raise SnapshotCorruptError(f"{where}: tensor layout differs from its base step {b}")
            try:
                base_data = self._rank_data(bm, brec, None)
            except SnapshotCorruptError as e:
                raise SnapshotCorruptError(f"{where}: its base is unusable: {_one_line(e)}") from None
        return rec.meta, self._rank_data(m, rec, base_data)

    def load_rank(self, step: int, rank: int) -> tuple[bytes, bytearray]:
        """(meta, raw data) of ``rank`` in checkpoint ``step``, every checksum verified."""
        return self._load_rank(self._read_manifest(step), rank, {})

    def _load_step(self, step: int, world_size: int | None) -> LoadedCheckpoint:
        m = self._read_manifest(step)
        if world_size is not None and world_size != m.world_size:
            raise UsageError(
                f"{self._where(step)} has {m.world_size} ranks but this job has {world_size}; "
                f"run with --nproc-per-node {m.world_size}"
            )
        bases: dict[int, _Manifest] = {}
        ranks = [self._load_rank(m, r, bases) for r in range(m.world_size)]
        return LoadedCheckpoint(
            step=m.step, world_size=m.world_size, codec=m.codec, created_at=m.created_at, ranks=ranks
        )

    def load(self, step: int | None = None, *, world_size: int | None = None) -> LoadedCheckpoint:
        """Checkpoint ``step``, or with ``step=None`` the newest good one (see module doc).
        SnapshotMissingError when there is none; UsageError when ``world_size`` differs."""
        if step is not None:
            return self._load_step(step, world_size)
        committed = self.steps()
        first, problem = self._read_latest()
        if problem is not None:
            log.warning("%s; using the newest committed checkpoint instead", problem)
        if first is None:
            if committed and problem is None:
                log.info("no %s pointer in %s; using the newest committed checkpoint", LATEST, self.url)
            order = committed[::-1]
        else:
            order = [first] + [s for s in committed[::-1] if s < first]
        for i, s in enumerate(order):
            try:
                return self._load_step(s, world_size)
            except SnapshotError as e:
                nxt = f"falling back to step {order[i + 1]}" if i + 1 < len(order) else "no older checkpoint"
                log.warning("durable checkpoint unusable: %s; %s", _one_line(e), nxt)
        if not order:
            raise SnapshotMissingError(f"no committed checkpoint in {self.url}")
        raise SnapshotMissingError(f"no loadable checkpoint in {self.url} (tried steps {order})")

    def verify(self, step: int) -> list[str]:
        """Problems of checkpoint ``step`` (empty when good): reads and checks every byte."""
        try:
            m = self._read_manifest(step)
        except SnapshotError as e:
            return [_one_line(e)]
        problems = []
        bases: dict[int, _Manifest] = {}
        for r in range(m.world_size):
            try:
                self._load_rank(m, r, bases)
            except SnapshotError as e:
                problems.append(_one_line(e))
        return problems

    def describe(self, *, verify: bool = True) -> dict[str, Any]:
        """A report of every checkpoint for ``nonstop inspect`` (see :func:`format_inspect`)."""
        latest, latest_problem = self._read_latest()
        dirs = self._step_dirs()
        checkpoints: list[dict[str, Any]] = []
        uncommitted: list[str] = []
        for s in sorted(dirs):
            if not self.storage.exists(f"{dirs[s]}/{MANIFEST}"):
                uncommitted.append(dirs[s])
                continue
            entry: dict[str, Any] = {"step": s, "dir": dirs[s], "latest": s == latest}
            try:
                m = self._read_manifest(s)
            except SnapshotError as e:
                entry.update(ok=False, problems=[_one_line(e)])
                checkpoints.append(entry)
                continue
            data = sum(r.data_len for r in m.ranks)
            stored = sum(r.file_len for r in m.ranks)
            bases = sorted({r.base_step for r in m.ranks if r.base_step is not None})
            problems = self.verify(s) if verify else []
            entry.update(
                world_size=m.world_size,
                codec=m.codec,
                created_at=m.created_at,
                base_step=bases[-1] if bases else None,
                delta_ranks=sum(r.base_step is not None for r in m.ranks),
                data_bytes=data,
                stored_bytes=stored,
                ratio=(data / stored) if stored else None,
                ok=not problems if verify else None,
                problems=problems,
            )
            checkpoints.append(entry)
        return {
            "url": self.url,
            "format_version": FORMAT_VERSION,
            "latest": latest,
            "latest_problem": latest_problem,
            "checkpoints": checkpoints,
            "uncommitted": uncommitted,
        }


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # unreachable


def format_inspect(report: dict[str, Any]) -> str:
    """Human-readable table of a :meth:`DurableStore.describe` report."""
    lines = [f"checkpoints in {report['url']} (format v{report.get('format_version', FORMAT_VERSION)})"]
    if report.get("latest_problem"):
        lines.append(f"  ! {report['latest_problem']}")
    rows = [("", "STEP", "RANKS", "DATA", "STORED", "RATIO", "BASE", "CREATED", "STATUS", "CODEC")]
    for c in report["checkpoints"]:
        created = c.get("created_at")
        ratio = c.get("ratio")
        ok = c.get("ok")
        rows.append(
            (
                "*" if c.get("latest") else "",
                str(c["step"]),
                str(c.get("world_size", "?")),
                _human(c.get("data_bytes")),
                _human(c.get("stored_bytes")),
                f"{ratio:.2f}x" if ratio is not None else "-",
                "-" if c.get("base_step") is None else str(c["base_step"]),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)) if created is not None else "-",
                "unchecked" if ok is None and not c.get("problems") else ("ok" if ok else "CORRUPT"),
                str(c.get("codec", "-")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    if not report["checkpoints"]:
        lines.append("  (no committed checkpoints)")
    for c in report["checkpoints"]:
        for p in c.get("problems") or ():
            lines.append(f"  step {c['step']}: {p}")
    if report.get("uncommitted"):
        lines.append(f"  uncommitted (abandoned) directories: {', '.join(report['uncommitted'])}")
    latest = report.get("latest")
    lines.append(f"  latest: {'step ' + str(latest) if latest is not None else 'none'}  (* marks it)")
    return "\n".join(lines)
