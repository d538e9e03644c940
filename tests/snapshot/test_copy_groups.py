"""Copy groups: a node keeps one copy of what an HSDP job's replica groups hold alike, per shard
coordinate (snapshot/nodecopy.py). Unit tests: the mesh's rule, the placements' check on torch's
fake process group, and real shared-memory files where two groups of one node write apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nonstop.config import JobConfig, SnapshotConfig
from nonstop.mesh import MeshSpec
from nonstop.snapshot import RankSnapshotStore
from nonstop.snapshot.nodecopy import NodeCopy, SharedRef, node_slots
from nonstop.snapshot.sharded import replicated_along
from nonstop.snapshot.space import groups_of_node, paths_of_node
from nonstop.snapshot.split import encode_meta, ref_of

JOB = "j.0"


def test_a_rank_s_copy_group_is_its_place_in_its_replica_group() -> None:
    hsdp = MeshSpec.parse("replicate=2,shard=2")
    assert [hsdp.copy_group(r) for r in range(4)] == [0, 1, 0, 1]
    dptp = MeshSpec.parse("replicate=3,shard=2,tp=2")
    assert [dptp.copy_group(r) for r in range(12)] == [0, 1, 2, 3] * 3
    # a smaller generation keeps whole replica groups: a rank's group survives the renumbering
    assert hsdp.with_world(2).copy_group(1) == hsdp.copy_group(3)


@pytest.mark.parametrize(
    ("mesh", "nproc", "groups"),
    [
        ("replicate=2,shard=2", 4, 2),  # one node holds both replica groups: 2 shards, each once
        ("replicate=2,shard=2", 2, 0),  # a replica group per node: nothing alike on a node
        ("replicate=4,shard=2", 8, 2),
        ("replicate=4,shard=2", 4, 2),  # two replica groups a node
        ("replicate=2,shard=2,tp=2", 8, 4),
        ("shard=4", 4, 0),  # no replicas
        ("shard=2,tp=2", 4, 0),
    ],
)
def test_a_node_keeps_a_copy_per_group_only_where_it_holds_twins(mesh: str, nproc: int, groups: int) -> None:
    spec = MeshSpec.parse(mesh)
    assert spec.copy_groups_on_node(nproc) == groups
    nnodes = spec.world_size // nproc
    job = JobConfig(script="x.py", nnodes=nnodes, nproc_per_node=nproc, mesh=mesh, coordinator="127.0.0.1:0")
    assert job.node_copy_groups == groups
    assert JobConfig(script="x.py", nproc_per_node=nproc).node_copy_groups == 1  # DDP: one group
    assert (
        JobConfig(
            script="x.py", nproc_per_node=nproc, snapshot=SnapshotConfig(copies="rank")
        ).node_copy_groups
        == 0
    )


@pytest.fixture
def fake_world() -> Iterator[Any]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_only_parameters_replicated_along_replicate_are_alike(fake_world: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    full = torch.arange(8.0).reshape(4, 2)
    place = [Replicate(), Shard(0)]
    w = DTensor.from_local(full[2:].clone(), hsdp, place, run_check=False, shape=(4, 2), stride=(2, 1))
    assert replicated_along([w, w], "replicate")
    # a 1-D mesh named "replicate" handed to fully_shard shards along it: not alike
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("replicate",))
    v = DTensor.from_local(full[1:2].clone(), flat, [Shard(0)], run_check=False, shape=(4, 2), stride=(2, 1))
    assert not replicated_along([w, v], "replicate")
    assert not replicated_along([w, torch.ones(2)], "replicate")  # a plain tensor is not kept alike
    assert not replicated_along([], "replicate")
    assert not replicated_along([w], "tp")  # no such dim


def _state(rank: int, shard: torch.Tensor) -> dict[str, object]:
    return {"model": {"w": shard}, "rng": torch.arange(9, dtype=torch.uint8) + rank, "extras": {"rank": rank}}


def _store(tmp: Path, rank: int, group: int) -> RankSnapshotStore:
    s = RankSnapshotStore(shm_dir=tmp, job_id=JOB, rank=rank, num_slots=2)
    s.share_with(NodeCopy(shm_dir=tmp, job_id=JOB, num_slots=node_slots(2), group=group), 1)
    return s


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_two_copy_groups_of_a_node_keep_each_shard_once_and_apart(tmp_path: Path) -> None:
    """HSDP 2x2 on one node: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1."""
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(128, 16, generator=g), torch.randn(128, 16, generator=g)]
    mesh = MeshSpec.parse("replicate=2,shard=2")
    stores, states = [], []
    for rank in range(4):
        group = mesh.copy_group(rank)
        local = shards[group].clone()  # each rank's own tensor, equal to its twin's
        state = _state(rank, local)
        s = _store(tmp_path, rank, group)
        s.write(3, state, share=lambda t, local=local: t.data_ptr() == local.data_ptr())
        stores.append(s)
        states.append(state)
    shared = paths_of_node(tmp_path, JOB)
    assert groups_of_node(shared) == 2
    assert len(paths_of_node(tmp_path, JOB, 0)) == 1 and len(paths_of_node(tmp_path, JOB, 1)) == 1
    for rank, s in enumerate(stores):
        assert _same(s.read(3), states[rank])
        reader = RankSnapshotStore(shm_dir=tmp_path, job_id=JOB, rank=rank, num_slots=2)  # the agent's
        assert _same(reader.read(3), states[rank])
        raw = reader.copy_out(3, split=True)
        assert raw.shared is not None and raw.shared.group == mesh.copy_group(rank)
        reader.keep_only([3])  # pins the group's shared write, not the other group's
        pinned = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=node_slots(2), group=raw.shared.group)
        assert [pinned.info(i).pinned for i in range(3) if pinned.info(i) is not None] == [True]
        reader.keep_only([])
        pinned.close(), reader.close()
    for s in stores:
        s.close()


def test_a_ref_names_its_group_and_a_ddp_meta_reads_as_group_0() -> None:
    ref = SharedRef(gen=12, step=123456789, base=4096, group=7)
    assert ref_of(encode_meta(ref, "{}", "[]")) == ref
    plain = SharedRef(gen=1, step=2, base=64)
    meta = encode_meta(plain, "{}", "[]")
    assert meta.startswith(b'{"shared":[1,2,64],') and ref_of(meta) == plain  # as before groups
    huge = SharedRef(gen=10**17, step=10**17, base=10**17, group=999_999)
    assert ref_of(encode_meta(huge, "{}", "[]")) == huge  # the largest still fits the head read


def test_a_node_copy_never_finds_another_group_s_write(tmp_path: Path) -> None:
    one = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3, group=1)
    assert one.install(gen=1, step=5, key="k", data=b"x" * 64)
    assert one.find(SharedRef(1, 5, 0, 1)) is not None
    assert one.find(SharedRef(1, 5, 0, 0)) is None
    zero = NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3)
    assert zero.find(SharedRef(1, 5, 0, 0)) is None
    with pytest.raises(ValueError, match="copy group"):
        NodeCopy(shm_dir=tmp_path, job_id=JOB, num_slots=3, group=-1)
    one.close(), zero.close()


def test_a_rank_joins_its_copy_group_only_when_its_model_replicates(fake_world: Any) -> None:
    """The worker's choice (LoopSnapshots): HSDP's parameters (Replicate on ``replicate``) put
    rank 3 of ``replicate=2,shard=2`` in group 1; a model sharded along a dim named ``replicate``
    (the demo's ``replicate=2,tp=2``: FSDP over a 1-D mesh of that name) keeps its own copy; a
    DDP job's ranks are group 0; ``--snapshot-copies rank`` none."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from nonstop.snapshot import StateCapture
    from nonstop.train.snapshots import LoopSnapshots

    def loop(mesh: str | None, node_copy: bool = True) -> LoopSnapshots:
        env = SimpleNamespace(
            node_copy=node_copy, mesh=mesh, shm_dir=Path("/nonexistent"), job_id="j", snapshot_every=1
        )
        snaps = LoopSnapshots(env)  # type: ignore[arg-type]
        snaps._store = SimpleNamespace(rank=3)  # type: ignore[assignment]
        return snaps

    def capture(param: torch.Tensor) -> StateCapture:
        model = torch.nn.Linear(2, 2)
        return StateCapture(model=model, optimizer=torch.optim.SGD([torch.nn.Parameter(param)], lr=0.1))

    full = torch.arange(8.0).reshape(4, 2)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    w = DTensor.from_local(
        full[2:].clone(), hsdp, [Replicate(), Shard(0)], run_check=False, shape=(4, 2), stride=(2, 1)
    )
    assert loop("replicate=2,shard=2")._copy_group(capture(w)) == 1
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("replicate",))
    v = DTensor.from_local(full[1:2].clone(), flat, [Shard(0)], run_check=False, shape=(4, 2), stride=(2, 1))
    assert loop("replicate=4")._copy_group(capture(v)) is None
    assert loop(None)._copy_group(capture(torch.ones(2))) == 0
    assert loop("replicate=2,shard=2", node_copy=False)._copy_group(capture(w)) is None
