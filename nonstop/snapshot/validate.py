"""The boundary of every decoder of snapshot bytes that come from disk, shared memory or a peer.

Such bytes may be anything: torn, scribbled over, or forged with valid checksums (CRC-32 and
CRC-32C protect against accidents, not against an editor). Every decoder of them in
:mod:`nonstop.snapshot` keeps three rules, and this module holds the pieces they share:

1. **One error.** Whatever the input, a decoder returns a correct decode or raises
   :class:`~nonstop.errors.SnapshotCorruptError`, whose one-line message names what is corrupt
   and what happens next. :func:`decoding` is the boundary that turns the residual exceptions
   of parsing (:data:`RESIDUAL`: a ``ValueError`` from a slice of the wrong length, a
   ``RecursionError`` from deeply nested JSON, a ``MemoryError``, ...) into that error.
   Errors of the project (:class:`~nonstop.errors.NonstopError`: a caller's
   :class:`~nonstop.errors.UsageError`, say) pass through unchanged.
2. **Check, then allocate.** A length or count read from the input is checked against the
   buffer that holds it and against a sane cap before anything of that size is allocated:
   :func:`check_alloc` (at most this machine's physical memory), :func:`alloc`, and
   :func:`load_json` (a size cap before parsing).
3. **Callers fall back.** A durable load tries the next older checkpoint, a snapshot slot whose
   header or meta is corrupt is treated as holding no snapshot, a replica fetch fails cleanly.

:func:`parse_meta` validates a snapshot's meta (``{"tree": ..., "tensors": [...]}``) against
the length of the data it describes, so that every tensor view it yields lies inside the data
and matches its dtype and shape.

Contract: pure functions, no I/O, thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterator
from typing import Any

from nonstop.errors import NonstopError, SnapshotCorruptError
from nonstop.snapshot.api import TensorEntry

__all__ = [
    "MAX_META_BYTES",
    "RESIDUAL",
    "alloc",
    "check_alloc",
    "corrupt",
    "decoding",
    "load_json",
    "memory_cap",
    "parse_meta",
]

RESIDUAL: tuple[type[BaseException], ...] = (
    ValueError,  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
    struct.error,
    KeyError,
    TypeError,
    IndexError,
    AttributeError,
    OverflowError,
    MemoryError,
    RecursionError,
    RuntimeError,  # torch's view and shape errors
)
"""What parsing untrusted bytes may raise besides the project's own errors."""

MAX_META_BYTES = 1 << 30
"""Largest snapshot meta (JSON) a decoder parses. A meta holds a few hundred bytes per tensor."""

_MSG_MAX = 200  # characters of a wrapped exception's message quoted in the error


def _one_line(text: object) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= _MSG_MAX else s[:_MSG_MAX] + "..."


def corrupt(what: str, problem: str, then: str) -> SnapshotCorruptError:
    """The error of a decoder: ``"<what> is corrupt: <problem>; <then>"`` on one line (the
    problem, which may quote stored bytes, cut short)."""
    return SnapshotCorruptError(" ".join(f"{what} is corrupt: {_one_line(problem)}; {then}".split()))


@contextlib.contextmanager
def decoding(what: str, then: str) -> Iterator[None]:
    """Run a decoder of ``what`` (e.g. ``"checkpoint step 20 rank 0 meta"``): any exception of
    :data:`RESIDUAL` raised inside becomes SnapshotCorruptError saying ``what`` is corrupt and,
    ``then``, what happens next (``"falling back to an older checkpoint"``). The project's own
    errors pass through unchanged; so do ``KeyboardInterrupt`` and the like."""
    try:
        yield
    except NonstopError:
        raise
    except MemoryError:
        raise corrupt(what, "decoding it needs more memory than is free (MemoryError)", then) from None
    except RecursionError:
        raise corrupt(what, "it is nested too deeply to decode (RecursionError)", then) from None
    except RESIDUAL as e:
        raise corrupt(what, f"{type(e).__name__}: {_one_line(e)}", then) from None


def memory_cap() -> int:
    """The largest buffer a decoder may allocate: this machine's physical memory (a claim beyond
    it cannot be a snapshot that was written here, nor one that can be restored here)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return 1 << 40


def check_alloc(n: object, what: str, then: str) -> int:
    """``n`` as a size to allocate for ``what``: SnapshotCorruptError unless it is an int from 0
    to :func:`memory_cap`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise corrupt(what, f"size {n!r} is not a non-negative integer", then)
    cap = memory_cap()
    if n > cap:
        raise corrupt(what, f"it claims {n} bytes, more than this machine's {cap} bytes of memory", then)
    return n


def alloc(n: object, what: str, then: str) -> bytearray:
    """A zeroed buffer of ``n`` bytes for ``what``, checked first (:func:`check_alloc`); a
    MemoryError becomes SnapshotCorruptError too (the decoder's callers fall back)."""
    size = check_alloc(n, what, then)
    try:
        return bytearray(size)
    except MemoryError:
        raise corrupt(what, f"{size} bytes cannot be allocated (MemoryError)", then) from None


def load_json(raw: bytes | bytearray | memoryview, what: str, then: str, *, max_bytes: int) -> Any:
    """The JSON document in ``raw`` (UTF-8), parsed only when it is at most ``max_bytes`` long;
    SnapshotCorruptError for anything that is not such a document."""
    if len(raw) > max_bytes:
        raise corrupt(what, f"{len(raw)} bytes, more than the {max_bytes} a valid one can have", then)
    with decoding(what, then):
        return json.loads(bytes(raw))


def _entry(raw: object, i: int, data_len: int) -> TensorEntry | str:
    """Tensor entry ``i`` of a meta, checked against the data's length (its dtype exists, its
    shape has the entry's byte size, it lies inside the data at an offset its dtype can be
    viewed at), or what is wrong with it."""
    try:
        e = TensorEntry.from_json(raw)
    except SnapshotCorruptError as err:
        return str(err)
    import torch  # here: the codec uses this module and does not need torch

    dt = getattr(torch, e.dtype, None)
    if not isinstance(dt, torch.dtype):
        return f"tensor entry {i} has an unknown dtype {_one_line(repr(e.dtype))}"
    itemsize = dt.itemsize
    if e.nbytes != math.prod(e.shape) * itemsize:
        return f"tensor entry {i}: {e.nbytes} bytes is not a {e.dtype} tensor of shape {list(e.shape)}"
    if e.offset % itemsize or e.offset + e.nbytes > data_len:
        return (
            f"tensor entry {i} at [{e.offset}, +{e.nbytes}) does not fit in the {data_len}-byte data "
            f"at a multiple of {itemsize}"
        )
    return e


def parse_meta(
    meta: bytes | bytearray | memoryview, data_len: int, what: str, then: str
) -> tuple[Any, list[TensorEntry]]:
    """``(tree, entries)`` of a snapshot meta whose data is ``data_len`` bytes long, every
    entry checked (dtype, shape against byte size, inside the data); SnapshotCorruptError
    naming ``what`` otherwise. The tree is not checked here: :func:`~.flatten.unflatten_state`
    checks what it walks."""
    doc = load_json(meta, what, then, max_bytes=MAX_META_BYTES)
    if not isinstance(doc, dict) or "tree" not in doc or not isinstance(doc.get("tensors"), list):
        raise corrupt(what, 'it is not an object with "tree" and "tensors"', then)
    entries = []
    with decoding(what, then):
        for i, raw in enumerate(doc["tensors"]):
            e = _entry(raw, i, data_len)
            if isinstance(e, str):
                raise corrupt(what, e, then)
            entries.append(e)
    return doc["tree"], entries
