"""Which old ranks' shards the ranks of a resharded generation need -- so a node fetches only those.

A sharded job without replicas that shrinks or grows reshards: every new rank cuts its local
shards out of the old ranks' snapshots of one step (:func:`~nonstop.snapshot.sharded.reshard`).
A new rank's slice of a tensor overlaps only the few old ranks' slices around it (for the demo
GPT at 64 to 1,024 ranks, 3 to 9 old ranks per new rank over all its tensors:
``benchmarks/bench_reshard_plan.py``), so its node needs only those old ranks' steps in memory,
not every old rank's. This module works that out, pure and without torch, from:

* the job's **layouts** -- each distinct DTensor of the model (its global shape, placements and
  mesh dim names; the optimizer's moments share their parameters'), which rank 0 reports when it
  joins a generation (:func:`layouts_of`, carried by its ``ready`` message);
* the old and new :class:`~nonstop.mesh.MeshSpec` (the job's mesh at the two world sizes);
* the new ranks a node plays.

:func:`needed_old_ranks` also counts old rank ``r mod W_old`` for every new rank ``r``: what is not
sharded (plain tensors, optimizer scalars, RNG, extras) comes from it
(:func:`~nonstop.snapshot.capture.restore_resharded`).

**The assumption, and what guards it**: the new mesh's layouts are the old ones on the new mesh
sizes (the same ``build`` places the same placements whatever the sizes; FSDP2, TP). A model whose
build placed differently would find an old rank missing: its restore then fails with a clear
error naming the uncovered tensor (``reshard``: "the shards leave N elements uncovered"), never
a wrong weight. Without layouts (no rank has reported yet), every old rank is needed, as before.

Cost: per layout and new rank, only the old coordinates it needs -- a reshard of 1,024 ranks
plans in milliseconds per node.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nonstop.errors import SnapshotError
from nonstop.mesh import MeshSpec
from nonstop.placements import order, parse

__all__ = [
    "MAX_LAYOUTS",
    "TensorLayout",
    "decode_layouts",
    "encode_layouts",
    "layouts_of",
    "needed_old_ranks",
]

MAX_LAYOUTS = 1024  # distinct (shape, placements, dims) a report may carry (a model has tens)
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorLayout:
    """How one DTensor is laid out: its global shape, one placement per mesh dim
    (``Shard(dim=d)`` or ``Replicate()``, as ``repr`` gives them) and those mesh dims' names."""

    global_shape: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_dims: tuple[str, ...]


def layouts_of(tensors: Iterable[Any]) -> list[TensorLayout]:
    """The distinct layouts of the DTensors among ``tensors`` (a model's ``state_dict().values()``),
    in first-seen order; empty when one has no named mesh dims or a placement this module cannot
    plan for (then every old rank is needed)."""
    from nonstop.snapshot.sharded import is_dtensor

    out: dict[TensorLayout, None] = {}
    for t in tensors:
        if not is_dtensor(t):
            continue
        names = t.device_mesh.mesh_dim_names
        placements = tuple(repr(p) for p in t.placements)
        if names is None or any(_shard_dim(p) is False for p in placements):
            return []
        out[TensorLayout(tuple(int(n) for n in t.shape), placements, tuple(names))] = None
        if len(out) > MAX_LAYOUTS:
            return []
    return list(out)


def encode_layouts(layouts: Iterable[TensorLayout]) -> list[list[Any]]:
    """The wire form: ``[[global shape], [placements], [mesh dims]]`` per layout."""
    return [[list(x.global_shape), list(x.placements), list(x.mesh_dims)] for x in layouts]


def decode_layouts(raw: Any) -> tuple[TensorLayout, ...] | None:
    """:func:`encode_layouts`'s form back, checked; None for anything malformed (too many, wrong
    types, a placement it cannot plan for), which the coordinator then ignores."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_LAYOUTS:
        return None
    out = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(v, list) for v in item)):
            return None
        shape, placements, dims = item
        if not (
            0 < len(placements) == len(dims) <= _MAX_DIMS
            and len(shape) <= _MAX_DIMS
            and all(type(n) is int and 0 <= n < 2**62 for n in shape)
            and all(isinstance(p, str) and len(p) <= 32 and _shard_dim(p) is not False for p in placements)
            and all(isinstance(d, str) and 0 < len(d) <= 32 for d in dims)
            and all((d := _shard_dim(p)) is None or d < len(shape) for p in placements)
        ):
            return None
        out.append(TensorLayout(tuple(shape), tuple(placements), tuple(dims)))
    return tuple(out)


def _shard_dim(placement: str) -> int | bool | None:
    """``Shard(dim=d)`` and ``_StridedShard(dim=d, sf=s)`` -> d, ``Replicate()`` -> None, anything
    else -> False."""
    try:
        return parse(placement)[0]
    except (SnapshotError, ValueError):
        return False


def needed_old_ranks(
    layouts: Iterable[TensorLayout] | None, old: MeshSpec, new: MeshSpec, new_ranks: Iterable[int]
) -> set[int]:
    """The old ranks (of mesh ``old``) whose snapshots the ``new_ranks`` (of mesh ``new``) cut
    their shards out of. ``layouts`` None or empty: every old rank.

    Per layout and new rank, per tensor dim the layout shards: the new rank's range of that dim
    (its chunk, or its chunk of a chunk where several mesh dims shard it, in the order DTensor cut
    them: :func:`~nonstop.placements.order`, FSDP2 over TP's strided dim included), and the old
    coordinates along those mesh dims whose (non-empty) range overlaps it, found by walking the
    old chunks that overlap it only; an empty new range needs nothing. A ``Replicate()`` dim, and
    a job dim the layout's mesh leaves out, need one old coordinate only: the new rank's own where
    the old mesh has it, else 0. A layout whose placements cannot be ordered on either mesh needs
    every old rank. ``O(layouts x new ranks x old ranks needed)``, never the old world's size per
    rank."""
    ranks = sorted(set(new_ranks))
    every = set(range(old.world_size))
    plan = list(layouts or ())
    if not plan:
        return every
    needed = {r % old.world_size for r in ranks}  # the unsharded rest (restore_resharded)
    for lay in plan:
        names = lay.mesh_dims
        try:
            cut = order(lay.placements, tuple(new.size(n) for n in names))
            if cut != order(lay.placements, tuple(old.size(n) for n in names)):
                return every
        except SnapshotError:
            return every
        by_dim: dict[int, list[str]] = {}
        for a, d in cut:
            if d is not None:
                by_dim.setdefault(d, []).append(names[a])
        for r in ranks:
            c = new.coords(r)
            groups: list[list[dict[str, int]]] = [
                [{name: _own(c, name, old)}] for name, p in zip(names, lay.placements, strict=True)
                if _shard_dim(p) is None
            ]  # fmt: skip
            for d, dims in by_dim.items():
                lo, hi = 0, lay.global_shape[d]
                for name in dims:  # the new rank's range of tensor dim d
                    lo, hi = _sub(lo, hi, new.size(name), c.get(name, 0))
                groups.append(_overlapping(0, lay.global_shape[d], [(n, old.size(n)) for n in dims], lo, hi))
            if any(not g for g in groups):
                continue  # an empty range: this rank holds none of this tensor
            rest = {name: _own(c, name, old) for name in old.names if name not in names}
            for picked in itertools.product(*groups):
                coords = dict(rest)
                for part in picked:
                    coords.update(part)
                needed.add(old.rank_of(coords))
    return needed


def _sub(start: int, stop: int, n: int, k: int) -> tuple[int, int]:
    """Chunk ``k`` of ``n`` (``torch.chunk``) of the range ``[start, stop)``."""
    lo, hi = _chunk(stop - start, n, k)
    return start + lo, start + hi


def _overlapping(
    start: int, stop: int, dims: list[tuple[str, int]], lo: int, hi: int
) -> list[dict[str, int]]:
    """The coordinates along ``dims`` (name, size: cut in this order, each a chunk of the last) of
    the non-empty pieces of ``[start, stop)`` that overlap ``[lo, hi)``; none when that is empty."""
    if lo >= hi or start >= stop:
        return []
    if not dims:
        return [{}]
    (name, n), below = dims[0], dims[1:]
    step = -(-(stop - start) // n)
    out: list[dict[str, int]] = []
    for k in range(max(0, (lo - start) // step), min(n - 1, (hi - 1 - start) // step) + 1):
        a, b = _sub(start, stop, n, k)
        out.extend({name: k, **more} for more in _overlapping(a, b, below, max(lo, a), min(hi, b)))
    return out


def _chunk(rows: int, n: int, k: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``k`` of ``n`` (``torch.chunk``) of ``rows`` rows."""
    step = -(-rows // n)
    start = min(k * step, rows)
    return start, min(start + step, rows)


def _own(coords: Mapping[str, int], name: str, old: MeshSpec) -> int:
    """The new rank's coordinate on ``name`` where the old mesh has it, else 0."""
    k = coords.get(name, 0)
    return k if k < old.size(name) else 0
