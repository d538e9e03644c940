"""A sharded job's mesh groups, kept across generations when nothing about them changed.

Member replacement for collective groups (what TrainMover does on a migration): when a new
generation starts, only the mesh groups (``shard``, ``replicate``, ``tp``) that contain a
replaced rank, a rank that moved, or a member whose collectives on it the others did not all
match are built again; the others are carried over with their connections. The default (world) group is always
new: it contains every rank, so some member of it changed -- but it carries no collective of a
sharded job, and is created without connections (:meth:`GenerationGroup.join_plain`, ``unbound``).

**When a group is kept** -- every member of the group in the new generation agrees, through the
new generation's rendezvous store (:func:`agree`, a few round trips per member whatever the
group's size), that it holds the *same* group object (created in the same
generation, for the same dim, with the same ranks), at the *same* collective sequence number,
at its position in the new group (see :func:`keep_decision`, pure). A member that is new (a
spare, a joiner), or that tore the group down, has nothing parked and says so: the group is
then built again by all its members. Agreement is needed because each member's
view alone is not enough -- its peer may have left its step mid-collective.

**Mid-step** -- a rank that abandons a step (its collective failed, or a recovery interrupted
it) may have a collective in flight on *any* of its groups, and gloo can neither cancel it nor
realign the peers' sequence numbers. What a recovery can keep is decided in
:mod:`nonstop.train.settle`: the groups with a failed rank in them are severed
(:meth:`MeshGroups.sever` with ``lost``, :meth:`MeshGroups.forget`), the others are parked with
their collectives in flight (:meth:`MeshGroups.leave`), and the next :meth:`build` keeps one only
if its members' sequence numbers agree -- then every collective any of them issued on it was
issued by all, and completes on its own. A re-plan or a second reconfigure in one step severs
everything (:meth:`MeshGroups.drop` then half-closes every socket, so blocked peers fail at once).

**Device nodes** -- the same decisions, carried out by :mod:`nonstop.train.devicegroups`: a
group is built as its members' own communicator, created at once (or, with
``NONSTOP_DEVICE_GROUPS=split``, by a split of the world's device communicator that every rank
enters once per dim, a kept group's members without a colour), severed by aborting its
communicators, and drained before a generation reuses it. Untested on a GPU until one is lent
(docs/architecture.md).

**torch internals** -- a group outlives ``destroy_process_group()`` of the world only if it is
taken out of torch's group registry first (``distributed_c10d._world`` and the named-group
registry) and put back after the new world is created, with its members' new global ranks,
under the name a new group of those ranks would get (:func:`_creation_name`). These are
private; if this torch lacks them every group is simply built again (:func:`registry_supported`).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nonstop.mesh import MeshSpec
from nonstop.train import devicegroups
from nonstop.train.abort import SocketWatch

__all__ = ["GroupClaim", "MeshGroups", "OpenGroup", "agree", "keep_decision", "mesh_of", "registry_supported"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupClaim:
    """What one member says about the group it would keep: the group's token (creation
    generation, dim, ranks at creation), its collective sequence number, and its rank in it."""

    token: str
    seq: int
    group_rank: int


def keep_decision(claims: list[GroupClaim | None], *, dim: str, ranks: list[int]) -> bool:
    """``claims[i]``: what the member at position ``i`` of the new group (global ``ranks``,
    on ``dim``) holds. The group is kept when every member holds the same group, made for this
    dim, at the same sequence number, each at its own position -- whatever the members' global
    ranks are now (an elastic resize renumbers ranks). Pure: every member computes the same
    answer from the same claims."""
    if not claims or len(claims) != len(ranks) or any(c is None for c in claims):
        return False
    first = claims[0]
    assert first is not None
    return first.token.split(":")[1] == dim and all(
        c is not None and c.token == first.token and c.seq == first.seq and c.group_rank == i
        for i, c in enumerate(claims)
    )


def agree(
    store: Any, key: str, claim: GroupClaim | None, *, dim: str, ranks: list[int], position: int
) -> bool:
    """:func:`keep_decision` for one group, reached through ``store`` (``key``: the group's
    prefix in this generation) in a few round trips per member whatever the group's size: a
    member whose claim holds up counts itself under its claim (token and sequence number), every
    member counts itself as posted, and the last to post -- every other member has counted by
    then -- keeps the group if its own claim's count is the group's size, and says so to all."""
    n = len(ranks)
    mine = None
    if claim is not None and claim.group_rank == position and claim.token.split(":")[1] == dim:
        mine = f"{key}/ok/{claim.token}|{claim.seq}"
        store.add(mine, 1)
    if store.add(f"{key}/posted", 1) == n:
        keep = mine is not None and store.add(mine, 0) == n
        store.set(f"{key}/decision", b"1" if keep else b"0")
    return bytes(store.get(f"{key}/decision")) == b"1"


def _c10d() -> Any:
    """torch's process-group module, whose private registry a kept group goes through."""
    from torch.distributed import distributed_c10d

    return distributed_c10d


def registry_supported() -> bool:
    """Whether this torch has the registry internals a kept group needs."""
    c10d = _c10d()
    world = getattr(c10d, "_world", None)
    names = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg")
    return (
        world is not None
        and all(hasattr(world, n) for n in names)
        and hasattr(c10d, "_register_process_group")
        and hasattr(c10d, "_unregister_process_group")
    )


@dataclass
class _Group:
    pg: Any  # torch.distributed.ProcessGroup
    token: str
    sockets: SocketWatch
    ranks: list[int]  # its members' global ranks in the generation it serves now
    entry: dict[str, Any] | None = None  # its registry entry while parked
    severed: bool = False  # its reads were shut: never parked, never kept

    def seq(self) -> int:
        return int(self.pg._get_sequence_number_for_group())

    def claim(self) -> GroupClaim:
        """What this member says about the group at the next generation's agreement."""
        return GroupClaim(self.token, self.seq(), int(self.pg.rank()))

    def has_any(self, ranks: Collection[int] | None) -> bool:
        """Whether a member is one of ``ranks`` (None: every rank counts as lost)."""
        return ranks is None or not set(self.ranks).isdisjoint(ranks)


@dataclass(frozen=True)
class OpenGroup:
    """A group a partial :meth:`MeshGroups.sever` left open: what settling it needs
    (:mod:`nonstop.train.settle`). ``seq()`` reads its sequence number (any thread);
    ``sever()`` shuts it like the others, unless the rank has left its step already."""

    dim: str
    token: str
    position: int
    size: int
    seq: Callable[[], int]
    sever: Callable[[], None]


class MeshGroups:
    """This rank's mesh groups (one per dim), live or parked between generations.

    Threading contract: main thread only, like :class:`~nonstop.train.group.GenerationGroup`
    which owns it. ``kept``, ``built`` and ``build_s`` (its seconds) describe the last
    :meth:`build`.
    """

    def __init__(self, *, keep: bool = True) -> None:
        self._keep = keep and registry_supported()
        self._groups: dict[str, _Group] = {}  # dim -> group
        self._parked = False
        self._lock = threading.Lock()  # sever (a control thread) against park/leave (main thread)
        self._device_type = "cpu"  # the last build's
        self._splits = False  # the last build split its groups from the world's device communicator
        self.kept = 0
        self.built = 0
        self.build_s = 0.0

    def build(
        self,
        spec: MeshSpec,
        *,
        rank: int,
        generation: int,
        store: Any,
        device_type: str,
        timeout: datetime.timedelta | None = None,
    ) -> Any:
        """The generation's ``DeviceMesh`` for ``spec``, in the default group just created
        through ``store`` (the generation's rendezvous store): a parked group every member
        agrees to keep is put back, every other group is created by its members only (on a
        device node: as their own eager communicator, or split from a bound world,
        :mod:`nonstop.train.devicegroups`). ``timeout``: the
        new groups' collective timeout, the world's (None: torch's default for the backend)."""
        t0 = time.monotonic()
        self._device_type = device_type
        self._splits = devicegroups.splits(device_type)
        parked, self._groups = self._groups, {}
        self.kept = self.built = 0
        groups = []
        for dim in spec.names:  # in the same order on every rank: no claim waits on a later dim
            ranks = spec.group_of(rank, dim)
            old = parked.pop(dim, None)
            claim = old.claim() if old is not None else None
            token = _token(generation, dim, ranks)  # the group this generation would build
            keep = self._keep and agree(
                store, f"nonstop/keep/{token}", claim, dim=dim, ranks=ranks, position=ranks.index(rank)
            )
            if keep:
                assert old is not None  # (a member without a claim never agrees)
                if self._splits:  # every rank enters each dim's split (devicegroups): this one uncoloured
                    name = _creation_name(ranks, take_step=False)  # (the split takes the step)
                    devicegroups.split(
                        ranks, member=False, rank=rank, world_size=spec.world_size, timeout=timeout
                    )
                else:
                    name = _creation_name(ranks, take_step=True)
                _register(old, ranks, name or _fresh_name(old, generation))
                old.ranks = list(ranks)
                group, self.kept = old, self.kept + 1
            else:
                if old is not None:
                    _shutdown(old, device_type)
                watch = SocketWatch()
                try:
                    if self._splits:
                        pg = devicegroups.split(
                            ranks, member=True, rank=rank, world_size=spec.world_size, timeout=timeout
                        )
                    else:  # its members' own communicator, eager on a device (devicegroups)
                        pg = dist.new_group(
                            ranks,
                            timeout=timeout,
                            use_local_synchronization=True,
                            device_id=devicegroups.eager_device(device_type),
                        )
                finally:
                    watch.stop()
                group = _Group(pg, token, watch, list(ranks))
                self.built += 1
            self._groups[dim] = group
            groups.append(group.pg)
        for old in parked.values():  # dims this generation's mesh no longer has
            _shutdown(old, device_type)
        self._parked = False
        if self.kept:  # a group kept mid-step may have (matched) collectives still in flight
            devicegroups.drain(device_type)
        mesh = mesh_of(spec, groups, device_type)
        self.build_s = time.monotonic() - t0
        return mesh

    @property
    def parked(self) -> bool:
        """The groups are out of torch's registry, waiting for the next :meth:`build`."""
        return self._parked

    def park(self) -> None:
        """Leave the generation at a step boundary: take the groups out of torch's registry so
        they outlive the world's ``destroy_process_group``. Nothing is closed. Without keeping,
        they go with the world's groups and are forgotten here."""
        if not self._keep:
            self._groups = {}
            return
        with self._lock:
            if self._parked:
                return
            for group in self._groups.values():
                group.entry = _unregister(group.pg)
            self._parked = True

    def sever(self, lost: Collection[int] | None = None) -> list[OpenGroup]:
        """Fail collectives in flight on the live (unparked) groups now (any thread;
        :meth:`SocketWatch.shut_reads`). ``lost`` (global ranks of this generation that failed):
        only the groups with a lost member are shut, and the others are returned, left open for
        :mod:`nonstop.train.settle` to shut the ones whose members cannot meet again and for
        :meth:`leave` to park the rest. None: every group is shut."""
        with self._lock:
            if self._parked:
                return []
            lost = self._keepable(lost)
            left: list[OpenGroup] = []
            for dim, group in self._groups.items():
                if not self._keep or group.severed or group.has_any(lost):
                    self._shut(group)
                else:
                    left.append(self._open(dim, group))
            return left

    def _open(self, dim: str, group: _Group) -> OpenGroup:
        def sever() -> None:
            with self._lock:
                if not self._parked:  # (parked by leave: its claim stands, its sockets stay)
                    self._shut(group)

        return OpenGroup(dim, group.token, int(group.pg.rank()), len(group.ranks), group.seq, sever)

    def _shut(self, group: _Group) -> None:
        """Fail the group's collectives in flight: gloo's sockets shut for reading, and on a
        device node its device backend's communicators aborted (NCCL: a kernel waiting on a
        dead peer returns; each mesh group has communicators of its own, which aborting the
        default group's does not reach)."""
        group.severed = True
        group.sockets.shut_reads()
        if self._device_type != "cpu":
            devicegroups.abort(group.pg, self._device_type)

    def leave(self) -> list[GroupClaim]:
        """Leave the generation mid-step: the severed groups are torn down like :meth:`drop`'s,
        the others are parked with whatever collectives they have in flight -- the next
        :meth:`build` keeps one only if its members' sequence numbers agree, which says that
        every collective any of them issued on it was issued by all, so it completes on its
        own. Returns the parked groups' claims (:func:`nonstop.train.settle.post`); a recovery
        that did not sever first tears down the ones with a lost member (:meth:`forget`)."""
        if not self._keep:
            self.drop()
            return []
        with self._lock:
            for dim, group in list(self._groups.items()):
                if group.severed:
                    group.sockets.half_close()
                    del self._groups[dim]
                elif group.entry is None:
                    group.entry = _unregister(group.pg)
            self._parked = True
            return self._claims()

    def forget(self, lost: Collection[int] | None) -> list[GroupClaim]:
        """Parked groups: tear down those with a ``lost`` member (every one: None), and return
        the claims of the rest."""
        with self._lock:
            lost = self._keepable(lost)
            for dim, group in list(self._groups.items()):
                if group.has_any(lost):
                    _shutdown(group, self._device_type)
                    del self._groups[dim]
            return self._claims()

    def _keepable(self, lost: Collection[int] | None) -> Collection[int] | None:
        """``lost``, or None (keep nothing): on a device node whose groups are split from the
        world with the world's resources shared, which every failure aborts
        (:mod:`nonstop.train.devicegroups`)."""
        if self._device_type == "cpu" or devicegroups.keeps_through_failure(split_from_world=self._splits):
            return lost
        return None

    def _claims(self) -> list[GroupClaim]:
        return [g.claim() for g in self._groups.values()]

    def drop(self) -> None:
        """Leave the generation mid-step (or for good): half-close every group's sockets so
        peers blocked on this rank fail at once, and forget them."""
        with self._lock:
            for group in self._groups.values():
                if self._parked:  # out of torch's registry: the world's teardown will not close it
                    _shutdown(group, self._device_type)
                else:
                    group.sockets.half_close()
            self._groups, self._parked = {}, False


def mesh_of(spec: MeshSpec, groups: list[Any], device_type: str) -> Any:
    """The ``DeviceMesh`` of ``spec`` over this rank's ``groups`` (one per dim, in ``spec.names``
    order). Every generation's mesh and a spare's warm-up mesh (:mod:`nonstop.train.prewarm`) are
    made here, so that they compare equal (DTensor's cache keys on that)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(
        groups,
        device_type,
        mesh=torch.arange(spec.world_size).view(spec.shape),
        mesh_dim_names=spec.names,
    )


def _token(generation: int, dim: str, ranks: list[int]) -> str:
    return f"{generation}:{dim}:{','.join(map(str, ranks))}"


def _unregister(pg: Any) -> dict[str, Any]:
    c10d = _c10d()
    w = c10d._world
    entry: dict[str, Any] = {
        "map": w.pg_map.pop(pg),
        "name": w.pg_names.pop(pg),
        "cfg": w.pg_backend_config.pop(pg),
        "tag": w.pg_to_tag.pop(pg, None),
    }
    w.pg_group_ranks.pop(pg, None)
    for members in w.tags_to_pg.values():
        while pg in members:
            members.remove(pg)
    c10d._unregister_process_group(entry["name"])
    return entry


def _creation_name(ranks: list[int], *, take_step: bool) -> str | None:
    """The name torch would give a group of ``ranks`` created now, or None where this torch
    cannot say or another group holds that name. A kept group is put back under it, for DTensor:
    its cache hands back layouts computed on the first mesh of each shape it saw (meshes compare
    by layout, not by group), and a collective on such a layout finds its group by the name
    recorded there -- a group built again gets the same name (torch <= 2.13 hashes the ranks and
    the registry's size), so a kept one must too, or tensor parallel's first collective fails
    with "Could not resolve the process group". ``take_step``: this stands for a creation, so
    take the naming step a creation takes -- a member that keeps a group and one that builds it
    again must name their next group alike (torch >= 2.14 salts the hashed name with
    ``_world.group_count``, which every creation bumps; a different name is a different store
    prefix, and the group's members would wait for each other forever). Not after an
    uncoloured split, which took it; :class:`~nonstop.train.prewarm.MeshHistory` mends the
    cache wherever a generation's names differ from the last one's all the same."""
    c10d = _c10d()
    try:
        if take_step:
            step = getattr(c10d, "_process_group_name", None)
            name = step(ranks, use_hashed_name=True) if step is not None else None
        else:
            hashed = getattr(c10d, "_hash_ranks_to_str", None)
            name = hashed(ranks) if hashed is not None else None
    except Exception as e:  # (another torch's internals: a name of our own instead)
        log.debug("no creation name for a kept group: %s", e)
        return None
    if name is None or name in c10d._world.pg_names.values():
        return None
    return str(name)


def _fresh_name(group: _Group, generation: int) -> str:
    """A kept group's name where :func:`_creation_name` has none: its old one, marked with the
    generation (torch names a group by its ranks, and a renumbered kept group's old ranks may
    be a new group's now)."""
    assert group.entry is not None
    return f"{group.entry['name'].split('/')[0]}/kept{generation}"


def _register(group: _Group, ranks: list[int], name: str) -> None:
    """Put a parked group back under ``name``, with its members' global ranks in the new world."""
    c10d = _c10d()
    w, pg, entry = c10d._world, group.pg, group.entry
    assert entry is not None
    pg._set_group_name(name)
    w.pg_map[pg] = entry["map"]
    w.pg_names[pg] = name
    w.pg_backend_config[pg] = entry["cfg"]
    w.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    if entry["tag"] is not None:
        w.pg_to_tag[pg] = entry["tag"]
        w.tags_to_pg.setdefault(entry["tag"], []).append(pg)
        w.tags_to_pg.setdefault("", []).append(pg)
    c10d._register_process_group(name, pg)
    group.entry = None


def _shutdown(group: _Group, device_type: str) -> None:
    """Close a parked group no one keeps (its peers are at a boundary too: nobody waits on it).
    On a device node its communicators are aborted first: a collective one member issued and
    another never will stays queued, and a clean shutdown would wait for it."""
    if device_type != "cpu":
        devicegroups.abort(group.pg, device_type)
    group.sockets.half_close()
    try:
        group.pg.shutdown()
    except Exception as e:  # a group whose peer died may refuse a clean shutdown
        log.debug("shutting a parked group down failed: %s", e)
