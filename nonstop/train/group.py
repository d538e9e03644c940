"""One generation's process group on a worker: join it, wrap the model in DDP, tear it down.

A :class:`GenerationGroup` builds the process group of a generation from a rendezvous
store (the coordinator's :class:`~nonstop.control.rdzv.ChannelStore`) -- gloo on a CPU node; on
a GPU node ``cpu:gloo,cuda:nccl`` bound to the rank's own device (``device_id``), with the
collective timeout of :func:`~nonstop.train.backend.collective_timeout_s`
(:mod:`nonstop.train.backend` chooses both from the device the agent gave the process) --
wraps the model in DDP with the deterministic gradient sync, and tears both down so that peers blocked on this
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

import contextlib
import datetime
import logging
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nonstop.control.rdzv import ChannelStore
from nonstop.train import devicegroups
from nonstop.train.abort import SocketWatch
from nonstop.train.backend import choose_backend, collective_timeout_s, worker_device
from nonstop.train.ddp import CanonicalGradSync, wrap_ddp
from nonstop.train.meshgroups import GroupClaim, MeshGroups, OpenGroup

__all__ = ["GenerationGroup"]

T = TypeVar("T")

log = logging.getLogger(__name__)


class GenerationGroup:
    """The process group and DDP wrapper of the generation a worker is in, if any."""

    def __init__(self, *, keep_groups: bool = True) -> None:
        self._ddp: DistributedDataParallel | None = None
        self._sockets: SocketWatch | None = None
        self._severed = False  # sever() ran in this generation: nothing of it may be kept
        self._partial = False  # ... but for the mesh groups it left open (see sever)
        self._left = False  # destroy() parked the mesh groups: a second destroy leaves them so
        self._unsettled = False  # parked mid-step unsevered: settle() decides by the lost ranks
        self._device_backend: Any = None  # a device node's NCCL (or other) backend, to abort
        self.timeout: datetime.timedelta | None = None  # the last join's collective timeout
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
        unbound: bool = False,
    ) -> T | None:
        """Rendezvous through ``store`` and start the default process group, then run ``then``
        (a sharded model builds its mesh there, through :attr:`mesh_groups`); every socket the
        default group connects is half-closed at :meth:`destroy`. Returns what ``then`` returned.

        ``unbound``: a world that carries no collective (a sharded job's, whose mesh groups are
        communicators of their own: :mod:`nonstop.train.devicegroups`) -- not bound to the
        device, so NCCL creates nothing for it, and with gloo connecting lazily, so it costs no
        connection either: re-forming it every generation is then a store exchange, not a
        communicator over every rank."""
        device = worker_device()
        choice = choose_backend(device)
        device_id = None if unbound else choice.device_id
        timeout = datetime.timedelta(seconds=collective_timeout_s(timeout_s, device))
        self.timeout = timeout  # the mesh groups' too (MeshGroups.build)
        self._severed = self._partial = self._left = self._unsettled = False
        self._device_backend = None
        watch = SocketWatch()
        try:
            with devicegroups.lazy_world() if unbound else contextlib.nullcontext():
                dist.init_process_group(
                    choice.backend,
                    store=store,
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                    device_id=device_id,
                )
        finally:
            watch.stop()
            self._sockets = watch
        if device.type != "cpu":  # the device half of the composite, for sever() to abort
            world = dist.group.WORLD
            assert world is not None
            self._device_backend = world._get_backend(device)
        return then() if then is not None else None

    def sever(self, lost: Collection[int] | None = None) -> list[OpenGroup]:
        """Fail this generation's collectives in flight now, whatever peer they wait on.

        For a recovery that interrupts a step blocked in a collective with a peer that will never
        answer nor close (a network partition): without this the step waits out the group's
        timeout. On a device node the device backend's communicators are aborted too (NCCL's
        ``abort``: a kernel waiting on a dead peer returns, so a main thread blocked on the device
        comes back to Python, where the interrupt that follows can reach it). Any thread (reads
        only references set by the last join).

        ``lost`` (a recovery's failed ranks): a sharded job's mesh groups without a lost member
        are left open and returned (:meth:`MeshGroups.sever`), for :mod:`nonstop.train.settle`;
        the default group always goes. None: everything is severed."""
        self._severed = True
        backend = self._device_backend
        if backend is not None:
            try:
                backend.abort()
            except Exception as e:  # an abort must never kill the reader thread
                log.warning("aborting the device communicators failed: %s", e)
        sockets = self._sockets
        if sockets is not None:
            sockets.shut_reads()
        left = self.mesh_groups.sever(lost)
        self._partial = bool(left)
        return left

    def settle(self, lost: Collection[int] | None) -> list[GroupClaim]:
        """After :meth:`destroy` left a step without a sever (the step's own collective failed,
        or the interrupt came first): the recovery names the ``lost`` ranks (None: not a
        recovery) -- tear down the parked mesh groups that had one, and return the claims of
        the rest for the settling peers. Nothing to settle: []."""
        if not self._unsettled:
            return []
        self._unsettled = False
        return self.mesh_groups.forget(lost)

    @property
    def severed(self) -> bool:
        """:meth:`sever` ran in this generation: a step that completed anyway ran on aborted
        collectives (NCCL's abort may leave a kernel's output unwritten without an error)."""
        return self._severed

    def destroy(self, *, at_boundary: bool = False) -> list[GroupClaim]:
        """Drop the DDP wrapper and the process group.

        ``at_boundary``: this rank left its last step complete (a migration, a grow, a pause),
        so its mesh groups have no collective in flight and are parked for the next generation
        to keep (:class:`~nonstop.train.meshgroups.MeshGroups`). Mid-step they are parked too,
        but for the severed ones: after a full :meth:`sever` (a re-plan) none is; after a
        recovery's partial one, those it left open are, and their claims are returned for the
        settling peers (:func:`nonstop.train.settle.post`); with no sever at all (the step's own
        collective failed first), every one is, until :meth:`settle` learns the lost ranks. The
        wrapper's reducer is unhooked from autograd first: otherwise it stays attached to the
        parameters, fires on later backward passes and keeps the dead group (and its threads)
        alive until interpreter exit.
        """
        claims: list[GroupClaim] = []
        if self._left:
            pass  # left already (parked): the groups wait for the next build's agreement
        elif at_boundary and not self._severed:
            self.mesh_groups.park()
        elif self._severed and not self._partial:
            self.mesh_groups.drop()
        else:  # mid-step: parked, the open ones' claims posted now, or after settle() if no sever
            claims = self.mesh_groups.leave()
            if not self._partial:
                self._unsettled, claims = True, []
        self._left = self.mesh_groups.parked
        self._partial = False
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
        return claims
