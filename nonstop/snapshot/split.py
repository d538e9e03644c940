"""A rank's snapshot split between its own slot and its node's shared write.

With a :class:`~nonstop.snapshot.nodecopy.NodeCopy`, a rank's slot holds its own tensors and a
meta whose entries address a *virtual* data area: the rank's own data, then, from ``base`` on,
the shared write's data. The meta says so first::

    {"shared":[gen,step,base(,group)],"tree":...,"tensors":[...]}

(:func:`encode_meta`; :func:`ref_of` reads the reference from the meta's first bytes without
parsing the rest). A rank's snapshot read from its slots (:func:`decode_split`) is that state
exactly; copied out (:func:`compose`) it is the snapshot the rank would have written whole --
the same meta and data bytes, laid out by :func:`~nonstop.snapshot.layout.pack` -- so every
reader of raw snapshots (persister, replicator, data plane) and every later tier sees one format.

Every decoder here keeps :mod:`nonstop.snapshot.validate`'s rules: one error
(SnapshotCorruptError), checks before copies.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotCorruptError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.flatten import unflatten_state
from nonstop.snapshot.layout import data_len, pack
from nonstop.snapshot.nodecopy import SharedRef
from nonstop.snapshot.slot import dtype_from_name
from nonstop.snapshot.validate import corrupt, decoding, parse_meta

__all__ = ["REF_HEAD", "compose", "decode_split", "encode_meta", "ref_of", "virtual_entries"]

_REF = re.compile(rb'^\{"shared":\[(\d{1,18}),(\d{1,18}),(\d{1,18})(?:,(\d{1,6}))?\],')
REF_HEAD = 96  # the bytes of a meta that hold its reference, at most


def encode_meta(ref: SharedRef | None, tree_json: str, tensors_json: str) -> bytes:
    """A rank slot's meta: ``ref`` first when part of the snapshot is in the shared write (its
    copy group last, left out when 0: a DDP job's metas read as before groups existed)."""
    if ref is None:
        head = "{"
    else:
        group = f",{ref.group}" if ref.group else ""
        head = f'{{"shared":[{ref.gen},{ref.step},{ref.base}{group}],'
    return (head + '"tree":' + tree_json + ',"tensors":' + tensors_json + "}").encode()


def ref_of(meta: bytes | memoryview) -> SharedRef | None:
    """The shared write a rank slot's meta refers to; None for a whole snapshot (or a meta
    that is not a split one: its parse then fails as any corrupt meta does)."""
    m = _REF.match(bytes(meta[:REF_HEAD]))
    return None if m is None else SharedRef(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 0))


def virtual_entries(
    local: list[TensorEntry], shared: list[TensorEntry], in_shared: list[bool], base: int
) -> list[TensorEntry]:
    """The entries of every tensor, in the state's order, shared ones moved by ``base``."""
    li, si, out = iter(local), iter(shared), []
    for s in in_shared:
        if s:
            e = next(si)
            out.append(TensorEntry(dtype=e.dtype, shape=e.shape, offset=e.offset + base, nbytes=e.nbytes))
        else:
            out.append(next(li))
    return out


def _parse(
    meta: bytes, local_len: int, shared_len: int, what: str, then: str
) -> tuple[Any, list[TensorEntry], int]:
    ref = ref_of(meta)
    if ref is None:
        raise corrupt(what, "its meta names no shared write", then)
    if ref.base < local_len:
        raise corrupt(what, f"its shared data starts at {ref.base}, inside its own {local_len} bytes", then)
    tree, entries = parse_meta(meta, ref.base + shared_len, what, then)
    for i, e in enumerate(entries):
        if e.offset < ref.base and e.offset + e.nbytes > local_len:
            raise corrupt(what, f"tensor {i} does not lie in its own data", then)
    return tree, entries, ref.base


def decode_split(
    meta: bytes,
    local: torch.Tensor,
    local_len: int,
    shared: torch.Tensor,
    shared_len: int,
    what: str,
    copy: bool = True,
) -> Any:
    """The state a split snapshot holds: its own data ``local`` (uint8, ``local_len`` bytes in
    use) and the shared write's ``shared``; tensors copied, or views (``copy=False``: valid until
    either slot is written again -- the shared one by any rank of the node, which none does while
    a recovery's ranks restore: each waits for all of them in the new group before its next
    step). SnapshotCorruptError naming ``what``."""
    then = "it is not restored"
    tree, entries, base = _parse(meta, local_len, shared_len, f"{what} (its meta)", then)
    with decoding(what, then):
        tensors = []
        for e in entries:
            src, off = (local, e.offset) if e.offset < base else (shared, e.offset - base)
            view = src[off : off + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)
            tensors.append(view.clone() if copy else view)
        try:
            return unflatten_state(tree, tensors)
        except SnapshotCorruptError as err:
            raise SnapshotCorruptError(f"{what}: {err}") from None


def compose(
    meta: bytes,
    local: np.ndarray,
    shared: np.ndarray,
    what: str,
    out: np.ndarray | None = None,
) -> tuple[bytes, np.ndarray]:
    """The whole snapshot (meta, data) of a split one: its own bytes ``local`` and the shared
    write's ``shared`` (uint8 arrays of their data lengths), laid out as a whole write lays them
    out (padding zeroed). ``out`` is reused for the data when large enough."""
    then = "it is not used"
    tree, entries, base = _parse(meta, len(local), len(shared), f"{what} (its meta)", then)
    whole = pack([(e.dtype, e.shape, e.nbytes) for e in entries])
    total = data_len(whole)
    data = out[:total] if out is not None and out.size >= total else np.empty(total, dtype=np.uint8)
    end = 0
    with decoding(what, then):
        for e, w in zip(entries, whole, strict=True):
            data[end : w.offset] = 0
            src, off = (local, e.offset) if e.offset < base else (shared, e.offset - base)
            np.copyto(data[w.offset : w.offset + w.nbytes], src[off : off + e.nbytes])
            end = w.offset + w.nbytes
        tree_json = json.dumps(tree, separators=(",", ":"), check_circular=False)
    tensors_json = json.dumps([w.to_json() for w in whole], separators=(",", ":"))
    return encode_meta(None, tree_json, tensors_json), data
