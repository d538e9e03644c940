"""Where a state's tensors lie in a slot's data area: packed in order, each 64-byte aligned.

:class:`LayoutCache` keeps the layout of the last list of tensors it was given and recomputes it
only when their dtypes or shapes change (a store writes the same layout every step);
:func:`pack` lays out entries that are already known (a composed snapshot's, see
:mod:`nonstop.snapshot.split`) exactly as the cache lays out their tensors, so a state gives the
same bytes whichever way it was written.
"""

from __future__ import annotations

import hashlib
import itertools
import json

import torch

from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.slot import align

__all__ = ["LayoutCache", "data_len", "pack"]

_PLAN_IDS = itertools.count(1)  # unique across caches: a slot may take layouts of several


def pack(specs: list[tuple[str, tuple[int, ...], int]]) -> list[TensorEntry]:
    """Entries for tensors given as (dtype name, shape, nbytes), in order, each aligned."""
    entries, off = [], 0
    for dtype, shape, nbytes in specs:
        entries.append(TensorEntry(dtype=dtype, shape=shape, offset=off, nbytes=nbytes))
        off = align(off + nbytes)
    return entries


def data_len(entries: list[TensorEntry]) -> int:
    """Bytes of data ``entries`` span (the last one's end)."""
    return entries[-1].offset + entries[-1].nbytes if entries else 0


class LayoutCache:
    """The layout of a list of tensors, recomputed only when their dtypes or shapes change.

    ``plan_id`` changes with every new layout (slots cache their destination views per id);
    ``json`` is the entries as a snapshot meta lists them, ``key`` a digest of it."""

    def __init__(self) -> None:
        self._key: tuple[tuple[torch.dtype, torch.Size], ...] | None = None
        self.entries: list[TensorEntry] = []
        self.json = "[]"
        self.key = ""  # a digest of ``json``: two writers of one layout have the same key
        self.plan_id = 0

    def of(self, tensors: list[torch.Tensor]) -> list[TensorEntry]:
        key = tuple((t.dtype, t.shape) for t in tensors)
        if key != self._key:
            specs = [
                (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
                for t in tensors
            ]
            self.entries = pack(specs)
            self._key = key
            self.json = json.dumps([e.to_json() for e in self.entries], separators=(",", ":"))
            self.key = hashlib.blake2b(self.json.encode(), digest_size=8).hexdigest()
            self.plan_id = next(_PLAN_IDS)
        return self.entries
