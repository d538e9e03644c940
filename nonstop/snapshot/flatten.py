"""Split a nested training state into a JSON tree plus a flat list of tensors.

The tree keeps dicts, lists, tuples, strings, numbers, bools and None; every
tensor is replaced by ``{"__t__": index}``. Non-string dict keys (optimizer
state is keyed by int) and tuples are encoded so :func:`unflatten_state` returns
exactly the structure it was given. NumPy arrays and scalars are converted to
tensors / Python numbers. No pickle is involved in either direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from nonstop.errors import SnapshotCorruptError, SnapshotError
from nonstop.snapshot.sharded import DT_KEY, decode_dtensor, encode_dtensor, is_dtensor
from nonstop.snapshot.validate import decoding

__all__ = ["flatten_state", "tensor_at", "unflatten_state"]

_T = "__t__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_NDARRAY = "__nd__"
_Item = TypeVar("_Item")


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Return ``(tree, tensors)``; the tree is JSON-serialisable.

    Tensors are returned as they are (no copy): the caller copies them.
    """
    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: str) -> Any:
        if is_dtensor(obj):  # its local shard, and the metadata that places it (snapshot/sharded.py)
            node, local = encode_dtensor(obj, len(tensors))
            tensors.append(local)
            return node
        if isinstance(obj, torch.Tensor):
            tensors.append(obj.detach())
            return {_T: len(tensors) - 1}
        if isinstance(obj, np.ndarray):
            tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
            return {_NDARRAY: len(tensors) - 1}
        if isinstance(obj, np.generic):
            return obj.item()
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: walk(v, f"{path}.{k}") for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise SnapshotError(f"unsupported dict key type {type(k).__name__} at {path}")
                items.append([k, walk(v, f"{path}.{k}")])
            return {_DICT: items}
        if isinstance(obj, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        raise SnapshotError(
            f"cannot snapshot a value of type {type(obj).__name__} at {path or '<root>'}: "
            "use tensors, numbers, strings, lists, tuples and dicts"
        )

    return walk(state, ""), tensors


def tensor_at(tensors: Sequence[_Item], index: object) -> _Item:
    """``tensors[index]`` for an index read from a snapshot's tree: SnapshotCorruptError unless
    it is an int in range (a negative index would silently pick another tensor)."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tensors):
        raise SnapshotCorruptError(
            f"snapshot tree names tensor {str(index)[:40]} but the snapshot holds {len(tensors)} tensors"
        )
    return tensors[index]


def unflatten_state(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state` given the (restored) tensor list.

    The tree may come from untrusted bytes: anything :func:`flatten_state` cannot have produced
    (a tensor index out of range, a malformed tuple or dict record, nesting too deep) raises
    SnapshotCorruptError."""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if _T in obj:
                return tensor_at(tensors, obj[_T])
            if DT_KEY in obj:
                return decode_dtensor(obj, tensors)
            if _NDARRAY in obj:
                return tensor_at(tensors, obj[_NDARRAY]).numpy()
            if _TUPLE in obj:
                return tuple(walk(v) for v in obj[_TUPLE])
            if _DICT in obj:
                return {k: walk(v) for k, v in obj[_DICT]}
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    with decoding("snapshot tree", "the snapshot is not restored"):
        return walk(tree)
