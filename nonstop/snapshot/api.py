"""Contract of the snapshot subpackage: value types and the on-memory layout.

Slot file layout (little-endian)::

    [0, 4096)                      header: struct HEADER_FMT, rest zero
    [4096, 4096 + data_cap)        tensor bytes, each tensor 64-byte aligned
    [4096 + data_cap, + meta_cap)  JSON meta: {"tree": ..., "tensors": [...]}

Header fields: magic, format version, state (:class:`SlotState`), step (while
WRITING: the step being written), data_len, meta_len, data_cap, meta_cap,
written_at (unix time, also the write's identity for readers that copy a slot
out: see ``RankSnapshotStore.copy_out``), pinned (non-zero while a reader in
another process, the agent's persister, holds the slot: the writer picks
another slot), writer_pid (the process that wrote the header last: a WRITING
slot whose writer is dead is a torn leftover, not a write in progress).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from nonstop.errors import SnapshotCorruptError

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "HEADER_FMT",
    "HEADER_SIZE",
    "MAGIC",
    "PIN_OFFSET",
    "TRIM_OFFSET",
    "SlotState",
    "SnapshotInfo",
    "TensorEntry",
]

MAGIC = b"NSTPSLOT"
FORMAT_VERSION = 2
HEADER_FMT = "<8sIIqQQQQdIi"
PIN_OFFSET = 64  # byte offset of the ``pinned`` word in the header
# byte offset of the ``trim`` word (u64, after the struct; 0 in a header that never trimmed): a
# slot whose data area was given back past some length (Slot.trim) names that length here, and
# the next write longer than it allocates the pages again first (Slot.ensure_capacity)
TRIM_OFFSET = 128
HEADER_SIZE = 4096
ALIGN = 64
assert struct.calcsize(HEADER_FMT) <= HEADER_SIZE
assert struct.calcsize(HEADER_FMT[:-2]) == PIN_OFFSET
assert struct.calcsize(HEADER_FMT) <= TRIM_OFFSET


class SlotState(enum.IntEnum):
    """State word of a slot header. Only ``COMPLETE`` slots are ever read."""

    EMPTY = 0
    WRITING = 1
    COMPLETE = 2


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """Where one tensor lives in a slot's data area."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> list[object]:
        return [self.dtype, list(self.shape), self.offset, self.nbytes]

    @classmethod
    def from_json(cls, raw: object) -> TensorEntry:
        """Inverse of :meth:`to_json`; SnapshotCorruptError unless ``raw`` is
        ``[dtype, shape, offset, nbytes]`` with a string, a list of non-negative ints and two
        non-negative ints. (Whether the entry fits its data is checked by
        :func:`nonstop.snapshot.validate.parse_meta`.)"""
        if not isinstance(raw, list) or len(raw) != 4:
            raise SnapshotCorruptError(f"tensor entry {str(raw)[:80]} is not [dtype, shape, offset, nbytes]")
        dtype, shape, offset, nbytes = raw
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(_nonneg_int(v) for v in (*shape, offset, nbytes))
        ):
            raise SnapshotCorruptError(f"tensor entry {str(raw)[:80]} has a field of the wrong type")
        assert isinstance(offset, int) and isinstance(nbytes, int)
        return cls(dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes)


def _nonneg_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True, kw_only=True)
class SnapshotInfo:
    """What a slot header says about the snapshot it holds."""

    rank: int
    slot: int
    state: SlotState
    step: int
    data_len: int
    meta_len: int
    written_at: float
    pinned: bool = False
    writer_pid: int = 0
