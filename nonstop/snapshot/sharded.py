"""DTensor state in snapshots: a rank keeps its own local shard, plus what places it in the whole.

A sharded model (FSDP2, HSDP, tensor parallel) holds its parameters and optimizer state as
``DTensor`` s. A snapshot stores each one as its **local tensor** (the bytes this rank owns) and, in
the snapshot's JSON tree, the metadata that places it: the global shape and stride, the local
shard's offset in the global tensor, the placements (``Shard(dim=0)``, ``Replicate()``,
``_StridedShard(dim=0, sf=2)``: their ``repr``) and the mesh's shape and dim names. Reading needs no
process group: a snapshot's DTensor reads back as a :class:`LocalShard`. Restoring copies a
LocalShard into the live DTensor's local tensor (checked: same placements, same local shape), or,
for optimizer state a fresh rank does not have yet, makes the DTensor on the live parameter's mesh
(:func:`to_dtensor`). :func:`stitch` assembles the global tensor from every rank's shards;
:func:`reshard` cuts one rank's shard of another layout out of them (the basis of resuming on
another mesh; :func:`shard_layout` is DTensor's placement rule, pure).

Encoding in the tree (JSON, no pickle)::

    {"__dt__": <tensor index>, "shape": [..], "stride": [..], "offset": [..] | null,
     "placements": ["Shard(dim=0)", ...], "mesh": [..], "dims": [..] | null}

A snapshot's nodes of the same layout share it (:mod:`.flatten`): the first one in the tree's
order also holds ``"__dm__": k``, the others only ``{"__dt__": i, "__dr__": k}`` -- a model's
layers repeat a handful of layouts, and their JSON was most of a snapshot's metadata, written
every step. Nodes without either (snapshots before this) hold their own fields.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nonstop.errors import SnapshotCorruptError, SnapshotError
from nonstop.placements import order as _order
from nonstop.placements import shard_layout

__all__ = [
    "iter_local_shards",
    "DT_DEF",
    "DT_KEY",
    "DT_REF",
    "LocalShard",
    "decode_dtensor",
    "encode_dtensor",
    "is_dtensor",
    "local_of",
    "replicated_along",
    "reshard",
    "same_mesh",
    "shard_layout",
    "stitch",
    "to_dtensor",
]

DT_KEY = "__dt__"
DT_DEF = "__dm__"  # this node's layout is layout k of the snapshot (its fields are here)
DT_REF = "__dr__"  # this node has layout k, defined by an earlier node


_DTENSOR: type | None = None  # torch.distributed.tensor.DTensor, imported on first need


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it on a plain path).
    Called for every tensor of every snapshot: no import statement on the way."""
    global _DTENSOR
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor):
        return False
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return isinstance(t, _DTENSOR)


@dataclass(frozen=True, kw_only=True)
class LocalShard:
    """One rank's part of a DTensor, as a snapshot holds it (see the module docstring)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    offset: tuple[int, ...] | None  # where ``tensor`` starts in the global tensor (None: unknown)
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...] | None

    def describe(self) -> str:
        return (
            f"local {tuple(self.tensor.shape)} of global {self.global_shape}, "
            f"placements {list(self.placements)} on mesh {self.mesh_shape}"
        )


def iter_local_shards(obj: Any) -> Iterator[LocalShard]:
    """Every :class:`LocalShard` in a decoded state tree (dicts, lists, tuples), in tree order."""
    if isinstance(obj, LocalShard):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_local_shards(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from iter_local_shards(v)


# (id(mesh), this rank's coordinate on it, shape, stride, placements) -> (the mesh, kept alive so
# its id is not reused; the node's metadata). A snapshot is taken every step of the same tensors:
# the placement metadata is computed once (torch's mesh and offset helpers cost ~0.1 ms per
# tensor). The coordinate is in the key because a mesh object can change it: DTensor's cache
# hands a rebuilt model an older mesh object of a generation, which is then given the new
# generation's state (train/prewarm.py) -- a renumbered rank's offsets are not its old ones.
_META: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}
_META_MAX = 65536
# id(DTensor) -> (a weak reference to it, its spec object, its metadata): the same DTensor
# objects (parameters, optimizer moments) come back every step, and while one still holds the
# same spec object its metadata is the same; this skips even building the key above (~3 us).
_BY_OBJECT: dict[int, tuple[Any, Any, dict[str, Any]]] = {}


def encode_dtensor(t: Any) -> tuple[dict[str, Any], torch.Tensor]:
    """The layout fields of DTensor ``t``'s tree node (a cached object, the same one for every
    DTensor of that layout: never change it), and its local tensor."""
    spec = getattr(t, "_spec", None)
    seen = _BY_OBJECT.get(id(t)) if spec is not None else None
    if seen is not None and seen[1] is spec and seen[0]() is t:
        meta = seen[2]
    else:
        meta = _meta_of(t)
        if spec is not None:
            if len(_BY_OBJECT) >= _META_MAX:
                _BY_OBJECT.clear()
            _BY_OBJECT[id(t)] = (weakref.ref(t), spec, meta)
    local = local_of(t)
    return meta, (local.detach() if local.requires_grad else local)


def _meta_of(t: Any) -> dict[str, Any]:
    """The placement metadata of DTensor ``t`` (cached by mesh, shape, stride and placements)."""
    mesh = t.device_mesh
    placements = tuple(t.placements)
    key = (id(mesh), tuple(mesh.get_coordinate() or ()), tuple(t.shape), tuple(t.stride()), placements)
    hit = _META.get(key)
    if hit is None:
        if len(_META) >= _META_MAX:
            _META.clear()
        meta = {
            "shape": list(t.shape),
            "stride": list(t.stride()),
            "offset": _offset(t),
            "placements": [repr(p) for p in placements],
            "mesh": list(mesh.shape),
            "dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names is not None else None,
        }
        hit = _META[key] = (mesh, meta)
    return hit[1]


def replicated_along(tensors: Iterator[Any] | list[Any], dim: str) -> bool:
    """Whether every one of ``tensors`` is a DTensor replicated along the mesh dim named ``dim``
    (``Replicate()`` there: HSDP's replicate dim), so that ranks differing only in that
    coordinate hold the same local shards. False for none, for a plain tensor (nothing keeps
    it alike across the dim), a mesh without ``dim``, or one sharded along it (a 1-D mesh named
    ``replicate`` given to ``fully_shard`` shards along it)."""
    seen = False
    for t in tensors:
        if not is_dtensor(t):
            return False
        names = t.device_mesh.mesh_dim_names
        if names is None or dim not in names:
            return False
        if not t.placements[list(names).index(dim)].is_replicate():
            return False
        seen = True
    return seen


def local_of(t: Any) -> torch.Tensor:
    """A DTensor's local tensor. ``to_local()`` goes through an autograd function (~10 us a call,
    every tensor of every snapshot); the attribute it returns is read directly when present."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


def _offset(t: Any) -> list[int] | None:
    """The local shard's global offset. torch computes it in ``compute_local_shape_and_global_offset``
    (``torch.distributed.tensor._utils``, not public API): if it moves, the offset is left out and
    only :func:`stitch` (which needs it) refuses such a snapshot."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - a torch that moved it
        return None
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return [int(o) for o in offset]


def _ints(v: object, what: str, *, allow_none: bool = False) -> tuple[int, ...] | None:
    if v is None and allow_none:
        return None
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise SnapshotCorruptError(f"a sharded tensor's record in the snapshot is malformed: bad {what}")
    return tuple(v)


def _strs(v: object, what: str, *, allow_none: bool = False) -> tuple[str, ...] | None:
    if v is None and allow_none:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise SnapshotCorruptError(f"a sharded tensor's record in the snapshot is malformed: bad {what}")
    return tuple(v)


def decode_dtensor(node: dict[str, Any], tensors: list[torch.Tensor]) -> LocalShard:
    """The :class:`LocalShard` a snapshot tree's DTensor ``node`` describes (see the module
    docstring), its tensor taken from ``tensors``. The node may come from untrusted bytes:
    SnapshotCorruptError unless every field has its type (a tensor index in range, lists of
    ints and strings of matching lengths, sizes non-negative)."""
    if not isinstance(node, dict):
        raise SnapshotCorruptError("a sharded tensor's record in the snapshot is not an object")
    index = node.get(DT_KEY)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tensors):
        raise SnapshotCorruptError(
            f"a sharded tensor's record names tensor {index!r}; the snapshot holds {len(tensors)}"
        )
    shape = _ints(node.get("shape"), "shape")
    stride = _ints(node.get("stride"), "stride")
    offset = _ints(node.get("offset"), "offset", allow_none=True)
    placements = _strs(node.get("placements"), "placements")
    mesh = _ints(node.get("mesh"), "mesh")
    dims = _strs(node.get("dims"), "dims", allow_none=True)
    assert shape is not None and stride is not None and placements is not None and mesh is not None
    if (
        len(stride) != len(shape)
        or (offset is not None and len(offset) != len(shape))
        or len(placements) != len(mesh)
        or (dims is not None and len(dims) != len(mesh))
        or min((*shape, *mesh, *(offset or ())), default=0) < 0
    ):
        raise SnapshotCorruptError(
            "a sharded tensor's record in the snapshot is malformed: its shape, stride, offset, "
            "placements, mesh and dims do not fit together"
        )
    return LocalShard(
        tensor=tensors[index],
        global_shape=shape,
        global_stride=stride,
        offset=offset,
        placements=placements,
        mesh_shape=mesh,
        mesh_dims=dims,
    )


def same_mesh(live: tuple[int, ...], saved: tuple[int, ...], placements: tuple[str, ...]) -> bool:
    """Whether a shard saved on mesh ``saved`` is the local tensor of the same place on mesh
    ``live``: the meshes are equal except, maybe, along dims the tensor is replicated on (an
    elastic sharded job with fewer replica groups: a rank's own shards are unchanged)."""
    if len(live) != len(saved) or len(placements) != len(live):
        return False
    return all(a == b or p.startswith("Replicate") for a, b, p in zip(live, saved, placements, strict=True))


def check_matches(live: Any, saved: LocalShard, where: str) -> None:
    """Refuse to restore ``saved`` into the live DTensor ``live`` unless they are laid out alike."""
    mine = tuple(repr(p) for p in live.placements)
    local = live.to_local()
    if (
        mine != saved.placements
        or tuple(live.shape) != saved.global_shape
        or tuple(local.shape) != tuple(saved.tensor.shape)
        or not same_mesh(tuple(live.device_mesh.shape), saved.mesh_shape, mine)
    ):
        raise SnapshotError(
            f"cannot restore {where}: the snapshot holds {saved.describe()}, the model has local "
            f"{tuple(local.shape)} of global {tuple(live.shape)}, placements {list(mine)} on mesh "
            f"{tuple(live.device_mesh.shape)}; restore onto the mesh the snapshot was taken on"
        )
    if saved.tensor.dtype != local.dtype:
        raise SnapshotError(f"cannot restore {where}: dtype {saved.tensor.dtype} into {local.dtype}")


def copy_into(live: Any, saved: LocalShard, where: str) -> None:
    """Copy ``saved`` into the live DTensor's local tensor, in place (checked first)."""
    check_matches(live, saved, where)
    with torch.no_grad():
        live.to_local().copy_(saved.tensor)


def to_dtensor(saved: LocalShard, like: Any, where: str) -> Any:
    """A new DTensor holding a copy of ``saved`` on the mesh of ``like`` (a live DTensor: the
    parameter an optimizer state tensor belongs to), with the saved placements."""
    from torch.distributed.tensor import DTensor

    mine = tuple(repr(p) for p in like.placements)
    if mine != saved.placements or not same_mesh(tuple(like.device_mesh.shape), saved.mesh_shape, mine):
        raise SnapshotError(
            f"cannot restore {where}: the snapshot holds {saved.describe()}, its parameter has "
            f"placements {list(mine)} on mesh {tuple(like.device_mesh.shape)}"
        )
    return DTensor.from_local(
        saved.tensor.clone(),
        device_mesh=like.device_mesh,
        placements=like.placements,
        run_check=False,
        shape=torch.Size(saved.global_shape),
        stride=saved.global_stride,
    )


def stitch(shards: list[LocalShard]) -> torch.Tensor:
    """The global tensor assembled from every rank's :class:`LocalShard` by their offsets.

    Replicated copies may overlap (they must then be equal); together the shards must cover every
    element exactly, else :class:`SnapshotError` says what is missing."""
    first = _checked(shards)
    return _assemble(shards, first.global_shape, (0,) * len(first.global_shape), "stitch")


def _checked(shards: list[LocalShard]) -> LocalShard:
    """The first shard, once every shard is known to be a piece of the same tensor with an offset."""
    if not shards:
        raise SnapshotError("stitch: no shards given")
    first = shards[0]
    for sh in shards:
        if sh.global_shape != first.global_shape or sh.tensor.dtype != first.tensor.dtype:
            raise SnapshotError(
                f"stitch: shards of different tensors ({sh.describe()} vs {first.describe()})"
            )
        if sh.offset is None:
            raise SnapshotError("stitch: a shard has no recorded offset (written by a torch without it)")
        _order(sh.placements, sh.mesh_shape)  # a strided shard must be one contiguous piece
    return first


def _assemble(
    shards: list[LocalShard], shape: tuple[int, ...], offset: tuple[int, ...], what: str
) -> torch.Tensor:
    """The region ``shape`` at global ``offset`` of the tensor the (checked) ``shards`` are pieces
    of: each shard's overlap with it copied in, nothing else touched (a new rank's slice costs its
    own size, not the whole tensor's). Overlapping replicas must agree; the region must be covered."""
    out = torch.empty(shape, dtype=shards[0].tensor.dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for sh in shards:
        assert sh.offset is not None
        lo = [max(a, b) for a, b in zip(sh.offset, offset, strict=True)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(sh.offset, sh.tensor.shape, offset, shape, strict=True)]
        if sh.tensor.numel() == 0 or any(low >= high for low, high in zip(lo, hi, strict=True)):
            continue
        src = sh.tensor[
            tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, sh.offset, strict=True))
        ]
        dst = tuple(slice(low - b, high - b) for low, high, b in zip(lo, hi, offset, strict=True))
        seen = covered[dst]
        if seen.any() and not torch.equal(out[dst][seen], src[seen]):
            raise SnapshotError(f"{what}: overlapping shards disagree (replicas are not equal)")
        out[dst].copy_(src)
        covered[dst] = True
    if not bool(covered.all()):
        missing = math.prod(shape) - int(covered.sum())
        raise SnapshotError(f"{what}: the shards leave {missing} of {math.prod(shape)} elements uncovered")
    return out


def reshard(
    shards: list[LocalShard], placements: tuple[str, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...]
) -> torch.Tensor:
    """The local tensor of the rank at ``coord`` of a new layout (``placements`` on ``mesh_shape``),
    cut from every old rank's :class:`LocalShard` of one tensor: the slice :func:`shard_layout`
    gives, assembled from the old shards' overlaps with it only (as :func:`stitch` would, without
    building the whole tensor). The old and new layouts may differ in everything but the global
    shape."""
    first = _checked(shards)
    shape, offset = shard_layout(first.global_shape, placements, mesh_shape, coord)
    return _assemble(shards, shape, offset, "reshard")
