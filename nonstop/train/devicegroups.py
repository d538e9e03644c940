"""A sharded job's mesh groups on a device node (NCCL): built, aborted one by one, drained.

:class:`~nonstop.train.meshgroups.MeshGroups` decides which mesh groups a generation keeps and
which it builds; this module is how a device node does the building, severing and reuse, where
gloo's socket tricks do not reach the device communicators. **Untested on a GPU**: no GPU
machine has been lent to this project's tasks. Every rule below is checked on CPU with fakes
(``tests/train/test_devicegroups.py``); the figures wait for a device.

**Two ways to build, chosen by** ``NONSTOP_DEVICE_GROUPS`` (:func:`mode`):

* ``independent`` (the default): **no world communicator at all.** The generation's world is
  created unbound (no ``device_id``: NCCL makes nothing until a device collective runs on it,
  and a sharded job runs none there) with gloo's connections made lazily
  (``TORCH_GLOO_LAZY_INIT``, :func:`lazy_world`: a sharded job's world carries no collective
  either), and each mesh group that is built is a communicator of its own members, created
  eagerly (``new_group(use_local_synchronization=True, device_id=...)``: ``ncclCommInitRank``
  among them, through the group's prefix of the generation's store). A generation therefore
  costs the bootstrap of the groups it builds -- those with a replaced rank -- and nothing for
  the world: at 16,384 GPUs a replaced rank re-forms its shard group and its replicate group, not
  a 16,384-rank communicator and then splits of it. What the simulator charges
  (:func:`nonstop.sim.nonstop_strategy.swap_rebuild_s`) is this. Being its own communicator, a
  kept group survives every abort but its own, so a failure keeps each group no lost rank was in.
* ``split``: the world is bound to the rank's GPU and every group is split from it, as below.
  Cheaper per group (no bootstrap) but the world's communicator, eager, is made again every
  generation, over every rank.

**Split mode: one split of the world per dim, entered by every rank** (:func:`split`). A device
node's world bound to the rank's GPU (``init_process_group(device_id=...)``) makes torch
creates every later group of that world by ``ncclCommSplit`` of the world's communicator --
a call *every* rank of the world must make, the k-th split of each rank matching the k-th of
every other. Groups created by their members only (``new_group(use_local_synchronization=True)``,
gloo's path) would then split lazily at their first collective, in whatever order each rank first
uses its groups, and a rank that *kept* its group would never join the split its peers wait in:
a deadlock the first time a generation keeps one group and builds another. So on a device node
every rank enters, for each dim in the mesh's order, exactly one split of the new world: with
its group's ranks when the group is built, with no colour (``NCCL_SPLIT_NOCOLOR``, torch's
non-member path) when it is kept. The split needs no store round trip for NCCL's unique id
and no bootstrap of its own: that is what it saves over a fresh communicator. torch's
``split_group`` reads only the caller's own group from its ``split_ranks`` (the colour is a hash
of it; a rank in none splits with no colour), so no rank needs to know what the others keep.

**Severing: abort only the affected communicators** (:func:`abort`). On a failure a survivor
aborts its world communicator (unbound: it has none) and each mesh group with a lost member; the
others stay open, and the settling protocol (:mod:`nonstop.train.settle`) aborts any of them on
which the rank issued a collective a peer never will. An aborted communicator's kernels return,
so a main thread blocked on the device comes back. A split child owns its resources (NCCL's
``splitShare`` is off unless ``NCCL_COMM_SPLIT_SHARE_RESOURCES=1``), so aborting the world it
came from leaves it working; with shared resources that is not certain, and a device node then
keeps nothing through a failure (:func:`keeps_through_failure`).

**Reuse: drain first** (:func:`drain`). A group kept through a failure may still have
collectives in flight: the agreement keeps it only when every member issued the same number
(``_get_sequence_number_for_group``, NCCL's count of collectives issued), so they all complete,
but asynchronously, on NCCL's own streams, into buffers the restore is about to overwrite. The
device is synchronised before the generation uses what it kept. NCCL's count leaves out
point-to-point operations, which no mesh dim of nonstop's issues (a pipeline dim would).

**Why not ``shrink_group``** (``ncclCommShrink``, torch 2.13, ``SHRINK_ABORT``): it makes a
survivors-only copy of one communicator, which fits neither use here. A group with a lost
member gets a replacement member (a spare or a grow) or is rebuilt with a reshaped mesh, and a
shrink cannot add a member; and a shrink of the world destroys every other group of the
process (torch's ``_destroy_all_other_groups``), the kept ones included. A split from the new
world costs the same bootstrap-free ``ncclCommSplit`` and serves every case.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from nonstop.devices.nccl import DEVICE_GROUPS as MODE
from nonstop.devices.nccl import INDEPENDENT, SPLIT, device_groups_mode

__all__ = [
    "INDEPENDENT",
    "MODE",
    "SHARE_RESOURCES",
    "SPLIT",
    "abort",
    "drain",
    "eager_device",
    "keeps_through_failure",
    "lazy_world",
    "mode",
    "split",
    "splits",
]

log = logging.getLogger(__name__)

SHARE_RESOURCES = "NCCL_COMM_SPLIT_SHARE_RESOURCES"
GLOO_LAZY = "TORCH_GLOO_LAZY_INIT"


def mode(env: Mapping[str, str] | None = None) -> str:
    """How a device node builds a sharded job's mesh groups: :data:`INDEPENDENT` (default) or
    :data:`SPLIT` (the module docstring). Anything else is refused, naming the choices; the
    launcher asks first, so a bad value fails the job at its start
    (:func:`nonstop.devices.nccl.device_groups_mode`)."""
    return device_groups_mode(os.environ if env is None else env)


@contextlib.contextmanager
def lazy_world() -> Iterator[None]:
    """Within it, a gloo process group connects its peers at its first collective on each pair,
    not at creation (``TORCH_GLOO_LAZY_INIT``, read by each group as it is created): a sharded
    job's world, which carries no collective, then costs no connection at all. Main thread."""
    before = os.environ.get(GLOO_LAZY)
    os.environ[GLOO_LAZY] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(GLOO_LAZY, None)
        else:
            os.environ[GLOO_LAZY] = before


def eager_device(device_type: str) -> torch.device | None:
    """The device an independent mesh group's communicator is created on at once (None on the
    CPU, where gloo connects at creation anyway): the process's current one. An eager
    communicator never needs the generation's store again, which is gone once a later
    generation keeps the group."""
    if device_type == "cpu":
        return None
    return torch.device(device_type, torch.accelerator.current_device_index())


def splits(device_type: str) -> bool:
    """Whether this generation's mesh groups are split from the world's device communicator:
    a device node whose world is bound to its device, with a backend that can split (NCCL
    >= 2.18; torch's ``supports_splitting``). Main thread, after the world is created."""
    if device_type == "cpu" or not dist.is_initialized():
        return False
    world = dist.group.WORLD
    if world is None or getattr(world, "bound_device_id", None) is None:
        return False
    try:
        backend = world._get_backend(torch.device(device_type))
    except Exception:  # no backend for that device: new groups are made as on the CPU
        return False
    return bool(getattr(backend, "supports_splitting", False))


def split(
    ranks: list[int], *, member: bool, rank: int, world_size: int, timeout: datetime.timedelta | None = None
) -> Any:
    """Enter the world's split for one dim: every rank of the world calls this once per dim, in
    the mesh's dim order (the module docstring). ``member``: this rank builds ``ranks`` (its
    group, global ranks, sorted) and gets the new group, with collective ``timeout`` (None:
    torch's default); otherwise it keeps its group, splits with no colour and gets None."""
    if member:
        return dist.split_group(split_ranks=[sorted(ranks)], timeout=timeout)
    others = [r for r in range(world_size) if r != rank]
    if not others:  # a world of one: nobody to split with
        return None
    got = dist.split_group(split_ranks=[others], timeout=timeout)
    if got is not None:  # (torch gave this rank a group it is not in: never expected)
        raise RuntimeError(f"rank {rank} got a group from a split it entered with no colour")
    return None


def abort(pg: Any, device_type: str) -> None:
    """Abort ``pg``'s communicators on ``device_type`` (its kernels waiting on a peer return).
    Never raises: it runs on the thread that severs, which must go on."""
    try:
        pg._get_backend(torch.device(device_type)).abort()
    except Exception as e:
        log.warning("aborting a mesh group's device communicators failed: %s", e)


def drain(device_type: str) -> None:
    """Wait for every collective in flight on this device (a kept group's, issued by all its
    members) before the generation reuses what it kept. Main thread."""
    if device_type != "cpu":
        torch.accelerator.synchronize()


def keeps_through_failure(env: Mapping[str, str] | None = None, *, split_from_world: bool = True) -> bool:
    """Whether a device node may keep mesh groups through a failure: always when they are
    communicators of their own (``split_from_world`` False); split from the world, not when the
    children share its resources (``NCCL_COMM_SPLIT_SHARE_RESOURCES=1``), since the world is
    aborted on every failure. Pure but for reading ``os.environ`` when ``env`` is None."""
    if not split_from_world:
        return True
    env = os.environ if env is None else env
    return env.get(SHARE_RESOURCES, "0").strip() not in ("1", "true", "True")
