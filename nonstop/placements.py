"""DTensor's placement rule, pure (no torch): where a rank's local shard of a tensor lies.

A placement's ``repr`` (``Shard(dim=0)``, ``Replicate()``, ``_StridedShard(dim=0, sf=2)``) on each
mesh dim, the mesh's sizes and a rank's coordinates give its local shard's shape and global offset
(:func:`shard_layout`), as torch computes them for a DTensor (checked against torch in the tests).
Both the worker's reshard (:mod:`nonstop.snapshot.sharded`) and the coordinator's plan of which old
ranks a node needs (:mod:`nonstop.reshardplan`, which never imports torch) use it.
"""

from __future__ import annotations

import math

from nonstop.errors import SnapshotError

__all__ = ["order", "parse", "shard_layout"]


def parse(placement: str) -> tuple[int | None, int]:
    """(tensor dim, split factor) of a placement's ``repr``: ``Replicate()`` -> (None, 1),
    ``Shard(dim=d)`` -> (d, 1), ``_StridedShard(dim=d, sf=s)`` -> (d, s); anything else refused."""
    if placement == "Replicate()":
        return None, 1
    if placement.startswith("Shard(dim=") and placement.endswith(")"):
        return int(placement[len("Shard(dim=") : -1]), 1
    if placement.startswith("_StridedShard(dim=") and placement.endswith(")"):
        dim, _, sf = placement[len("_StridedShard(dim=") : -1].partition(", sf=")
        if dim.isdigit() and sf.isdigit() and int(sf) >= 1:
            return int(dim), int(sf)
    raise SnapshotError(
        f"reshard: placement {placement} is not supported (Shard, Replicate and _StridedShard are)"
    )


def order(placements: tuple[str, ...], mesh_shape: tuple[int, ...]) -> list[tuple[int, int | None]]:
    """The order in which a rank's local shard was cut: (mesh dim, tensor dim) pairs.

    ``Shard`` and ``Replicate`` in mesh order. A ``_StridedShard(dim=d, sf=s)`` is DTensor's record
    of a dim sharded *before* the later mesh dims that shard ``d`` (FSDP2 over tensor parallel:
    ``(_StridedShard(0, sf=T), Shard(0))`` on ``(dp, tp)`` is the TP chunk, then the FSDP chunk of
    that): it comes after them, and ``s`` must be the product of their sizes; each piece is then one
    contiguous range of the global tensor, as torch records its offset. Other strided layouts
    (pieces scattered over the tensor) are refused."""
    plain: list[tuple[int, int | None]] = []
    strided: list[tuple[int, int | None]] = []
    for a, p in enumerate(placements):
        d, sf = parse(p)
        if sf == 1:
            plain.append((a, d))
            continue
        later = math.prod(
            mesh_shape[b] for b, q in enumerate(placements) if b > a and parse(q)[0] == d and parse(q)[1] == 1
        )
        if sf != later or any(pd == d for _, pd in plain):
            raise SnapshotError(
                f"reshard: placements {list(placements)} on mesh {list(mesh_shape)} cut a dim into "
                "scattered pieces; strided shards are supported as FSDP2 over tensor parallel lays them "
                "out (the strided dim's split factor the product of the later mesh dims sharding it)"
            )
        strided.append((a, d))
    return plain + strided[::-1]


def shard_layout(
    global_shape: tuple[int, ...],
    placements: tuple[str, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offset) of the rank at ``coord`` of ``mesh_shape`` for a tensor of
    ``global_shape`` placed by ``placements`` (one per mesh dim), as DTensor places it: each
    ``Shard(dim=d)`` splits dim d the way ``torch.chunk`` does (chunks of ceil(n / k); trailing
    ranks may get fewer rows or none), mesh dims applied in order, a ``_StridedShard`` after the
    later mesh dims it was split over (:func:`order`)."""
    if not len(placements) == len(mesh_shape) == len(coord):
        raise SnapshotError(f"reshard: {len(placements)} placements for a mesh of {len(mesh_shape)} dims")
    shape, offset = list(global_shape), [0] * len(global_shape)
    for a, d in order(placements, mesh_shape):
        if d is None:
            continue
        n, k = mesh_shape[a], coord[a]
        chunk = -(-shape[d] // n)  # ceil
        start = min(k * chunk, shape[d])
        stop = min(start + chunk, shape[d])
        offset[d] += start
        shape[d] = stop - start
    return tuple(shape), tuple(offset)
