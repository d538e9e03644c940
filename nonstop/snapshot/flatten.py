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
from nonstop.snapshot.sharded import DT_DEF, DT_KEY, DT_REF, decode_dtensor, encode_dtensor, is_dtensor
from nonstop.snapshot.validate import decoding

__all__ = ["flatten_state", "tensor_at", "unflatten_state"]

_T = "__t__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_NDARRAY = "__nd__"
_Item = TypeVar("_Item")


def flatten_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Return ``(tree, tensors)``; the tree is JSON-serialisable.

    Tensors are returned as they are (no copy; one that requires grad detached): the caller
    copies them. This runs on every snapshot (every step): the walk builds no path; a value it
    cannot keep is located afterwards, for the error message only.
    """
    tensors: list[torch.Tensor] = []
    plain = (bool, int, float, str)
    layouts: dict[int, int] = {}  # id(layout fields) -> k: a DTensor node's layout, defined once
    held: list[Any] = []  # those fields, alive until the walk ends (their ids stay theirs)

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):  # first: most leaves of a training state are tensors
            if type(obj) is not torch.Tensor and is_dtensor(obj):  # its local shard, and the
                fields, local = encode_dtensor(obj)  # metadata that places it (snapshot/sharded.py)
                tensors.append(local)
                k = layouts.get(id(fields))
                if k is not None:
                    return {DT_KEY: len(tensors) - 1, DT_REF: k}
                k = layouts[id(fields)] = len(held)
                held.append(fields)
                return {DT_KEY: len(tensors) - 1, DT_DEF: k, **fields}
            tensors.append(obj.detach() if obj.requires_grad else obj)  # a parameter: off the graph
            return {_T: len(tensors) - 1}
        if obj is None or isinstance(obj, plain):
            return obj
        if isinstance(obj, dict):
            for k in obj:
                if type(k) is not str or k.startswith("__"):
                    break
            else:  # string keys only, none of ours: the dict as it is
                return {k: walk(v) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise _Unsupported(k, key=True)
                items.append([k, walk(v)])
            return {_DICT: items}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return {_TUPLE: [walk(v) for v in obj]}
        if isinstance(obj, np.ndarray):
            tensors.append(torch.from_numpy(np.ascontiguousarray(obj)))
            return {_NDARRAY: len(tensors) - 1}
        if isinstance(obj, np.generic):
            return obj.item()
        raise _Unsupported(obj)

    try:
        return walk(state), tensors
    except _Unsupported as e:
        path = _path_to(state, e.value, key=e.key) or "<root>"
        if e.key:
            raise SnapshotError(f"unsupported dict key type {type(e.value).__name__} at {path}") from None
        raise SnapshotError(
            f"cannot snapshot a value of type {type(e.value).__name__} at {path}: "
            "use tensors, numbers, strings, lists, tuples and dicts"
        ) from None


class _Unsupported(Exception):
    def __init__(self, value: Any, *, key: bool = False) -> None:
        super().__init__()
        self.value, self.key = value, key


def _path_to(obj: Any, target: Any, *, key: bool, path: str = "") -> str | None:
    """Where in ``obj`` the value (or, ``key``: the dict key) ``target`` is, as ``.a.b[2]``."""
    if isinstance(obj, dict):
        children = [(f"{path}.{k}", k, v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", None, v) for i, v in enumerate(obj)]
    else:
        return None
    for where, k, v in children:
        if key and k is target:
            return path
        if not key and v is target:
            return where
        found = _path_to(v, target, key=key, path=where)
        if found is not None:
            return found
    return None


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
    layouts: dict[int, dict[str, Any]] = {}  # a DTensor layout k -> the node that defined it

    def dtensor(obj: dict[str, Any]) -> Any:
        if DT_REF in obj:
            k = obj[DT_REF]
            fields = layouts.get(k) if type(k) is int else None
            if fields is None:
                raise SnapshotCorruptError(
                    f"a sharded tensor's record names layout {str(k)[:20]}, which no earlier record defines"
                )
            return decode_dtensor({**fields, DT_KEY: obj[DT_KEY]}, tensors)
        shard = decode_dtensor(obj, tensors)
        if DT_DEF in obj:
            if type(obj[DT_DEF]) is not int:
                raise SnapshotCorruptError("a sharded tensor's record defines a layout that is not a number")
            layouts[obj[DT_DEF]] = obj
        return shard

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if _T in obj:
                return tensor_at(tensors, obj[_T])
            if DT_KEY in obj:
                return dtensor(obj)
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
