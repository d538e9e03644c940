"""A sharded job's hot spare warms DTensor's cache in a fake world (nonstop/train/prewarm.py).

Each case runs in a fresh process (the cache is per process): warm up as fake rank 0, then make
the "real" world as rank 2 of the same mesh (HSDP 2 x 2, or FSDP2 over TP 2 x 2; torch's fake
backend again: the cache cannot tell) and take the first optimizer step there, counting
DTensor's cache misses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch.distributed as dist

from nonstop.mesh import MeshSpec
from nonstop.train.link import PeerFailed
from nonstop.train.prewarm import MeshHistory, warm_sharded

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from nonstop.demo.model import GPT, PRESETS
    from nonstop.demo.train_sharded import shard_model
    from nonstop.mesh import MeshSpec
    from nonstop.train.meshgroups import mesh_of
    from nonstop.train.prewarm import warm_sharded

    mode = sys.argv[1]
    spec = MeshSpec.parse(sys.argv[2])
    def build(mesh):
        torch.manual_seed(0)
        model = GPT(PRESETS["tiny"])
        shard_model(model, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    warmed = None
    if mode != "cold":
        warmed = warm_sharded(build, spec, device_type="cpu", link=None)
        assert warmed is not None and warmed.meshes
        assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=4)
    groups = [dist.new_group(spec.group_of(2, d), use_local_synchronization=True) for d in spec.names]
    mesh = mesh_of(spec, groups, "cpu")
    adopted = warmed.adopt(mesh) if mode == "adopt" else None  # (Sharded.join: before build)
    model, opt = build(mesh)
    p = next(model.parameters())
    for q in model.parameters():
        q.grad = DTensor.from_local(torch.ones_like(q.to_local()), q.device_mesh, q.placements,
                                    shape=q.shape, stride=q.stride())
    _, misses0 = torch._C._get_DTensor_sharding_propagator_cache_stats()
    opt.step()
    _, misses1 = torch._C._get_DTensor_sharding_propagator_cache_stats()
    out = p.sqrt()  # an out-of-place op whose layout the first step cached
    print(json.dumps({
        "misses": misses1 - misses0,
        "adopted": adopted,
        "coordinate": out.device_mesh.get_coordinate(),
        "param_coordinate": p.device_mesh.get_coordinate(),
        "real_coordinate": mesh[p.device_mesh.mesh_dim_names].get_coordinate(),
        "same_groups": out.device_mesh._dim_group_names == p.device_mesh._dim_group_names,
    }))
    dist.destroy_process_group()
    """
)


def _run(mode: str, mesh: str = "replicate=2,shard=2") -> Any:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, mesh],
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cold_first_step_misses_the_cache() -> None:
    got = _run("cold")
    assert got["misses"] > 10, got  # (one per optimizer op and layout: the cost the warm-up removes)


@pytest.mark.parametrize("mesh", ["replicate=2,shard=2", "shard=2,tp=2"])
def test_a_warm_first_step_misses_nothing_and_adopted_layouts_name_the_real_rank(mesh: str) -> None:
    got = _run("adopt", mesh)  # (FSDP2 over TP: the tp submesh is adopted too)
    assert got["misses"] == 0, got
    assert got["adopted"] is True
    assert (
        got["coordinate"] == got["param_coordinate"] == got["real_coordinate"] != [0] * len(got["coordinate"])
    )
    assert got["same_groups"], got


def test_without_adopting_a_hit_would_name_the_warm_ups_rank() -> None:
    """Why :meth:`Warmed.adopt` exists: a cached layout carries the fake mesh, rank 0's -- even
    the parameters ``fully_shard`` makes in the real build do."""
    got = _run("warm")
    assert got["misses"] == 0, got
    assert got["coordinate"] == got["param_coordinate"] == [0, 0], got
    assert got["real_coordinate"] == [1, 0], got


class _Link:
    def __init__(self) -> None:
        self.in_step = False
        self.entered = 0

    def enter_step(self) -> None:
        self.in_step = True
        self.entered += 1


def test_an_interrupted_or_failed_warm_up_leaves_no_group_and_returns_none() -> None:
    """A reconfigure's interrupt (PeerFailed, as the link's handler raises it) or a failing
    build ends the warm-up: nothing is returned, no process group is left for the real join."""
    spec = MeshSpec.parse("shard=2")

    def interrupted(mesh: Any) -> Any:
        raise PeerFailed("a peer failed; abandoning this step")

    def broken(mesh: Any) -> Any:
        raise ValueError("the script's bug")

    for build in (interrupted, broken):
        link = _Link()
        assert warm_sharded(build, spec, device_type="cpu", link=link) is None
        assert link.entered == 1 and link.in_step is False
        assert not dist.is_initialized()


def test_a_warm_up_refuses_a_process_that_has_a_group(tmp_path: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="without a process group"):
            warm_sharded(lambda m: None, MeshSpec.parse("shard=1"), device_type="cpu", link=None)
    finally:
        dist.destroy_process_group()


RENUMBERED = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from nonstop.demo.model import GPT, PRESETS
    from nonstop.demo.train_sharded import shard_model
    from nonstop.mesh import MeshSpec
    from nonstop.snapshot.sharded import _offset, encode_dtensor
    from nonstop.train.meshgroups import mesh_of
    from nonstop.train.prewarm import MeshHistory

    history = MeshHistory() if sys.argv[1] == "history" else None
    spec = MeshSpec.parse("shard=3")
    def generation(rank):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=3)
        groups = [dist.new_group(spec.group_of(rank, d), use_local_synchronization=True) for d in spec.names]
        mesh = mesh_of(spec, groups, "cpu")
        if history is not None:
            history.joined(mesh, rank=rank)  # (Sharded.join: before build)
        torch.manual_seed(0)
        model = GPT(PRESETS["tiny"])
        shard_model(model, mesh)
        opt = torch.optim.AdamW(model.parameters())
        for q in model.parameters():
            q.grad = DTensor.from_local(torch.ones_like(q.to_local()), q.device_mesh, q.placements,
                                        shape=q.shape, stride=q.stride())
        opt.step()
        p = next(model.parameters())
        out = {"rank": rank, "real": list(mesh.get_coordinate()),
               "param": list(p.device_mesh.get_coordinate()),
               "offset": _offset(p), "state_offset": _offset(opt.state[p]["exp_avg"]),
               "snapshot_offset": encode_dtensor(p)[0]["offset"]}  # (the snapshot's cached layout)
        dist.destroy_process_group()
        return out
    print(json.dumps([generation(2), generation(1)]))  # rank 2, then (renumbered, grown back) rank 1
    """
)


def _renumbered(mode: str) -> Any:
    out = subprocess.run(
        [sys.executable, "-c", RENUMBERED, mode], capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_renumbered_at_a_mesh_shape_it_had_gets_its_own_offsets_again() -> None:
    """An elastic job's survivor that played rank 2 of shard=3, then (after a shrink and the grow
    back) rank 1 of shard=3: its parameters and optimizer state name rank 1's coordinate, and
    their snapshot offsets are rank 1's shard (the tiny model's first weight: 43 rows each)."""
    first, second = _renumbered("history")
    assert first["param"] == [2] and first["offset"][0] == 86
    assert second["real"] == second["param"] == [1], second
    assert second["offset"][0] == second["state_offset"][0] == second["snapshot_offset"][0] == 43, second


def test_without_the_history_a_renumbered_rank_records_its_old_offsets() -> None:
    """The defect MeshHistory mends: DTensor's cache hands the second generation's new
    parameters the first generation's mesh, rank 2's."""
    _, second = _renumbered("none")
    assert second["real"] == [1] and second["param"] == [2], second
    assert second["offset"][0] == 86, second


def test_older_meshes_take_the_new_group_names_when_a_generation_renames_a_group() -> None:
    """MeshHistory's other trigger: the same rank at the same shape, but a group under another
    name than last time (a torch that names groups otherwise than the ranks' hash): the older
    mesh a cached layout holds is given the new names, so its collectives find live groups."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nonstop.train.meshgroups import mesh_of

    spec = MeshSpec.parse("tp=2")
    history = MeshHistory()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        first = mesh_of(spec, [dist.new_group([0, 1])], "cpu")
        history.joined(first, rank=0)
        again = mesh_of(spec, [first.get_group("tp")], "cpu")  # a kept group, of the same name
        history.joined(again, rank=0)
        assert history.readopted == 0  # nothing renamed: no scan
        renamed = dist.new_group([0, 1])  # a group of the same ranks under another name
        assert renamed.group_name != again.get_group("tp").group_name
        latest = mesh_of(spec, [renamed], "cpu")
        history.joined(latest, rank=0)
        assert history.readopted >= 2
        assert first.get_group("tp").group_name == again.get_group("tp").group_name == renamed.group_name
    finally:
        dist.destroy_process_group()
