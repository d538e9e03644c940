"""Settling a sharded job's mesh groups after a failure (nonstop/train/settle.py): the pure verdict,
the watcher thread, and real gloo groups in four processes where rank 3 dies mid-step and the
survivors keep the groups it was not in."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nonstop.mesh import MeshSpec
from nonstop.protocol.base import WireError
from nonstop.train.group import GenerationGroup
from nonstop.train.meshgroups import GroupClaim, OpenGroup, registry_supported
from nonstop.train.settle import Settling, Verdict, lost_ranks, post, verdict
from tests.worker_fakes import order


@pytest.mark.parametrize(
    ("own", "posted", "expected"),
    [
        (5, [4], Verdict.SEVER),  # this rank issued a 5th collective the peer never will
        (5, [None, 4], Verdict.SEVER),  # one such peer is enough
        (5, [5, 5], Verdict.MATCHED),
        (5, [6], Verdict.MATCHED),  # the peer is ahead: nothing of ours waits on it
        (5, [5, None], Verdict.WAIT),  # a peer still in its step
        (5, [], Verdict.MATCHED),
    ],
)
def test_verdict(own: int, posted: list[int | None], expected: Verdict) -> None:
    assert verdict(own, posted) is expected


def test_only_a_recovery_that_names_its_lost_ranks_settles() -> None:
    def reconfigure(**fields: Any) -> Any:
        return order({"t": "reconfigure", **fields})

    assert lost_ranks(reconfigure(recovery=True, lost=[3, 1])) == [3, 1]
    assert lost_ranks(reconfigure(recovery=True)) is None  # (an older coordinator): sever everything
    assert lost_ranks(reconfigure(recovery=False, lost=[1])) is None  # a re-plan
    assert lost_ranks(order({"t": "leave", "gen": 2, "recovery": True, "lost": [0]})) == [0]
    for bad in (["1"], [True]):  # a malformed list: the order is malformed (train/link.py)
        with pytest.raises(WireError):
            reconfigure(recovery=True, lost=bad)


class _Fake:
    def __init__(self, dim: str, seq: int, position: int = 0, size: int = 2) -> None:
        self.cut = False
        self.group = OpenGroup(dim, f"1:{dim}:0,1", position, size, lambda: seq, self._cut)

    def _cut(self) -> None:
        self.cut = True


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_watcher_severs_the_group_a_peer_left_behind_and_keeps_the_matched_one() -> None:
    store = dist.HashStore()
    behind, matched = _Fake("shard", seq=7), _Fake("replicate", seq=3)
    in_step = [True]
    s = Settling(store, [behind.group, matched.group], lambda: in_step[0], limit_s=30)
    post(store, [GroupClaim(behind.group.token, 6, 1), GroupClaim(matched.group.token, 3, 1)])
    _wait(lambda: behind.cut)
    time.sleep(0.05)
    assert not matched.cut and set(s.severed) == {"shard"}
    in_step[0] = False  # the main thread left its step: the watcher ends
    s.join(5)
    assert not matched.cut


def test_a_rank_still_in_its_step_at_the_limit_has_every_open_group_severed() -> None:
    store = dist.HashStore()
    waiting = _Fake("shard", seq=2)  # its peer never posts
    s = Settling(store, [waiting.group], lambda: True, limit_s=0.1)
    s.join(5)
    assert waiting.cut and "still in the step" in s.severed["shard"]


def test_a_watcher_whose_store_fails_keeps_nothing() -> None:
    class Broken:
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("rendezvous aborted: a newer generation started")

    g = _Fake("shard", seq=2)
    s = Settling(Broken(), [g.group], lambda: True, limit_s=30)
    s.join(5)
    assert g.cut and "settling failed" in s.severed["shard"]


# -- real gloo groups ----------------------------------------------------------------------------
# rank = 2 * replica + shard: shard groups {0,1} {2,3}, replicate groups {0,2} {1,3}
SPEC = "replicate=2,shard=2"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(group: GenerationGroup, store: Any, rank: int, gen: int) -> Any:
    gstore = dist.PrefixStore(f"gen{gen}/", store)
    spec = MeshSpec.parse(SPEC)

    def mesh() -> Any:
        return group.mesh_groups.build(spec, rank=rank, generation=gen, store=gstore, device_type="cpu")

    return group.join_plain(gstore, rank=rank, world_size=4, timeout_s=60, then=mesh)


def _sums(mesh: Any, rank: int) -> tuple[int, ...]:
    out = []
    for dim in ("replicate", "shard"):
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=mesh.get_group(dim))
        out.append(int(x.item()))
    return tuple(out)


def _worker(rank: int, port: int, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    settle_store = dist.PrefixStore("gen2/", store)  # the recovery's generation's keys
    group = GenerationGroup()
    mesh = _join(group, store, rank, 1)
    _sums(mesh, rank)
    one = torch.ones(1)
    # the step: a shard collective, then rank 3 dies, then replicate and shard collectives
    dist.all_reduce(one, group=mesh.get_group("shard"))
    if rank == 3:
        group.sever()  # its sockets close as a killed process's do
        group.destroy()
        store.set("dead", b"1")
        group, severed = GenerationGroup(), None  # a fresh process takes rank 3
    else:
        in_step = [True]
        settling: list[Settling] = []
        if rank == 0:  # the recovery reaches rank 0 inside its step (the link's reader thread)

            def reader() -> None:
                store.wait(["dead"])
                left = group.sever([3])
                settling.append(Settling(settle_store, left, lambda: in_step[0]))

            threading.Thread(target=reader, daemon=True).start()
        try:
            dist.all_reduce(one, group=mesh.get_group("replicate"))  # {1,3} fails: 3 is gone
            dist.all_reduce(one, group=mesh.get_group("shard"))  # {2,3} fails; {0,1} waits on 1
        except Exception:
            pass
        in_step[0] = False
        claims = group.destroy()
        if rank != 0:  # its own collective failed first: no sever; the recovery names rank 3
            store.wait(["dead"])
            claims = group.settle([3])
        post(settle_store, claims)
        severed = dict(settling[0].severed) if settling else None
    mesh = _join(group, store, rank, 2)
    g = group.mesh_groups
    results[rank] = (g.kept, g.built, _sums(mesh, rank), severed)
    group.destroy()


@pytest.mark.skipif(not registry_supported(), reason="this torch lacks the group registry internals")
def test_survivors_keep_the_groups_a_dead_rank_was_not_in_and_settle_the_one_left_waiting() -> None:
    """Rank 3 dies after the step's first collective. Rank 1's replicate collective with it fails;
    rank 2's replicate one with rank 0 completes, its shard one with 3 fails; rank 0 then waits in
    a shard collective that rank 1, gone from its step, will never join: rank 1's post frees it.
    The next generation keeps the replicate group {0,2} (both left at the same sequence number)
    and builds the others again -- {0,1} too, since rank 0 issued one collective more on it."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_port(), results), nprocs=4, join=True)
    sums = {0: (2, 1), 1: (4, 1), 2: (2, 5), 3: (4, 5)}  # (replicate, shard) sums of the ranks
    kept = {0: 1, 1: 0, 2: 1, 3: 0}
    for rank in range(4):
        assert results[rank][:3] == (kept[rank], 2 - kept[rank], sums[rank]), rank
    assert set(results[0][3]) == {"shard"} and "a peer left it" in results[0][3]["shard"]
