"""DTensor state in snapshots (snapshot/sharded.py), on torch's fake process group (one process
plays rank 1 of 2; no collective runs): the local shard and its placement round-trip through the
tree, the memory slots and the durable tier; a restore into a model laid out differently is refused
with a clear error; stitch() assembles the global tensor from every rank's shards."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nonstop.errors import SnapshotCorruptError, SnapshotError
from nonstop.snapshot import RankSnapshotStore, StateCapture, flatten_state, unflatten_state
from nonstop.snapshot.sharded import LocalShard, stitch

FULL = torch.arange(12.0).reshape(6, 2)


@pytest.fixture
def mesh() -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    finally:
        dist.destroy_process_group()


def sharded(mesh: Any, dim: int = 0) -> Any:
    """Rank 1's DTensor of FULL sharded on ``dim``."""
    from torch.distributed.tensor import DTensor, Shard

    local = FULL[3:].clone() if dim == 0 else FULL[:, 1:].clone()
    return DTensor.from_local(
        local, mesh, [Shard(dim)], run_check=False, shape=FULL.shape, stride=FULL.stride()
    )


class Tiny(nn.Module):
    def __init__(self, mesh: Any, dim: int = 0) -> None:
        super().__init__()
        self.w = nn.Parameter(sharded(mesh, dim))
        self.b = nn.Parameter(torch.zeros(2))


def test_a_dtensor_is_its_local_shard_and_what_places_it(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    rep = DTensor.from_local(FULL.clone(), mesh, [Replicate()], run_check=False)
    tree, tensors = flatten_state({"w": sharded(mesh), "r": rep, "plain": torch.ones(1), "w2": sharded(mesh)})
    assert tree["w"] == {
        "__dt__": 0,
        "__dm__": 0,  # layout 0 of this snapshot, defined here
        "shape": [6, 2],
        "stride": [2, 1],
        "offset": [3, 0],
        "placements": ["Shard(dim=0)"],
        "mesh": [2],
        "dims": ["shard"],
    }
    assert tree["r"]["__dm__"] == 1 and tree["r"]["offset"] == [0, 0]
    assert tree["w2"] == {"__dt__": 3, "__dr__": 0}  # the same layout as "w": named, not repeated
    assert torch.equal(tensors[0], FULL[3:]) and tensors[0].data_ptr() != 0
    back = unflatten_state(tree, tensors)
    assert back["w2"].offset == (3, 0) and back["w2"].global_shape == (6, 2)
    assert torch.equal(back["w2"].tensor, FULL[3:])
    w = back["w"]
    assert isinstance(w, LocalShard) and w.offset == (3, 0) and w.placements == ("Shard(dim=0)",)
    assert back["r"].offset == (0, 0) and back["r"].placements == ("Replicate()",)
    assert torch.equal(back["plain"], torch.ones(1))
    older = dict(tree, w2={k: v for k, v in tree["w"].items() if k != "__dm__"} | {"__dt__": 3})
    assert unflatten_state(older, tensors)["w2"].offset == (3, 0)  # nodes of before: fields inline


@pytest.mark.parametrize(
    "node",
    [
        {"__dt__": 0, "__dr__": 5},  # no such layout
        {"__dt__": 0, "__dr__": [0]},  # not a number (unhashable: must not raise TypeError)
        {"__dt__": 0, "__dr__": True},
    ],
)
def test_a_layout_reference_nothing_defined_is_corrupt(node: dict[str, Any]) -> None:
    with pytest.raises(SnapshotCorruptError, match="layout"):
        unflatten_state({"x": node}, [torch.zeros(2)])


def test_a_layout_defined_under_a_bad_number_is_corrupt(mesh: Any) -> None:
    tree, tensors = flatten_state({"w": sharded(mesh)})
    tree["w"]["__dm__"] = "zero"
    with pytest.raises(SnapshotCorruptError, match="layout"):
        unflatten_state(tree, tensors)


def test_a_sharded_model_and_optimizer_round_trip_through_memory_slots(mesh: Any, tmp_path: Path) -> None:
    model = Tiny(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.w.grad = sharded(mesh) * 0 + 1.0
    model.b.grad = torch.ones(2)
    opt.step()
    cap = StateCapture(model=model, optimizer=opt)
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=1, num_slots=2)
    try:
        pending = store.begin(1, cap.state(1), deferred=cap.deferrable())  # the overlapped path
        pending.wait()
        before = {
            k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
            for k, v in model.state_dict().items()
        }
        moments = opt.state[model.w]["exp_avg"].to_local().clone()
        # a fresh rank: new model and optimizer (no state yet) restore the snapshot
        fresh = Tiny(mesh)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        StateCapture(model=fresh, optimizer=fresh_opt).restore(store.read(1, copy=False))
        assert torch.equal(fresh.w.to_local(), before["w"]) and torch.equal(fresh.b, before["b"])
        exp_avg = fresh_opt.state[fresh.w]["exp_avg"]
        assert type(exp_avg).__name__ == "DTensor" and torch.equal(exp_avg.to_local(), moments)
        assert exp_avg.placements == fresh.w.placements
        # a survivor: its state tensors are copied into in place
        live = opt.state[model.w]["exp_avg"].to_local()
        live.zero_()
        cap.restore(store.read(1, copy=False))
        assert torch.equal(opt.state[model.w]["exp_avg"].to_local(), moments)
        assert opt.state[model.w]["exp_avg"].to_local().data_ptr() == live.data_ptr()
    finally:
        store.close()


def test_a_snapshot_restored_onto_another_layout_is_refused_clearly(mesh: Any, tmp_path: Path) -> None:
    cap = StateCapture(model=Tiny(mesh, dim=0))
    store = RankSnapshotStore(shm_dir=tmp_path, job_id="t", rank=1, num_slots=2)
    try:
        store.write(3, cap.state(3))
        other = StateCapture(model=Tiny(mesh, dim=1))
        with pytest.raises(
            SnapshotError, match=r"model w: the snapshot holds local \(3, 2\).*Shard\(dim=0\)"
        ):
            other.restore(store.read(3, copy=False))
        with pytest.raises(SnapshotError, match="the snapshot holds a tensor, the model a DTensor"):
            StateCapture(model=Tiny(mesh)).restore(
                {**cap.state(3), "model": {"w": FULL, "b": torch.zeros(2)}}
            )
    finally:
        store.close()


def shard(rows: slice, offset: int, placement: str = "Shard(dim=0)") -> LocalShard:
    return LocalShard(
        tensor=FULL[rows].clone(),
        global_shape=(6, 2),
        global_stride=(2, 1),
        offset=(offset, 0),
        placements=(placement,),
        mesh_shape=(2,),
        mesh_dims=("shard",),
    )


def test_stitch_assembles_the_global_tensor_from_every_ranks_shard() -> None:
    assert torch.equal(stitch([shard(slice(3, 6), 3), shard(slice(0, 3), 0)]), FULL)
    replicas = [shard(slice(0, 6), 0, "Replicate()")] * 2
    assert torch.equal(stitch(replicas), FULL)
    with pytest.raises(SnapshotError, match="leave 6 of 12 elements uncovered"):
        stitch([shard(slice(0, 3), 0)])
    bad = LocalShard(**{**vars(shard(slice(0, 6), 0, "Replicate()")), "tensor": FULL + 1})
    with pytest.raises(SnapshotError, match="replicas are not equal"):
        stitch([shard(slice(0, 6), 0, "Replicate()"), bad])
    with pytest.raises(SnapshotError, match="strided"):
        stitch([shard(slice(0, 6), 0, "_StridedShard(dim=0, sf=2)")])
    with pytest.raises(SnapshotError, match="no shards"):
        stitch([])


LAYOUTS = [
    ((7, 4), ("Shard(dim=0)",), (3,)),  # uneven: 3, 3, 1 rows
    ((5, 4), ("Shard(dim=0)",), (4,)),  # the last rank gets none
    ((6, 8), ("Replicate()", "Shard(dim=0)"), (2, 2)),  # HSDP
    ((6, 8), ("Shard(dim=0)", "Shard(dim=1)"), (2, 2)),  # FSDP x TP (column-wise)
    ((9, 2), ("Shard(dim=0)", "Shard(dim=0)"), (2, 2)),  # one dim split twice
    # FSDP2 over tensor parallel: the TP chunk, then the FSDP chunk of it (uneven ones too)
    ((10, 6), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (2, 2)),
    ((7, 6), ("_StridedShard(dim=0, sf=3)", "Shard(dim=0)"), (2, 3)),
    ((5, 6), ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (4, 2)),
    ((10, 3), ("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), (2, 3, 2)),  # HSDP over TP
    ((6, 9), ("_StridedShard(dim=1, sf=2)", "Shard(dim=1)"), (3, 2)),  # row-wise TP's dim 1
]


def _placement_objs(placements: tuple[str, ...]) -> list[Any]:
    """torch's placements for their ``repr`` s."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for p in placements:
        if p == "Replicate()":
            out.append(Replicate())
        elif p.startswith("Shard(dim="):
            out.append(Shard(int(p[len("Shard(dim=") : -1])))
        else:
            dim, sf = p[len("_StridedShard(dim=") : -1].split(", sf=")
            out.append(_StridedShard(int(dim), split_factor=int(sf)))
    assert [repr(o) for o in out] == list(placements)
    return out


@pytest.mark.parametrize(("shape", "placements", "mesh_shape"), LAYOUTS)
def test_shard_layout_is_dtensors_own_rule(
    shape: tuple[int, ...], placements: tuple[str, ...], mesh_shape: tuple[int, ...]
) -> None:
    """Every rank's (local shape, offset) equals what torch computes for a DTensor (fake world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nonstop.snapshot.sharded import shard_layout

    world = 1
    for n in mesh_shape:
        world *= n
    objs = _placement_objs(placements)
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", mesh_shape)
            theirs = compute_local_shape_and_global_offset(shape, mesh, objs)
            coord = tuple(mesh.get_coordinate() or ())
        finally:
            dist.destroy_process_group()
        ours = shard_layout(shape, placements, mesh_shape, coord)
        assert ours[0] == tuple(theirs[0])
        if math.prod(ours[0]):  # (an empty shard's offset is a convention: torch's differs for strided)
            assert ours[1] == tuple(theirs[1])


def test_reshard_cuts_a_new_layouts_shard_out_of_the_old_ones() -> None:
    """FSDP2 on 2 ranks -> 3 ranks (uneven), and onto HSDP 2x2, from the 2 old shards."""
    from nonstop.snapshot.sharded import reshard, shard_layout

    whole = torch.arange(28.0).reshape(7, 4)
    old = []
    for r in range(2):
        shape, off = shard_layout((7, 4), ("Shard(dim=0)",), (2,), (r,))
        local = whole[off[0] : off[0] + shape[0]].clone()
        old.append(
            LocalShard(
                tensor=local,
                global_shape=(7, 4),
                global_stride=(4, 1),
                offset=off,
                placements=("Shard(dim=0)",),
                mesh_shape=(2,),
                mesh_dims=("shard",),
            )
        )
    got = [reshard(old, ("Shard(dim=0)",), (3,), (r,)) for r in range(3)]
    assert [tuple(t.shape) for t in got] == [(3, 4), (3, 4), (1, 4)]
    assert torch.equal(torch.cat(got), whole)
    hsdp = reshard(old, ("Replicate()", "Shard(dim=0)"), (2, 2), (1, 1))
    assert torch.equal(hsdp, whole[4:])
    with pytest.raises(SnapshotError, match="scattered pieces"):
        reshard(old, ("_StridedShard(dim=0, sf=2)",), (2,), (0,))  # nothing split after it
    with pytest.raises(SnapshotError, match="not supported"):
        reshard(old, ("Partial(sum)",), (2,), (0,))


def _pieces(
    whole: torch.Tensor, placements: tuple[str, ...], mesh_shape: tuple[int, ...]
) -> list[LocalShard]:
    """Every rank's LocalShard of ``whole`` in a layout (offsets as torch computes them)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, off = _compute_local_shape_and_global_offset(
            tuple(whole.shape), mesh_shape, list(coord), _placement_objs(placements)
        )
        local = whole[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))].clone()
        out.append(
            LocalShard(
                tensor=local, global_shape=tuple(whole.shape), global_stride=tuple(whole.stride()),
                offset=tuple(off), placements=placements, mesh_shape=mesh_shape, mesh_dims=None,
            )
        )  # fmt: skip
    return out


def test_fsdp2_over_tensor_parallel_reshards_to_another_dp_size() -> None:
    """FSDP2 over TP (2 dp x 2 tp: ``_StridedShard`` on dp) -> 3 dp x 2 tp and -> 1 dp x 2 tp:
    every new rank's local tensor is the slice torch would give it, from the old pieces."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from nonstop.snapshot.sharded import reshard

    whole = torch.arange(110.0).reshape(11, 10)
    strided = ("_StridedShard(dim=0, sf=2)", "Shard(dim=0)")
    old = _pieces(whole, strided, (2, 2))
    assert torch.equal(stitch(old), whole)
    for mesh_shape in ((3, 2), (1, 2)):
        for coord in itertools.product(*(range(n) for n in mesh_shape)):
            shape, off = _compute_local_shape_and_global_offset(
                (11, 10), mesh_shape, list(coord), _placement_objs(strided)
            )
            want = whole[tuple(slice(o, o + n) for o, n in zip(off, shape, strict=True))]
            assert torch.equal(reshard(old, strided, mesh_shape, coord), want)
    plain = reshard(old, ("Shard(dim=0)",), (2,), (1,))  # onto FSDP2 alone
    assert torch.equal(plain, whole[6:])


def test_a_tensor_one_layout_shards_and_the_other_keeps_whole_is_cut_or_stitched(mesh: Any) -> None:
    """``restore_resharded`` across layouts that disagree on what is sharded: the old ranks held
    ``w`` whole and ``b`` in two shards; the live model (rank 1 of 2) shards ``w`` and keeps ``b``
    whole. ``w``'s local rows come out of the whole tensor, ``b`` is stitched from the shards."""
    from nonstop.snapshot.capture import restore_resharded

    b_full = torch.tensor([5.0, 7.0])

    def b_shard(r: int) -> LocalShard:
        return LocalShard(
            tensor=b_full[r : r + 1].clone(), global_shape=(2,), global_stride=(1,), offset=(r,),
            placements=("Shard(dim=0)",), mesh_shape=(2,), mesh_dims=("shard",),
        )  # fmt: skip

    model = Tiny(mesh)
    with torch.no_grad():
        model.w.to_local().zero_()
    cap = StateCapture(model=model)
    base = cap.state(3)
    old = [{**base, "model": {"w": FULL.clone(), "b": b_shard(r)}} for r in range(2)]
    assert restore_resharded(cap, list(old), rank=1) == 3
    assert torch.equal(model.w.to_local(), FULL[3:]) and torch.equal(model.b.detach(), b_full)
    with pytest.raises(SnapshotError, match="holds no tensor of it"):
        restore_resharded(cap, [{**o, "model": {"w": None, "b": b_shard(0)}} for o in old], rank=1)
