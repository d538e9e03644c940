"""Mesh groups kept across generations (nonstop/train/meshgroups.py): the pure decision, and
real gloo groups in four processes that outlive their world's destruction."""

from __future__ import annotations

import datetime
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nonstop.mesh import MeshSpec
from nonstop.train.meshgroups import GroupClaim, MeshGroups, agree, keep_decision, registry_supported

RANKS = [1, 3]
TOKEN = "4:replicate:1,3"


def claim(token: str = TOKEN, seq: int = 7, group_rank: int = 0) -> GroupClaim:
    return GroupClaim(token, seq, group_rank)


def test_a_group_every_member_holds_unchanged_is_kept() -> None:
    assert keep_decision([claim(), claim(group_rank=1)], dim="replicate", ranks=RANKS)


@pytest.mark.parametrize(
    "claims",
    [
        pytest.param([claim(), None], id="a new member (a spare) holds nothing"),
        pytest.param([claim(), claim(seq=8, group_rank=1)], id="a member issued one more collective"),
        pytest.param([claim(), claim(token="5:replicate:1,3", group_rank=1)], id="two different groups"),
        pytest.param([claim(group_rank=1), claim(group_rank=0)], id="members swapped places"),
        pytest.param([claim()], id="a member is missing"),
    ],
)
def test_a_group_is_built_again_unless_all_agree(claims: list[GroupClaim | None]) -> None:
    assert not keep_decision(claims, dim="replicate", ranks=RANKS)


def test_a_renumbered_group_is_kept_but_not_on_another_dim() -> None:
    both = [claim(), claim(group_rank=1)]
    assert keep_decision(both, dim="replicate", ranks=[0, 2])  # an elastic resize renumbered its members
    assert not keep_decision(both, dim="shard", ranks=RANKS)


CASES = [
    [claim(), claim(group_rank=1)],
    [claim(), None],
    [None, None],
    [claim(), claim(seq=8, group_rank=1)],
    [claim(), claim(token="5:replicate:1,3", group_rank=1)],
    [claim(group_rank=1), claim(group_rank=0)],
    [claim(token="4:shard:1,3"), claim(token="4:shard:1,3", group_rank=1)],
    [claim(), claim(group_rank=1), claim(group_rank=2)],
    [claim(), claim(group_rank=1), None],
]


@pytest.mark.parametrize("claims", CASES)
def test_the_store_protocol_reaches_the_pure_decision_on_every_member(
    claims: list[GroupClaim | None],
) -> None:
    ranks = list(range(len(claims)))
    store = dist.HashStore()
    with ThreadPoolExecutor(len(claims)) as pool:  # the members post concurrently, in any order
        votes = list(
            pool.map(
                lambda i: agree(store, "g", claims[i], dim="replicate", ranks=ranks, position=i),
                range(len(claims)),
            )
        )
    assert votes == [keep_decision(claims, dim="replicate", ranks=ranks)] * len(claims)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned(worker: Any, nprocs: int) -> Any:
    """Run ``worker(rank, port, results)`` in ``nprocs`` processes; their ``results`` by rank."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    mp.spawn(worker, args=(_port(), results), nprocs=nprocs, join=True)
    return results


def _worker(rank: int, port: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    spec = MeshSpec.parse("replicate=2,shard=2")
    groups = MeshGroups()
    seen = []
    for gen in (1, 2, 3, 4):
        me = (rank + 2) % 4 if gen == 4 else rank  # generation 4 renumbers: the replica groups swap
        gstore = dist.PrefixStore(f"gen{gen}/", store)
        timeout = datetime.timedelta(seconds=60)
        dist.init_process_group("gloo", store=gstore, rank=me, world_size=4, timeout=timeout)
        mesh = groups.build(
            spec,
            rank=me,
            generation=gen,
            store=gstore,
            device_type="cpu",
            timeout=timeout + datetime.timedelta(seconds=gen),
        )
        sums = []
        for dim in spec.names:
            x = torch.tensor([float(me)])
            dist.all_reduce(x, group=mesh.get_group(dim))
            sums.append(int(x.item()))
        # each group carries the collective timeout of the generation that built it
        timeouts = tuple(
            int(mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout.total_seconds())
            for d in spec.names
        )
        seen.append((groups.kept, groups.built, tuple(sums), timeouts))
        # generation 2 ends with rank 3 leaving mid-step (it tears its groups down); the others
        # leave at a boundary and park theirs
        dirty = gen == 2 and rank == 3
        if dirty:
            groups.drop()
        else:
            groups.park()
        dist.destroy_process_group()
    groups.drop()
    results[rank] = seen


@pytest.mark.skipif(not registry_supported(), reason="this torch lacks the group registry internals")
def test_real_gloo_groups_outlive_their_world_and_a_torn_one_is_built_again() -> None:
    results = _spawned(_worker, 4)
    # rank = 2 * replica + shard: shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}
    sums = {0: (2, 1), 1: (4, 1), 2: (2, 5), 3: (4, 5)}  # (replicate, shard) sums of the ranks
    for rank in range(4):
        first, second, third, fourth = results[rank]
        assert first == (0, 2, sums[rank], (61, 61))
        assert second == (2, 0, sums[rank], (61, 61))  # everyone parked at a boundary: all kept
        # rank 3 tore its groups down: its shard group {2,3} and replica group {1,3} are new
        kept = {0: 2, 1: 1, 2: 1, 3: 0}[rank]
        new = {0: (61, 61), 1: (63, 61), 2: (61, 63), 3: (63, 63)}[rank]  # (replicate, shard)
        assert third == (kept, 2 - kept, sums[rank], new)
        # renumbered: a shard group keeps its members in order (kept, under its new ranks); a
        # replica group's members swap places (built again)
        assert fourth[:3] == (1, 1, sums[(rank + 2) % 4]) and fourth[3][0] == 64


def _tp_worker(rank: int, port: int, results: Any) -> None:
    from nonstop.demo.model import GPT, PRESETS
    from nonstop.demo.train_sharded import shard_model

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    spec = MeshSpec.parse("tp=2")
    groups = MeshGroups()
    seen = []
    for gen in (1, 2):
        gstore = dist.PrefixStore(f"gen{gen}/", store)
        dist.init_process_group("gloo", store=gstore, rank=rank, world_size=2)
        mesh = groups.build(spec, rank=rank, generation=gen, store=gstore, device_type="cpu")
        torch.manual_seed(0)
        model = GPT(PRESETS["tiny"])  # a new model on the generation's mesh, as Sharded.join builds it
        shard_model(model, mesh)
        with torch.no_grad():  # the row-wise layer's output is summed over tp by name (funcol)
            out = model(torch.arange(32).view(1, 32) % 128)
        seen.append((groups.kept, float(out.sum())))
        groups.park()
        dist.destroy_process_group()
    groups.drop()
    results[rank] = seen


@pytest.mark.skipif(not registry_supported(), reason="this torch lacks the group registry internals")
def test_a_kept_tensor_parallel_group_serves_the_layouts_dtensor_cached_on_the_last_mesh() -> None:
    """DTensor caches a layout per mesh shape and finds a collective's group by the name the
    first mesh gave it: the kept tp group answers to that name (before, it was renamed, and the
    second generation's first forward failed with "Could not resolve the process group")."""
    results = _spawned(_tp_worker, 2)
    for rank in range(2):
        (kept1, out1), (kept2, out2) = results[rank]
        assert (kept1, kept2) == (0, 1)
        assert out2 == out1


def _unbound_worker(rank: int, port: int, results: Any) -> None:
    from nonstop.train.group import GenerationGroup

    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    spec = MeshSpec.parse("replicate=2,shard=2")
    group = GenerationGroup()
    seen = []
    for gen, unbound in ((1, False), (2, True)):
        gstore = dist.PrefixStore(f"gen{gen}/", store)

        def build(gen: int = gen, gstore: Any = gstore) -> Any:
            return group.mesh_groups.build(spec, rank=rank, generation=gen, store=gstore, device_type="cpu")

        mesh = group.join_plain(gstore, rank=rank, world_size=4, timeout_s=60, then=build, unbound=unbound)  # type: ignore[arg-type]
        world_sockets = len(group._sockets.created) if group._sockets is not None else -1
        sums = []
        for dim in spec.names:
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=mesh.get_group(dim))
            sums.append(int(x.item()))
        seen.append((world_sockets, os.environ.get("TORCH_GLOO_LAZY_INIT"), tuple(sums)))
        group.destroy()
    results[rank] = seen


def test_an_unbound_world_makes_no_connection_and_its_mesh_groups_work_on_real_gloo() -> None:
    """A sharded job's world (``join_plain(unbound=True)``) is created with gloo connecting
    lazily: it opens its listener and nothing else, where a bound world connects to every peer,
    while the mesh groups built after it connect as before and reduce correctly."""
    results = _spawned(_unbound_worker, 4)
    sums = {0: (2, 1), 1: (4, 1), 2: (2, 5), 3: (4, 5)}
    for rank in range(4):
        (bound_socks, bound_env, bound_sums), (lazy_socks, lazy_env, lazy_sums) = results[rank]
        assert bound_socks >= 4, results[rank]  # the listener and a connection to each of 3 peers
        assert lazy_socks <= 1, results[rank]  # the listener only
        assert bound_sums == lazy_sums == sums[rank]
        assert bound_env is None and lazy_env is None  # (the lazy setting never outlives the world)
