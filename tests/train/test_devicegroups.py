"""A device node's mesh groups (nonstop/train/devicegroups.py), on CPU with fakes.

No GPU has been lent to this project, so NCCL itself never runs here. What is checked is the
contract the NCCL path rests on: ``ncclCommSplit`` is a collective of the whole world -- the
k-th split of every rank is one call -- so a generation that keeps some groups and builds
others must still have every rank enter every dim's split, in the same order, the kept ones
without a colour. The fake world below enforces exactly that (a rank that skips or reorders a
split leaves the others waiting: the test times out with the ranks that did enter). Four ranks
run ``MeshGroups.build`` in four threads against one fake store and one fake world.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nonstop.control.rdzv import ChannelStore
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.train import devicegroups, meshgroups
from nonstop.train.meshgroups import MeshGroups

HSDP = MeshSpec.parse("replicate=2,shard=2")
TIMEOUT = datetime.timedelta(seconds=77)  # the world's collective timeout, for every group split


class FakeBackend:
    def __init__(self, pg: FakePG) -> None:
        self.pg = pg

    def abort(self) -> None:
        self.pg.events.append("abort")


class FakePG:
    """A mesh group as MeshGroups sees it: a sequence number, a rank, a device backend."""

    def __init__(self, ranks: list[int], rank: int) -> None:
        self.ranks, self._rank = ranks, rank
        self.seq = 0
        self.events: list[str] = []

    def _get_sequence_number_for_group(self) -> int:
        return self.seq

    def rank(self) -> int:
        return self.ranks.index(self._rank)

    def _get_backend(self, device: object) -> FakeBackend:
        assert str(device) == "cuda"
        return FakeBackend(self)

    def shutdown(self) -> None:
        self.events.append("shutdown")


class FakeWorld:
    """``ncclCommSplit`` over a world of ``n``: the k-th split of each rank is one collective.
    ``entered[k]``: rank -> the ranks it named as its group, or None (no colour)."""

    def __init__(self, n: int, timeout_s: float = 10.0) -> None:
        self.n, self.timeout_s = n, timeout_s
        self.cond = threading.Condition()
        self.count: dict[int, int] = defaultdict(int)
        self.entered: dict[int, dict[int, list[int] | None]] = defaultdict(dict)
        self.local = threading.local()
        self.timeouts: list[Any] = []

    def split_group(self, *, split_ranks: list[list[int]], timeout: Any = None, **_: Any) -> FakePG | None:
        rank = self.local.rank
        self.timeouts.append(timeout)
        mine = next((sorted(g) for g in split_ranks if rank in g), None)
        with self.cond:
            k = self.count[rank]
            self.count[rank] += 1
            self.entered[k][rank] = mine
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(self.entered[k]) == self.n, self.timeout_s):
                raise TimeoutError(f"split {k}: only ranks {sorted(self.entered[k])} entered")
            if mine is not None:  # NCCL groups the ranks by colour: the members must agree
                same = sorted(r for r, m in self.entered[k].items() if m == mine)
                assert same == mine, f"split {k}: colour {mine} was entered by {same}"
        return FakePG(mine, rank) if mine is not None else None


class DictStore:
    """The rendezvous store's calls ``agree`` and ``settle`` make, shared by threads."""

    def __init__(self) -> None:
        self.d: dict[str, Any] = {}
        self.cond = threading.Condition()

    def add(self, key: str, amount: int) -> int:
        with self.cond:
            self.d[key] = int(self.d.get(key, 0)) + amount
            self.cond.notify_all()
            return int(self.d[key])

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.d[key] = value
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.d, 10.0), key
            return bytes(self.d[key])


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeWorld, list[str]]]:
    """A device node whose world can split; torch's registry and DeviceMesh left out."""
    fake = FakeWorld(HSDP.world_size)
    drained: list[str] = []
    monkeypatch.setattr(devicegroups.dist, "split_group", fake.split_group)
    monkeypatch.setattr(devicegroups, "splits", lambda device_type: device_type == "cuda")
    monkeypatch.setattr(devicegroups, "drain", lambda device_type: drained.append(device_type))
    monkeypatch.setattr(meshgroups, "registry_supported", lambda: True)
    monkeypatch.setattr(meshgroups, "_unregister", lambda pg: {"parked": True})
    monkeypatch.setattr(meshgroups, "_register", _fake_register)
    monkeypatch.setattr(meshgroups, "_creation_name", _fake_creation_name)
    monkeypatch.setattr(meshgroups, "mesh_of", lambda spec, groups, device_type: groups)
    monkeypatch.setattr(dist, "new_group", _no_new_group)
    monkeypatch.delenv(devicegroups.SHARE_RESOURCES, raising=False)
    yield fake, drained


def _fake_register(group: Any, ranks: list[int], name: str) -> None:
    assert name == f"kept:{ranks}"
    group.entry = None


def _fake_creation_name(ranks: list[int], *, take_step: bool) -> str:
    assert not take_step, "an uncoloured split took the naming step already"
    return f"kept:{ranks}"


def _no_new_group(*_: Any, **__: Any) -> None:
    raise AssertionError("a device node that splits never creates a group by its members alone")


def _build_all(
    fake: FakeWorld | FakeNewGroup, ranks: dict[int, MeshGroups], store: DictStore, generation: int
) -> dict[int, list[FakePG]]:
    """Every rank's ``build`` at once, one thread each (``fake.local.rank`` says which rank a
    thread plays); their meshes (lists of groups)."""
    out: dict[int, list[FakePG]] = {}
    errors: list[BaseException] = []

    def run(rank: int, mesh: MeshGroups) -> None:
        fake.local.rank = rank
        try:
            out[rank] = mesh.build(
                HSDP, rank=rank, generation=generation, store=store, device_type="cuda", timeout=TIMEOUT
            )
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r, m)) for r, m in ranks.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(out) == sorted(ranks)
    return out


def _in_step(meshes: dict[int, list[FakePG]], *, on: Callable[[int, list[int]], bool]) -> None:
    """Each group's members issue one collective on it where ``on(rank, group ranks)``."""
    for rank, groups in meshes.items():
        for pg in groups:
            if on(rank, pg.ranks):
                pg.seq += 1


def test_a_first_generation_splits_each_dim_once_on_every_rank(world: tuple[FakeWorld, list[str]]) -> None:
    fake, drained = world
    meshes = _build_all(fake, {r: MeshGroups() for r in range(4)}, DictStore(), generation=1)
    assert [pg.ranks for pg in meshes[0]] == [[0, 2], [0, 1]]  # replicate, then shard
    assert [pg.ranks for pg in meshes[3]] == [[1, 3], [2, 3]]
    assert sorted(fake.entered) == [0, 1]  # one split per dim ...
    assert all(len(fake.entered[k]) == 4 for k in (0, 1))  # ... entered by the whole world
    assert drained == []  # nothing kept, nothing to drain
    assert fake.timeouts == [TIMEOUT] * 8  # every split carries the world's collective timeout


def test_a_failure_keeps_the_groups_without_the_lost_rank_and_every_rank_still_enters_each_split(
    world: tuple[FakeWorld, list[str]],
) -> None:
    """Rank 3 dies mid-step. Its groups (shard {2, 3}, replicate {1, 3}) are aborted on the
    survivors; {0, 1} and {0, 2} stay open, are parked with matched sequence numbers and kept;
    a spare plays rank 3. Had the keepers skipped the splits, ranks 1-3 would wait forever."""
    fake, drained = world
    ranks = {r: MeshGroups() for r in range(4)}
    meshes = _build_all(fake, ranks, DictStore(), generation=1)
    _in_step(meshes, on=lambda rank, members: True)  # a collective on every group, all matched
    first = {r: list(m) for r, m in meshes.items()}

    for r in (0, 1, 2):  # the survivors: found in a step, severed by the lost rank
        left = ranks[r].sever(lost=[3])
        untouched = [d for d, pg in zip(HSDP.names, first[r], strict=True) if 3 not in pg.ranks]
        assert sorted(g.dim for g in left) == sorted(untouched)
        ranks[r].leave()
    for r in (1, 2):  # the groups rank 3 was in were aborted (severed), never shut down cleanly
        assert [pg.events for pg in first[r] if 3 in pg.ranks] == [["abort"]]
    assert all(pg.events == [] for r in (0, 1, 2) for pg in first[r] if 3 not in pg.ranks)

    ranks[3] = MeshGroups()  # the spare: nothing parked
    fake_entries_before = len(fake.entered)
    meshes = _build_all(fake, ranks, DictStore(), generation=2)
    assert meshes[0] == first[0]  # rank 0 kept both its groups
    assert meshes[1][1] is first[1][1] and meshes[1][0] is not first[1][0]  # shard kept, replicate built
    assert meshes[2][0] is first[2][0] and meshes[2][1] is not first[2][1]  # replicate kept, shard built
    assert (ranks[0].kept, ranks[0].built, ranks[3].kept, ranks[3].built) == (2, 0, 0, 2)
    splits = [fake.entered[k] for k in range(fake_entries_before, len(fake.entered))]
    assert len(splits) == 2 and all(len(s) == 4 for s in splits)  # every rank, once per dim
    assert splits[0] == {0: None, 1: [1, 3], 2: None, 3: [1, 3]}  # replicate: {0, 2} kept
    assert splits[1] == {0: None, 1: None, 2: [2, 3], 3: [2, 3]}  # shard: {0, 1} kept
    assert sorted(drained) == ["cuda"] * 3  # each rank that kept a group waited for it


def test_a_group_left_with_unmatched_collectives_is_built_again_in_the_split(
    world: tuple[FakeWorld, list[str]],
) -> None:
    """Rank 0 issued a collective on {0, 1} that rank 1 never did: the agreement builds the
    group again, and the parked one is aborted before it is shut down (a clean shutdown would
    wait for the collective that never completes)."""
    fake, _ = world
    ranks = {r: MeshGroups() for r in range(4)}
    meshes = _build_all(fake, ranks, DictStore(), generation=1)
    old_shard = meshes[0][1]
    _in_step(meshes, on=lambda rank, members: members == [0, 1] and rank == 0)
    for r in (0, 1, 2):
        ranks[r].sever(lost=[3])
        ranks[r].leave()
    ranks[3] = MeshGroups()
    meshes = _build_all(fake, ranks, DictStore(), generation=2)
    assert meshes[0][1] is not old_shard and meshes[0][1].ranks == [0, 1]
    assert old_shard.events == ["abort", "shutdown"]
    assert fake.entered[3] == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}


def test_with_shared_split_resources_a_device_node_keeps_nothing_through_a_failure(
    world: tuple[FakeWorld, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that shares the world's resources may not outlive the world's abort."""
    fake, _ = world
    ranks = {r: MeshGroups() for r in range(4)}
    meshes = _build_all(fake, ranks, DictStore(), generation=1)
    monkeypatch.setenv(devicegroups.SHARE_RESOURCES, "1")
    assert ranks[0].sever(lost=[3]) == []
    assert all(pg.events == ["abort"] for pg in meshes[0])


def test_keeps_through_failure_reads_the_share_setting() -> None:
    assert devicegroups.keeps_through_failure({})
    assert devicegroups.keeps_through_failure({devicegroups.SHARE_RESOURCES: "0"})
    assert not devicegroups.keeps_through_failure({devicegroups.SHARE_RESOURCES: "1"})


def test_a_cpu_world_never_splits() -> None:
    assert not devicegroups.splits("cpu")


def test_an_uncoloured_split_that_hands_back_a_group_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devicegroups.dist, "split_group", lambda **_: object())
    with pytest.raises(RuntimeError, match="no colour"):
        devicegroups.split([0, 1], member=False, rank=2, world_size=4)
    assert devicegroups.split([0], member=False, rank=0, world_size=1) is None


def test_an_abort_that_fails_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def _get_backend(self, device: object) -> Any:
            raise RuntimeError("no such backend")

    devicegroups.abort(Broken(), "cuda")
    assert "aborting a mesh group's device communicators failed" in caplog.text


def test_a_channel_store_clones_to_itself_through_a_prefix_store() -> None:
    """torch's split clones the group's store (``PrefixStore.clone`` -> the inner store's):
    a Python store without ``clone`` fails there on a pure virtual call."""
    sent: list[dict[str, Any]] = []
    store = ChannelStore(sent.append, generation=3, timeout_s=0.01)
    clone = dist.PrefixStore("g/", store).clone()
    with pytest.raises(Exception, match="timed out"):
        clone.set("k", b"v")  # reaches the same channel, under the prefix
    assert sent and sent[0]["key"] == "g//k" and sent[0]["gen"] == 3


# -- independent mode (the default): each group its members' own communicator, no world split --


class FakeNewGroup:
    """``new_group(use_local_synchronization=True, device_id=...)`` as an unbound world serves
    it: a communicator among the members alone -- only they call, nobody else waits."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], Any, Any]] = []
        self.local = threading.local()
        self.lock = threading.Lock()

    def __call__(
        self, ranks: list[int], *, timeout: Any, use_local_synchronization: bool, device_id: Any
    ) -> FakePG:
        assert use_local_synchronization, "an independent group is made by its members only"
        rank = self.local.rank
        assert rank in ranks, f"rank {rank} asked for a group it is not in: {ranks}"
        with self.lock:
            self.calls.append((rank, sorted(ranks), device_id, timeout))
        return FakePG(sorted(ranks), rank)


@pytest.fixture
def independent(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeNewGroup, FakeWorld]]:
    """A device node in independent mode: the world is unbound, so it cannot split; a split
    entered anyway would fail the test (the fake world's splits are counted)."""
    made = FakeNewGroup()
    fake = FakeWorld(HSDP.world_size, timeout_s=0.5)
    monkeypatch.setattr(devicegroups.dist, "split_group", fake.split_group)
    monkeypatch.setattr(devicegroups, "splits", lambda device_type: False)
    monkeypatch.setattr(devicegroups, "drain", lambda device_type: None)
    monkeypatch.setattr(devicegroups.torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(meshgroups, "registry_supported", lambda: True)
    monkeypatch.setattr(meshgroups, "_unregister", lambda pg: {"parked": True})
    monkeypatch.setattr(meshgroups, "_register", lambda group, ranks, name: None)
    monkeypatch.setattr(meshgroups, "_creation_name", lambda ranks, take_step: f"kept:{ranks}")
    monkeypatch.setattr(meshgroups, "mesh_of", lambda spec, groups, device_type: groups)
    monkeypatch.setattr(dist, "new_group", made)
    monkeypatch.setenv(devicegroups.SHARE_RESOURCES, "1")  # (no world to share with: irrelevant)
    yield made, fake


def test_independent_groups_are_their_members_own_eager_communicators(
    independent: tuple[FakeNewGroup, FakeWorld],
) -> None:
    made, fake = independent
    meshes = _build_all(made, {r: MeshGroups() for r in range(4)}, DictStore(), generation=1)
    assert [pg.ranks for pg in meshes[0]] == [[0, 2], [0, 1]]
    assert len(made.calls) == 8 and not fake.entered  # one per group and member; no split
    assert {(c[2], c[3]) for c in made.calls} == {(torch.device("cuda", 0), TIMEOUT)}  # eager, timed


def test_independent_groups_survive_a_failure_and_only_the_lost_ranks_groups_are_made_again(
    independent: tuple[FakeNewGroup, FakeWorld],
) -> None:
    """Rank 3 dies mid-step. The survivors abort only {1, 3} and {2, 3}; the groups rank 3 was
    not in are kept even with NCCL_COMM_SPLIT_SHARE_RESOURCES=1 (nothing is split from a world
    that every failure aborts). The next generation makes {1, 3} and {2, 3} again, called by
    their members alone: rank 0 makes nothing, and nobody enters a split for it."""
    made, fake = independent
    ranks = {r: MeshGroups() for r in range(4)}
    meshes = _build_all(made, ranks, DictStore(), generation=1)
    _in_step(meshes, on=lambda rank, members: True)
    first = {r: list(m) for r, m in meshes.items()}
    for r in (0, 1, 2):
        left = ranks[r].sever(lost=[3])
        assert sorted(g.dim for g in left) == sorted(
            d for d, pg in zip(HSDP.names, first[r], strict=True) if 3 not in pg.ranks
        )
        ranks[r].leave()
    assert [pg.events for r in (1, 2) for pg in first[r] if 3 in pg.ranks] == [["abort"], ["abort"]]
    ranks[3] = MeshGroups()
    made.calls.clear()
    meshes = _build_all(made, ranks, DictStore(), generation=2)
    assert meshes[0] == first[0] and ranks[0].kept == 2
    assert sorted((c[0], tuple(c[1])) for c in made.calls) == [
        (1, (1, 3)),
        (2, (2, 3)),
        (3, (1, 3)),
        (3, (2, 3)),
    ]
    assert not fake.entered


def test_the_device_groups_mode_defaults_to_independent_and_refuses_anything_else() -> None:
    assert devicegroups.mode({}) == devicegroups.INDEPENDENT
    assert devicegroups.mode({devicegroups.MODE: " Split "}) == devicegroups.SPLIT
    with pytest.raises(UsageError, match="NONSTOP_DEVICE_GROUPS='ring'"):
        devicegroups.mode({devicegroups.MODE: "ring"})
    assert devicegroups.keeps_through_failure({devicegroups.SHARE_RESOURCES: "1"}, split_from_world=False)


def test_a_lazy_world_sets_gloo_lazy_only_while_it_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devicegroups.GLOO_LAZY, raising=False)
    with devicegroups.lazy_world():
        assert os.environ[devicegroups.GLOO_LAZY] == "1"
    assert devicegroups.GLOO_LAZY not in os.environ
    monkeypatch.setenv(devicegroups.GLOO_LAZY, "0")  # the user's own setting comes back
    with devicegroups.lazy_world():
        pass
    assert os.environ[devicegroups.GLOO_LAZY] == "0"


@pytest.mark.parametrize("unbound", [True, False])
def test_a_sharded_jobs_world_on_a_gpu_is_not_bound_to_the_device(
    monkeypatch: pytest.MonkeyPatch, unbound: bool
) -> None:
    """``join_plain(unbound=True)`` on a GPU node: no ``device_id`` (NCCL makes no world
    communicator) and gloo lazy while the world is created; bound: the rank's GPU, eager."""
    from nonstop.train import group as group_mod

    calls: list[tuple[Any, str | None]] = []

    class World:
        def _get_backend(self, device: object) -> object:
            return object()

    def init(backend: str, **kw: Any) -> None:
        calls.append((kw["device_id"], os.environ.get(devicegroups.GLOO_LAZY)))

    monkeypatch.delenv(devicegroups.GLOO_LAZY, raising=False)
    monkeypatch.setattr(group_mod, "worker_device", lambda: torch.device("cuda", 3))
    fake_dist = SimpleNamespace(init_process_group=init, group=SimpleNamespace(WORLD=World()))
    monkeypatch.setattr(group_mod, "dist", fake_dist)  # (join_plain's only torch.distributed calls)
    gg = group_mod.GenerationGroup()
    assert (
        gg.join_plain(DictStore(), rank=0, world_size=4, timeout_s=5, then=lambda: "mesh", unbound=unbound)
        == "mesh"
    )  # type: ignore[arg-type]
    assert calls == [(None, "1")] if unbound else calls == [(torch.device("cuda", 3), None)]
    assert devicegroups.GLOO_LAZY not in os.environ
