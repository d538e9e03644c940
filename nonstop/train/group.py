"""One generation's process group on a worker: join it, wrap the model in DDP, tear it down.

A :class:`GenerationGroup` builds the gloo process group of a generation from a rendezvous
store (the coordinator's :class:`~nonstop.control.rdzv.ChannelStore`), wraps the model in
DDP with the deterministic gradient sync, and tears both down so that peers blocked on this
rank fail at once instead of at the collective timeout.

Threading contract: main thread only, except :meth:`GenerationGroup.sever`.
:meth:`GenerationGroup.join` and :meth:`GenerationGroup.destroy` are called by the training
loop between steps or while it handles a step's failure. :meth:`GenerationGroup.sever` is called
by the control channel's reader thread while the loop is inside a step (the link serialises it
against the step's end): it fails the collectives in flight, and marks the groups so the next
:meth:`destroy` drops them even at a step boundary (severed groups are never kept). The
rendezvous store is (its replies arrive on the channel's reader thread): it is passed in,
never kept here, and whoever created it aborts it.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nonstop.control.rdzv import ChannelStore
from nonstop.train.abort import SocketWatch
from nonstop.train.ddp import CanonicalGradSync, wrap_ddp
from nonstop.train.meshgroups import MeshGroups

__all__ = ["GenerationGroup"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class GenerationGroup:
    """The process group and DDP wrapper of the generation a worker is in, if any."""

    def __init__(self, *, keep_groups: bool = True) -> None:
        self._ddp: DistributedDataParallel | None = None
        self._sockets: SocketWatch | None = None
        self._severed = False  # sever() ran in this generation: nothing of it may be kept
        self.mesh_groups = MeshGroups(keep=keep_groups)  # a sharded job's, kept across generations

    def join(
        self,
        store: ChannelStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        model: torch.nn.Module,
        sync: CanonicalGradSync | None,
        restored: bool,
        divisor: int,
    ) -> torch.nn.Module:
        """Rendezvous through ``store``, start the process group and return ``model`` in DDP.
        ``restored``: every rank holds the same committed step, so DDP's broadcast is skipped."""
        self.join_plain(store, rank=rank, world_size=world_size, timeout_s=timeout_s)
        self._ddp = wrap_ddp(
            model,
            sync,
            dist.group.WORLD,  # type: ignore[arg-type]
            init_sync=not restored,
            divisor=divisor,
        )
        return self._ddp

    def join_plain(
        self,
        store: ChannelStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        then: Callable[[], T] | None = None,
    ) -> T | None:
        """Rendezvous through ``store`` and start the default process group, then run ``then``
        (a sharded model builds its mesh there, through :attr:`mesh_groups`); every socket the
        default group connects is half-closed at :meth:`destroy`. Returns what ``then`` returned."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self._severed = False
        watch = SocketWatch()
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        finally:
            watch.stop()
            self._sockets = watch
        return then() if then is not None else None

    def sever(self) -> None:
        """Fail this generation's collectives in flight now, whatever peer they wait on.

        For a recovery that interrupts a step blocked in a collective with a peer that will never
        answer nor close (a network partition): without this the step waits out the group's
        timeout. Any thread (reads only immutable socket sets)."""
        self._severed = True
        sockets = self._sockets
        if sockets is not None:
            sockets.shut_reads()
        self.mesh_groups.sever()

    def destroy(self, *, at_boundary: bool = False) -> None:
        """Drop the DDP wrapper and the process group.

        ``at_boundary``: this rank left its last step complete (a migration, a grow, a pause),
        so its mesh groups have no collective in flight and are parked for the next generation
        to keep (:class:`~nonstop.train.meshgroups.MeshGroups`); otherwise they are torn down
        with the rest. The wrapper's reducer is unhooked from autograd first: otherwise it
        stays attached to the parameters, fires on later backward passes and keeps the dead
        group (and its threads) alive until interpreter exit.
        """
        if at_boundary and not self._severed:
            self.mesh_groups.park()
        else:
            self.mesh_groups.drop()
        if self._sockets is not None:
            self._sockets.half_close()  # peers blocked on us fail now, not at the timeout
            self._sockets = None
        if self._ddp is not None:
            self._ddp._remove_autograd_hooks()  # type: ignore[no-untyped-call]
            self._ddp = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a broken group may refuse a clean teardown
                log.warning("destroying the old process group failed: %s", e)
