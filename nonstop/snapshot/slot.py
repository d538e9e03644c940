"""One snapshot slot: a file in shared memory, its naming, its header and its pin word.

This is the format half of the memory tier (:mod:`nonstop.snapshot.store` is the
protocol half: which slot to write, overlapped capture, seqlock-style reads).
The byte layout and header fields are specified in :mod:`nonstop.snapshot.api`;
here they are mapped, encoded and decoded:

* **Naming.** Every segment of a job starts with :func:`segment_prefix`; a slot
  is ``<prefix>r<rank>-s<slot>`` (:func:`slot_path`; :func:`rank_slot_paths` lists
  a rank's). The agent lists and deletes a job's segments by that prefix.
* **Mapping.** :class:`Slot` maps one file ``MAP_SHARED``. A writer grows it in
  place (same inode, larger mapping); a reader remaps when the header's
  capacities exceed its mapping, and forgets the mapping when the file was
  deleted or replaced (another inode).
* **Header.** :meth:`Slot.write_header` encodes every field except the ``pinned``
  word, which it carries over as it finds it; :meth:`Slot.header` decodes it and
  validates it (:func:`header_problem`): a header of another format version, or with
  a state, length, capacity or pin word that no writer writes, is corrupt -- logged,
  and treated as no header, so readers see no snapshot in that slot and the writer
  re-initialises it instead of failing on it forever. :meth:`Slot.read_info` turns
  it into a :class:`~nonstop.snapshot.api.SnapshotInfo`. There is no checksum: a
  header that passes is trusted, and the state word (WRITING first, COMPLETE last)
  is what tells a torn write from a valid one.
* **Pins.** The ``pinned`` word is a bit set owned by readers: :data:`READ_PIN`
  while a reader copies the slot out, :data:`KEEP_PIN` while the agent keeps
  that snapshot.

Threading contract: a :class:`Slot` is not thread-safe. Its owner (one
``RankSnapshotStore``) maps, remaps and writes headers from one thread at a time;
the store's background copier writes the COMPLETE header of the slot it was
handed while the caller's thread does not touch that slot's header. The one
exception is :meth:`Slot.set_pinned`: the readers of one process (persister,
replicator, data plane) may pin slots from several threads, so the
read-modify-write of the pin word holds a process-wide lock, and READ_PIN is
counted per slot file in the process (set by its first reader, cleared by its
last: one thread's copy done never unpins another's). Across processes the pin
word has one writer per bit (the reading process); the writing process only
carries it over. Readers in threads of one process may also share one
:class:`Slot`: a thread that finds the file grown or replaced maps it afresh, and
the old mapping is left to the threads still reading through it (:meth:`Slot._swap`).
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Any

import torch

from nonstop.errors import SnapshotCorruptError, SnapshotError
from nonstop.snapshot.api import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_FMT,
    HEADER_SIZE,
    MAGIC,
    PIN_OFFSET,
    TRIM_OFFSET,
    SlotState,
    SnapshotInfo,
    TensorEntry,
)
from nonstop.snapshot.device import HostRegistration, Pairs, cuda_ready

log = logging.getLogger(__name__)

__all__ = [
    "KEEP_PIN",
    "PIN_BITS",
    "READ_PIN",
    "ShmFullError",
    "Slot",
    "align",
    "dtype_from_name",
    "header_problem",
    "rank_slot_paths",
    "reserve",
    "segment_prefix",
    "slot_path",
]


def segment_prefix(job_id: str) -> str:
    """File-name prefix of every shared-memory segment of ``job_id``."""
    return f"nonstop-{job_id}-"


def slot_path(shm_dir: Path, job_id: str, rank: int, slot: int) -> Path:
    return shm_dir / f"{segment_prefix(job_id)}r{rank}-s{slot}"


def rank_slot_paths(shm_dir: Path, job_id: str, rank: int) -> list[Path]:
    """The slot files of ``rank`` that exist now, whatever the number of slots."""
    return list(shm_dir.glob(f"{segment_prefix(job_id)}r{rank}-s*"))


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype a snapshot meta names; SnapshotCorruptError for a name that is none."""
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SnapshotCorruptError(f"unknown dtype {str(name)[:80]!r} in snapshot meta")
    return dt


class ShmFullError(SnapshotError):
    """A slot's pages could not be allocated: the memory filesystem is full (ENOSPC)."""


def reserve(fd: int, size: int) -> bool:
    """Allocate every page of the first ``size`` bytes of ``fd`` now, the file extended to
    ``size`` when shorter (only once every page is allocated: on tmpfs a reader that maps the
    file at its new size never touches a page with none behind it, which is a SIGBUS when the
    filesystem is full). ShmFullError when the filesystem cannot (ENOSPC: on tmpfs nothing stays
    allocated and the size is unchanged). False on a filesystem without ``posix_fallocate``: the
    size is unchanged and pages are left to be allocated as they are written."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShmFullError(f"no room for {size} bytes: {os.strerror(e.errno)}") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        return False
    return True


TRIM_MIN = 1 << 20  # a slot gives back the pages past what it holds when that is at least this much
PAGE = mmap.PAGESIZE

READ_PIN = 1  # a reader is copying the slot (transient)
KEEP_PIN = 2  # the node agent keeps this snapshot (the replicated step, or one being replicated)
PIN_BITS = READ_PIN | KEEP_PIN
_PIN_LOCK = threading.Lock()
_READING: dict[str, int] = {}  # slot path -> this process's readers copying it now (READ_PIN)


def header_problem(raw: tuple[Any, ...], mapped: int) -> str | None:
    """What makes the header fields ``raw`` (with the magic) corrupt in a slot whose mapping is
    ``mapped`` bytes long; None when no writer could have written them otherwise."""
    _, version, state, _, data_len, meta_len, data_cap, meta_cap, written_at, pinned, _ = raw
    if version != FORMAT_VERSION:
        return f"snapshot format v{version}, this nonstop reads v{FORMAT_VERSION}"
    if state not in _STATES:
        return f"unknown state {state}"
    if data_cap % ALIGN or meta_cap % ALIGN or HEADER_SIZE + data_cap + meta_cap > mapped:
        return f"capacities {data_cap} + {meta_cap} do not fit the {mapped}-byte file"
    if data_len > data_cap or meta_len > meta_cap:
        return f"lengths {data_len} + {meta_len} exceed the capacities {data_cap} + {meta_cap}"
    if pinned & ~PIN_BITS:
        return f"pin word {pinned:#x} has bits no reader sets"
    if not math.isfinite(written_at):
        return f"write time {written_at}"
    return None


_STATES = frozenset(int(s) for s in SlotState)


class Slot:
    """One mapped slot file. Grows in place (same inode, larger mapping) only when needed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._views: list[torch.Tensor | None] = []
        self._views_plan = -1
        self._pinned = HostRegistration()  # the data area, page-locked (cudaHostRegister)
        self._inode = -1  # of the mapped file: a deleted or replaced file is noticed
        self.data_cap = 0
        self.meta_cap = 0
        self._reported: str | None = None  # the header problem last logged

    # -- mapping -------------------------------------------------------------
    def _map(self, size: int, *, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            st = os.fstat(fd)
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._swap(mm, st.st_ino)

    def _swap(self, mm: mmap.mmap | None, inode: int = -1) -> None:
        """Replace the mapping by ``mm`` (None: none). The old one is left to be unmapped when its
        last reference goes, never closed here: the agent's threads (persister, replicator, data
        plane) read through one store's slots, and a thread copying out of the old mapping (its
        views hold it) must not find it closed -- or, through a tensor view, unmapped under it --
        because another thread saw the file grow or replaced and mapped it afresh."""
        self.forget_views()
        self._pinned.unregister()  # (the writer's own thread: only the writer registers)
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else None
        self._mm, self._inode = mm, inode

    def open_existing(self) -> bool:
        if self._mm is not None:
            try:
                same = os.stat(self.path).st_ino == self._inode
            except FileNotFoundError:
                same = False
            if same:
                self._refresh_caps()
                return True
            self._swap(None)  # the file was deleted (lost memory) or replaced: forget the old mapping
        if not self.path.exists():
            return False
        if not self._remap():
            return False
        if len(self._mm or b"") < HEADER_SIZE:
            self._swap(None)
            return False
        self._refresh_caps()
        return self._mm is not None

    def _remap(self) -> bool:
        """Map the file at its current size; False (and unmapped) when it cannot be."""
        try:
            self._map(0, create=False)
        except (ValueError, FileNotFoundError):
            # created by its writer a moment ago and not sized yet (mmap refuses an empty
            # file), or deleted (or truncated to nothing) meanwhile: nothing to read in it yet
            self._swap(None)
            return False
        return True

    def _refresh_caps(self) -> None:
        """Take the capacities from the header, remapping first when the header's exceed the
        mapping (the writer grew the file). A corrupt header gives capacities 0: the slot holds
        nothing readable, and its writer re-initialises it (:meth:`ensure_capacity`)."""
        raw, mm = self._raw_header(), self._mm
        if raw is not None and mm is not None and len(mm) < HEADER_SIZE + raw[6] + raw[7]:
            if not self._remap():
                self.data_cap = self.meta_cap = 0
                return
        hdr = self.header()
        self.data_cap, self.meta_cap = (hdr[6], hdr[7]) if hdr is not None else (0, 0)

    def ensure_capacity(self, data_len: int, meta_len: int, *, pin: bool = False) -> None:
        """Make the slot hold ``data_len`` + ``meta_len`` bytes (grown in place, pages allocated);
        ``pin``: the state has device tensors, so page-lock the data area now
        (:meth:`pin_for_cuda`), before any copy into it, not inside a later write."""
        if self._mm is None:
            self.open_existing()
        valid = self.header() is not None
        if valid and data_len <= self.data_cap and meta_len <= self.meta_cap:
            self._back(data_len)
            if pin:
                self.pin_for_cuda()
            return
        data_cap = align(max(data_len, self.data_cap))
        meta_cap = align(max(int(meta_len * 1.5) + 4096, self.meta_cap))
        # Grow in place: other processes keep the same inode mapped and remap when the
        # header's capacities exceed their mapping. The pages are allocated first, so that a full
        # memory filesystem fails here (ShmFullError, the slot as it was) rather than SIGBUS later.
        self._grow_file(HEADER_SIZE + data_cap + meta_cap)
        self._map(HEADER_SIZE + data_cap + meta_cap, create=True)
        self.data_cap, self.meta_cap = data_cap, meta_cap
        assert self._mm is not None
        struct.pack_into("<Q", self._mm, TRIM_OFFSET, 0)  # every page reserved (_grow_file)
        # A slot without a valid header (new, or corrupt) has no reader's pins either.
        self.write_header(SlotState.EMPTY, -1, 0, 0, 0.0, keep_pins=valid)
        if pin:
            self.pin_for_cuda()

    def _grow_file(self, size: int) -> None:
        """Make the file at least ``size`` bytes with every page allocated (:func:`.space.reserve`).
        ShmFullError when the filesystem has no room: the file keeps its old size and pages (no
        reader has the larger size mapped yet: the header does not announce it)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            old = os.fstat(fd).st_size
            try:
                # allocates first, then extends (pages a trim gave back are allocated again):
                # never a moment when another process could map the file over pages with none
                # behind them, as an ftruncate first would leave (the SIGBUS of a full tmpfs)
                if reserve(fd, size) or old >= size:
                    return
            except BaseException:
                if os.fstat(fd).st_size != old:  # (a filesystem other than tmpfs, part-way)
                    os.ftruncate(fd, old)
                raise
            os.ftruncate(fd, size)  # no posix_fallocate here: pages come as they are written
        finally:
            os.close(fd)

    # -- giving back pages (a slot that held more than it holds now) --------------------------
    def _trimmed(self) -> int:
        """The data bytes still backed by pages after a trim (0: never trimmed: all of them). A
        word past the data area (a corrupt header: the slot file is anyone's to scribble on) reads
        as all of it, so a trim or a re-backing never reaches past the mapping."""
        assert self._mm is not None
        return min(int(struct.unpack_from("<Q", self._mm, TRIM_OFFSET)[0]), self.data_cap)

    def trim(self, keep: int) -> int:
        """Give back the pages of the data area past ``keep`` bytes (``MADV_REMOVE``: on tmpfs the
        memory is freed, the file keeps its size and reads there give zeros) when that frees at
        least :data:`TRIM_MIN` -- a slot that held a whole snapshot and now holds a rank's own
        part (:mod:`nonstop.snapshot.nodecopy`). The writer calls it on the slot it writes; the
        trim word tells a later, longer write to allocate the pages again (:meth:`_back`).
        Returns the bytes given back."""
        if self._mm is None or self._pinned.active:
            return 0  # (page-locked memory is not given back: it is a device job's, kept whole)
        start = max(PAGE, -(-keep // PAGE) * PAGE)
        end = (HEADER_SIZE + (self._trimmed() or self.data_cap)) // PAGE * PAGE - HEADER_SIZE
        if end - start < TRIM_MIN:
            return 0
        self._mm.madvise(mmap.MADV_REMOVE, HEADER_SIZE + start, end - start)
        struct.pack_into("<Q", self._mm, TRIM_OFFSET, start)
        return end - start

    def _back(self, data_len: int) -> None:
        """Before a write of ``data_len`` bytes: allocate again the pages a trim gave back, if it
        reaches past them (ShmFullError when the filesystem cannot: never a SIGBUS mid-copy)."""
        trimmed = self._trimmed()
        if not trimmed or data_len <= trimmed:
            return
        fd = os.open(self.path, os.O_RDWR)
        try:
            reserve(fd, HEADER_SIZE + self.data_cap)
        finally:
            os.close(fd)
        assert self._mm is not None
        struct.pack_into("<Q", self._mm, TRIM_OFFSET, 0)

    def views(self, plan_id: int, entries: list[TensorEntry]) -> list[torch.Tensor | None]:
        """Destination tensors for ``entries`` in this slot (None for empty ones), made once
        per layout and mapping. The alignment padding between them is zeroed then: a snapshot's
        bytes are its tensors' and zeros, never what an earlier layout left there, so equal
        states give equal bytes on every rank (the durable tier stores such chunks once)."""
        if self._views_plan != plan_id:
            data = self.data_view()
            for e, nxt in itertools.pairwise(entries):
                if e.offset + e.nbytes < nxt.offset:
                    data[e.offset + e.nbytes : nxt.offset].zero_()
            self._views = [
                data[e.offset : e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)
                if e.nbytes
                else None
                for e in entries
            ]
            self._views_plan = plan_id
        return self._views

    def pin_for_cuda(self) -> None:
        """Page-lock the data area so device-to-host copies into it are truly asynchronous
        (:class:`~nonstop.snapshot.device.HostRegistration`: chunked, checked; a refusal leaves it
        pageable). Nothing unless CUDA is initialised; nothing when it is registered already."""
        if self._bytes is None or self.data_cap == 0 or not cuda_ready():
            return
        self._pinned.register(self.data_view().data_ptr(), self.data_cap)

    def copies(self, dst: torch.Tensor, src: torch.Tensor) -> Pairs:
        """The device-to-host copies of ``src`` into ``dst`` (one of :meth:`views`): cut where
        ``dst`` crosses the edge of a registered chunk, so each lands in page-locked memory."""
        return self._pinned.pieces(dst, src)

    def forget_views(self) -> None:
        """Drop :meth:`views`' cache: the data area was written other than through them."""
        self._views, self._views_plan = [], -1

    def close(self) -> None:
        """Unmap now (the store's owner, once no thread reads through it any more)."""
        mm = self._mm
        self._swap(None)  # (the store's copies into it are done: it waits before closing)
        if mm is not None:
            mm.close()

    # -- header --------------------------------------------------------------
    def _raw_header(self) -> tuple[Any, ...] | None:
        """The header's fields, unchecked; None without a mapping or the magic."""
        mm = self._mm  # (once: another thread may swap the mapping meanwhile)
        if mm is None:
            return None
        raw = struct.unpack_from(HEADER_FMT, mm, 0)
        return raw if raw[0] == MAGIC else None

    def header(self) -> tuple[Any, ...] | None:
        """The header's fields, or None when the slot has no valid header: never written (no
        magic), or corrupt (:func:`header_problem`: another format version, a state, length,
        capacity or pin word that no writer writes). A corrupt header is logged once per
        problem and treated like no header: readers see no snapshot in the slot, and its
        writer re-initialises it. Never raises."""
        raw = self._raw_header()
        if raw is None:
            return None
        problem = header_problem(raw, len(self._mm or b""))
        if problem is not None:
            if problem != self._reported:
                self._reported = problem
                log.warning("snapshot slot %s: corrupt header (%s); treating it as empty", self.path, problem)
            return None
        return raw

    def read_info(self, rank: int, index: int) -> SnapshotInfo | None:
        """The header of this slot (slot number ``index`` of ``rank``), decoded; None when the
        file is missing, not sized yet or holds no header."""
        if not self.open_existing():
            return None
        hdr = self.header()
        if hdr is None:
            return None
        return SnapshotInfo(
            rank=rank,
            slot=index,
            state=SlotState(hdr[2]),
            step=hdr[3],
            data_len=hdr[4],
            meta_len=hdr[5],
            written_at=hdr[8],
            pinned=bool(hdr[9]),
            writer_pid=hdr[10],
        )

    def write_header(
        self,
        state: SlotState,
        step: int,
        data_len: int,
        meta_len: int,
        written_at: float,
        *,
        keep_pins: bool = True,
    ) -> None:
        """Everything but the ``pinned`` word, which belongs to readers: its known bits are
        carried over (all cleared with ``keep_pins=False``, for a slot whose header was not
        valid, so no reader held it)."""
        assert self._mm is not None
        pinned = struct.unpack_from("<I", self._mm, PIN_OFFSET)[0] & PIN_BITS if keep_pins else 0
        struct.pack_into(
            HEADER_FMT,
            self._mm,
            0,
            MAGIC,
            FORMAT_VERSION,
            int(state),
            step,
            data_len,
            meta_len,
            self.data_cap,
            self.meta_cap,
            written_at,
            pinned,
            os.getpid(),
        )

    def set_pinned(self, pinned: bool, bit: int = 1) -> None:
        """Set or clear one pin bit (READ_PIN: a reader is copying; KEEP_PIN: the agent keeps this
        snapshot, e.g. the replicated step). Bits of other holders are left alone."""
        mm = self._mm
        assert mm is not None
        with _PIN_LOCK:  # the readers of one process (persister, replicator, data plane) share slots
            if bit == READ_PIN:  # one bit for all of them: set by the first, cleared by the last
                key = str(self.path)
                readers = _READING.get(key, 0) + (1 if pinned else -1)
                if readers > 0:
                    _READING[key] = readers
                else:
                    _READING.pop(key, None)
                if readers > (1 if pinned else 0):
                    return
            value = struct.unpack_from("<I", mm, PIN_OFFSET)[0]
            value = value | bit if pinned else value & ~bit
            struct.pack_into("<I", mm, PIN_OFFSET, value)

    def data_view(self) -> torch.Tensor:
        b = self._bytes
        assert b is not None
        return b[HEADER_SIZE : HEADER_SIZE + self.data_cap]

    def data_memoryview(self) -> memoryview:
        mm = self._mm
        assert mm is not None
        return memoryview(mm)[HEADER_SIZE : HEADER_SIZE + self.data_cap]

    def meta_view(self) -> memoryview:
        mm = self._mm
        assert mm is not None
        start = HEADER_SIZE + self.data_cap
        return memoryview(mm)[start : start + self.meta_cap]
