"""A sharded job's mesh groups on a device node (NCCL): split from the world, aborted one by one.

:class:`~nonstop.train.meshgroups.MeshGroups` decides which mesh groups a generation keeps and
which it builds; this module is how a device node does the building, severing and reuse, where
gloo's socket tricks do not reach the device communicators. **Untested on a GPU**: no GPU
machine has been lent to this project's tasks. Every rule below is checked on CPU with fakes
(``tests/test_devicegroups.py``); the figures wait for a device.

**Building: one split of the world per dim, entered by every rank** (:func:`split`). A device
node's world is bound to the rank's GPU (``init_process_group(device_id=...)``), and then torch
creates every later group of that world by ``ncclCommSplit`` of the world's communicator --
a call *every* rank of the world must make, the k-th split of each rank matching the k-th of
every other. Groups created by their members only (``new_group(use_local_synchronization=True)``,
gloo's path) would split lazily at their first collective, in whatever order each rank first
uses its groups, and a rank that *kept* its group would never join the split its peers wait in:
a deadlock the first time a generation keeps one group and builds another. So on a device node
every rank enters, for each dim in the mesh's order, exactly one split of the new world: with
its group's ranks when the group is built, with no colour (``NCCL_SPLIT_NOCOLOR``, torch's
non-member path) when it is kept. The split needs no store round trip for NCCL's unique id
and no bootstrap of its own: that is what it saves over a fresh communicator. torch's
``split_group`` reads only the caller's own group from its ``split_ranks`` (the colour is a hash
of it; a rank in none splits with no colour), so no rank needs to know what the others keep.

**Severing: abort only the affected communicators** (:func:`abort`). On a failure a survivor
aborts its world communicator and each mesh group with a lost member; the others stay open, and
the settling protocol (:mod:`nonstop.train.settle`) aborts any of them on which the rank issued a
collective a peer never will. An aborted communicator's kernels return, so a main thread blocked
on the device comes back. A split child owns its resources (NCCL's ``splitShare`` is off unless
``NCCL_COMM_SPLIT_SHARE_RESOURCES=1``), so aborting the world it came from leaves it working;
with shared resources that is not certain, and a device node then keeps nothing through a
failure (:func:`keeps_through_failure`).

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

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SHARE_RESOURCES", "abort", "drain", "keeps_through_failure", "split", "splits"]

log = logging.getLogger(__name__)

SHARE_RESOURCES = "NCCL_COMM_SPLIT_SHARE_RESOURCES"


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


def keeps_through_failure(env: Mapping[str, str] | None = None) -> bool:
    """Whether a device node may keep mesh groups through a failure: not when split children
    share the world's resources (``NCCL_COMM_SPLIT_SHARE_RESOURCES=1``), since the world is
    aborted on every failure. Pure but for reading ``os.environ`` when ``env`` is None."""
    env = os.environ if env is None else env
    return env.get(SHARE_RESOURCES, "0").strip() not in ("1", "true", "True")
