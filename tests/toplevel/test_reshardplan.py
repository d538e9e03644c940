"""Which old ranks a resharded rank needs (nonstop/reshardplan.py): the slices it computes are
DTensor's (checked against ``shard_layout``), the old ranks it names cover every new slice --
cutting from those alone gives what cutting from all gives -- and nothing it names is spare;
malformed reports are refused whole."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nonstop.mesh import MeshSpec
from nonstop.reshardplan import (
    MAX_LAYOUTS,
    TensorLayout,
    decode_layouts,
    encode_layouts,
    layouts_of,
    needed_old_ranks,
)
from nonstop.snapshot.sharded import LocalShard, reshard, shard_layout

SHARD0 = ("Shard(dim=0)",)


def _box(
    shape: tuple[int, ...], placements: tuple[str, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...]
) -> tuple[tuple[int, int], ...]:
    """[start, stop) per tensor dim of the slice DTensor places at ``coord``."""
    local, offset = shard_layout(shape, placements, mesh_shape, coord)
    return tuple((o, o + n) for o, n in zip(offset, local, strict=True))


def _cells(box: tuple[tuple[int, int], ...]) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(lo, hi) for lo, hi in box)))


def _coord(mesh: MeshSpec, rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
    c = mesh.coords(rank)
    return tuple(c.get(d, 0) for d in dims)


@pytest.mark.parametrize(
    ("spec", "old_world", "new_world"),
    [
        ("shard=8", 3, 2),
        ("shard=8", 2, 3),
        ("shard=8", 5, 7),
        ("shard=8", 8, 1),
        ("shard=8,tp=2", 6, 4),
        ("shard=8,tp=2", 4, 10),
    ],
)
def test_the_named_old_ranks_cover_every_new_slice_and_each_is_needed(
    spec: str, old_world: int, new_world: int
) -> None:
    mesh = MeshSpec.parse(spec)
    old, new = mesh.with_world(old_world), mesh.with_world(new_world)
    rng = random.Random(old_world * 31 + new_world)
    dims = old.names
    layouts = [
        TensorLayout(
            (rng.randint(1, 23), rng.randint(1, 5)),
            SHARD0 + (("Shard(dim=1)",) if len(dims) == 2 else ()),
            dims,
        )
        for _ in range(12)
    ]
    if len(dims) == 2:  # a tensor FSDP shards but TP replicates, on the 2-D mesh
        layouts.append(TensorLayout((9, 3), ("Shard(dim=0)", "Replicate()"), dims))
        # one dim cut twice: nested chunks, and FSDP2 over TP's (the TP chunk first: strided)
        layouts.append(TensorLayout((rng.randint(1, 40), 3), ("Shard(dim=0)", "Shard(dim=0)"), dims))
        layouts.append(
            TensorLayout((rng.randint(1, 40), 3), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), dims)
        )
    for r in range(new.world_size):
        needed = needed_old_ranks(layouts, old, new, [r])
        assert r % old.world_size in needed  # the unsharded rest comes from it
        useful = {r % old.world_size}
        for lay in layouts:
            oshape, nshape = tuple(old.size(d) for d in dims), tuple(new.size(d) for d in dims)
            want = _cells(_box(lay.global_shape, lay.placements, nshape, _coord(new, r, dims)))
            have: set[tuple[int, ...]] = set()
            for o in needed:
                cells = _cells(_box(lay.global_shape, lay.placements, oshape, _coord(old, o, dims)))
                have |= cells
                if cells & want:
                    useful.add(o)
            assert want <= have, (lay, r, sorted(needed))
        assert needed == useful  # none named that holds nothing this rank cuts


def test_cutting_from_the_named_old_ranks_alone_gives_what_all_give() -> None:
    whole = torch.arange(70.0).reshape(14, 5)
    old, new = MeshSpec.parse("shard=5"), MeshSpec.parse("shard=3")
    shards = []
    for o in range(5):
        shape, off = shard_layout((14, 5), SHARD0, (5,), (o,))
        local = whole[off[0] : off[0] + shape[0]].clone()
        shards.append(
            LocalShard(
                tensor=local,
                global_shape=(14, 5),
                global_stride=(5, 1),
                offset=off,
                placements=SHARD0,
                mesh_shape=(5,),
                mesh_dims=("shard",),
            )
        )
    lay = [TensorLayout((14, 5), SHARD0, ("shard",))]
    for r in range(3):
        needed = needed_old_ranks(lay, old, new, [r])
        assert len(needed) < 5
        mine = reshard([shards[o] for o in sorted(needed)], SHARD0, (3,), (r,))
        assert torch.equal(mine, reshard(shards, SHARD0, (3,), (r,)))


def test_without_layouts_every_old_rank_is_needed() -> None:
    old, new = MeshSpec.parse("shard=4"), MeshSpec.parse("shard=4").with_world(2)
    assert needed_old_ranks(None, old, new, [0]) == {0, 1, 2, 3}
    assert needed_old_ranks([], old, new, [1]) == {0, 1, 2, 3}


def test_a_node_needs_the_union_of_its_ranks_needs() -> None:
    old, new = MeshSpec.parse("shard=6"), MeshSpec.parse("shard=6").with_world(4)
    lay = [TensorLayout((24, 2), SHARD0, ("shard",))]
    each = [needed_old_ranks(lay, old, new, [r]) for r in range(4)]
    assert needed_old_ranks(lay, old, new, [0, 1]) == each[0] | each[1]
    assert each[0] == {0, 1}  # rows [0, 6) of old [0, 4) [4, 8)


def test_reports_round_trip_and_malformed_ones_are_refused() -> None:
    lays = [
        TensorLayout((6, 4), SHARD0, ("shard",)),
        TensorLayout((3,), ("Replicate()", "Shard(dim=0)"), ("shard", "tp")),
    ]
    assert decode_layouts(encode_layouts(lays)) == tuple(lays)
    bad: list[Any] = [
        None,
        [],
        "x",
        [[[6], ["Shard(dim=0)"]]],  # two fields
        [[[6], ["Shard(dim=1)"], ["shard"]]],  # shards a dim the tensor lacks
        [[[6], ["_StridedShard(dim=0, sf=x)"], ["shard"]]],
        [[[6], ["Shard(dim=0)"], ["shard", "tp"]]],  # placements and dims disagree
        [[[-1], ["Shard(dim=0)"], ["shard"]]],
        [[[True], ["Shard(dim=0)"], ["shard"]]],
        [[[6.0], ["Shard(dim=0)"], ["shard"]]],
        [[[6], ["Shard(dim=0)"], [""]]],
        [[[6], ["Shard(dim=0)"], ["shard"]]] * (MAX_LAYOUTS + 1),
    ]
    for raw in bad:
        assert decode_layouts(raw) is None, raw


@pytest.fixture
def mesh2d() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    finally:
        dist.destroy_process_group()


def test_layouts_of_a_model_are_its_distinct_dtensor_layouts(mesh2d: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def dt(shape: tuple[int, ...], placements: list[Any]) -> Any:
        full = torch.zeros(shape)
        return DTensor.from_local(
            full, mesh2d, placements, run_check=False, shape=full.shape, stride=full.stride()
        )

    sd = {
        "a": dt((8, 4), [Shard(0), Shard(1)]),
        "b": dt((8, 4), [Shard(0), Shard(1)]),  # the same layout again
        "c": dt((6,), [Shard(0), Replicate()]),
        "plain": torch.ones(3),
    }
    assert layouts_of(sd.values()) == [
        TensorLayout((8, 4), ("Shard(dim=0)", "Shard(dim=1)"), ("shard", "tp")),
        TensorLayout((6,), ("Shard(dim=0)", "Replicate()"), ("shard", "tp")),
    ]
    assert layouts_of([torch.ones(2)]) == []


def test_a_replicated_dim_needs_one_holder_the_one_at_the_new_ranks_coordinate() -> None:
    """FSDP over ``shard`` with TP replicating the tensor: the old ranks of every tp coordinate
    hold the same rows; a new rank takes them from its own tp coordinate's only."""
    mesh = MeshSpec.parse("shard=8,tp=2")
    old, new = mesh.with_world(12), mesh.with_world(8)
    lay = [TensorLayout((30, 4), ("Shard(dim=0)", "Replicate()"), ("shard", "tp"))]
    for r in range(new.world_size):
        base = r % old.world_size
        others = needed_old_ranks(lay, old, new, [r]) - {base}
        assert others and {old.coords(o)["tp"] for o in others} == {new.coords(r)["tp"]}


def test_fsdp2_over_tensor_parallel_is_planned_and_a_layout_it_cannot_order_is_not() -> None:
    mesh = MeshSpec.parse("shard=4,tp=2")
    strided = [TensorLayout((16, 4), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), ("shard", "tp"))]
    # new rank 0 (shard 0 of 3, tp 0): rows [0, 3) of the TP half [0, 8); old shard 0 of 4 holds [0, 2),
    # shard 1 holds [2, 4): old ranks (0, 0) and (1, 0) -- 0 and 2 -- and rank 0's rest
    assert needed_old_ranks(strided, mesh, mesh.with_world(6), [0]) == {0, 2}
    scattered = [TensorLayout((16, 4), ("_StridedShard(dim=0, sf=3)", "Shard(dim=0)"), ("shard", "tp"))]
    assert needed_old_ranks(scattered, mesh, mesh.with_world(6), [0]) == set(range(8))


def test_a_rank_whose_model_cannot_be_read_reports_no_layouts() -> None:
    """Rank 0's layouts are an optimisation: a model it cannot read is reported as none (every
    old rank is gathered), never an error in the join."""
    from types import SimpleNamespace

    from nonstop.train.rejoin import Rejoin

    class Broken:
        def state_dict(self) -> Any:
            raise RuntimeError("not readable")

    fake = SimpleNamespace(_capture=lambda: SimpleNamespace(model=Broken()))
    assert Rejoin._layouts(fake) is None  # type: ignore[arg-type]
    plain = SimpleNamespace(_capture=lambda: SimpleNamespace(model=torch.nn.Linear(2, 2)))
    assert Rejoin._layouts(plain) is None  # type: ignore[arg-type]  (no DTensor: nothing to plan by)
