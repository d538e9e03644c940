"""A snapshot as bytes: a stable private copy of one slot, and decoding a raw snapshot.

:class:`RawSnapshot` is what :meth:`~nonstop.snapshot.store.RankSnapshotStore.copy_out` returns
(its meta JSON and data bytes, parsed lazily and checked against each other);
:func:`decode_raw` and :func:`decode_state` turn meta + data back into the state the snapshot
holds (tensors copied or views). Every problem with the bytes is a SnapshotCorruptError.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotCorruptError
from nonstop.snapshot.api import TensorEntry
from nonstop.snapshot.flatten import unflatten_state
from nonstop.snapshot.nodecopy import SharedRef
from nonstop.snapshot.slot import dtype_from_name
from nonstop.snapshot.validate import decoding, parse_meta

__all__ = ["RawSnapshot", "decode_raw", "decode_state"]


class RawSnapshot:
    """A stable private copy of one slot (``RankSnapshotStore.copy_out``).

    Its meta is parsed on first use and checked against the data (:func:`.validate.parse_meta`):
    :attr:`doc` and :meth:`entries` raise SnapshotCorruptError when it is corrupt."""

    def __init__(
        self,
        *,
        rank: int,
        step: int,
        meta: bytes,
        data: np.ndarray,
        written_at: float,
        shared: SharedRef | None = None,
        shared_len: int = 0,
    ) -> None:
        """``shared``: the rank's own part of a split snapshot (``copy_out(split=True)``): ``data``
        is its own bytes, ``meta`` the split meta, and the rest is the node's shared write
        ``shared`` names, ``shared_len`` bytes (:mod:`nonstop.snapshot.split`)."""
        self.rank, self.step, self.meta, self.data, self.written_at = rank, step, meta, data, written_at
        self.shared, self.shared_len = shared, shared_len

    @functools.cached_property
    def _parsed(self) -> tuple[Any, list[TensorEntry]]:
        what = f"rank {self.rank}'s snapshot of step {self.step} (its meta)"
        span = len(self.data) if self.shared is None else self.shared.base + self.shared_len
        return parse_meta(self.meta, span, what, "it is not used")

    def shared_entries(self) -> list[TensorEntry]:
        """A split snapshot's entries in the shared write's data (offsets there); [] when whole."""
        if self.shared is None:
            return []
        base = self.shared.base
        return [
            TensorEntry(dtype=e.dtype, shape=e.shape, offset=e.offset - base, nbytes=e.nbytes)
            for e in self._parsed[1]
            if e.offset >= base
        ]

    @property
    def doc(self) -> dict[str, Any]:
        """The meta, parsed once: ``{"tree": ..., "tensors": [...]}``."""
        tree, entries = self._parsed
        return {"tree": tree, "tensors": [e.to_json() for e in entries]}

    def entries(self) -> list[TensorEntry]:
        """The entries of ``data`` (a split snapshot's own ones, in the order of its state)."""
        if self.shared is None:
            return self._parsed[1]
        return sorted((e for e in self._parsed[1] if e.offset < self.shared.base), key=lambda e: e.offset)


def decode_raw(meta: bytes, data: bytes | bytearray) -> Any:
    """The state a snapshot's raw form holds (its meta JSON and data bytes, e.g. one rank of a
    durable checkpoint: ``DurableStore.load_rank``); tensors are views of ``data``.
    SnapshotCorruptError, whatever the bytes, unless they are a snapshot's."""
    buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return decode_state(meta, buf, len(data), "a raw snapshot", copy=False)


def decode_state(meta: bytes, data: torch.Tensor, data_len: int, what: str, copy: bool) -> Any:
    """The state that ``meta`` describes over the first ``data_len`` bytes of ``data`` (uint8),
    tensors copied or views; SnapshotCorruptError naming ``what`` when the meta does not decode
    against the data."""
    then = "it is not restored"
    tree, entries = parse_meta(meta, data_len, f"{what} (its meta)", then)
    with decoding(what, then):
        tensors = []
        for e in entries:
            view = data[e.offset : e.offset + e.nbytes].view(dtype_from_name(e.dtype)).view(e.shape)
            tensors.append(view.clone() if copy else view)
        try:
            return unflatten_state(tree, tensors)
        except SnapshotCorruptError as err:
            raise SnapshotCorruptError(f"{what}: {err}") from None
