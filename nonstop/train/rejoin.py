"""The worker's side of a generation change: restore the committed step, rejoin the process group.

:class:`Rejoin` runs between two steps of the training loop when the coordinator starts a
generation (a recovery, a resize, a migration's swap) or a step failed: tear the old group down,
restore from this node's memory (or the durable tier), report ``restored``, wait for ``rebuild``,
join the new group and report ``ready``; a migration's boundary pause and a joiner's sandboxed
warm-up step. It moves the rank's :class:`~nonstop.train.position.Position` (the generation, the
restored step) and :class:`~nonstop.train.membership.Membership` as it goes: the heartbeat and a
reconnect's resume point report them meanwhile.

Its own state: the step whose live state a boundary pause left standing (``live_at``, which the
next restore takes instead of reading a snapshot) and ``warming_up`` (a joiner's sandboxed step).

Threading contract: main thread only (the training loop's).
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from collections.abc import Callable

import torch

from nonstop.config import WorkerEnv
from nonstop.control.rdzv import ChannelStore
from nonstop.protocol.worker import (
    ContinueMsg,
    FaultMsg,
    LeaveMsg,
    PausedMsg,
    RaiseMsg,
    ReadyMsg,
    RebuildMsg,
    ReconfigureMsg,
    RestoredMsg,
    StepMsg,
)
from nonstop.reshardplan import TensorLayout
from nonstop.snapshot import StateCapture
from nonstop.train.group import GenerationGroup
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import CoordinatorLink, PeerFailed
from nonstop.train.membership import Membership
from nonstop.train.position import Position
from nonstop.train.rescue import StepRescue
from nonstop.train.restore import read_restore
from nonstop.train.settle import lost_ranks
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.trainee import Trainee

__all__ = ["Rejoin", "TrainStep", "destroy_group"]

log = logging.getLogger(__name__)

TrainStep = Callable[[torch.nn.Module, int], float | None]


class Rejoin:
    """Restore and rejoin for a new generation (see the module docstring), for ``trainee`` (the
    model side of the session) in ``group``, talking to the coordinator over ``link``.

    ``snaps``: the rank's snapshot slots (restored from, written at a generation's start);
    ``rescue``: the rescue a fault report carries; ``faults``: the injected faults due at a
    restore; ``members`` and ``position``: what the generation sets (the session's own)."""

    def __init__(
        self,
        env: WorkerEnv,
        *,
        trainee: Trainee,
        link: CoordinatorLink,
        group: GenerationGroup,
        snaps: LoopSnapshots,
        rescue: StepRescue,
        faults: WorkerFaults,
        members: Membership,
        position: Position,
    ) -> None:
        self._env = env
        self._trainee = trainee
        self._link = link
        self._group = group
        self._snaps = snaps
        self._rescue = rescue
        self._faults = faults
        self._members = members
        self._pos = position
        self.live_at: int | None = None  # paused after this step: the live state is that step's
        self.warming_up = False  # a joiner's sandboxed step (see warm_up): skip side effects

    def _capture(self) -> StateCapture:
        capture = self._trainee.capture
        assert capture is not None, "the model is built once the generation's group is joined"
        return capture

    def take_membership(self, msg: ReconfigureMsg) -> None:
        """The rank, world size and shards of the generation ``msg`` starts; the gradient sync
        divides by the shards played."""
        self._members.apply(msg)
        sync = self._trainee.sync
        if sync is not None:
            sync.set_shards(self._members.shards, self._members.shards_played)

    def warm_up(self, train_step: TrainStep, model: torch.nn.Module) -> None:
        """A migration's joiner, while the others train: one sandboxed step on the bare model (no
        DDP, so no collective), so that its first real step does not pay for allocating
        activations and gradients, autograd's and the optimizer's lazy initialisation (its
        snapshot slots are prefaulted just before, for its first snapshots). What it
        changes is overwritten: the swap restores the boundary step. ``warming_up`` is True
        meanwhile: a script skips its side effects (logs, counters) then."""
        self.warming_up = True
        t0 = time.monotonic()
        try:
            train_step(model, self._pos.step)
        except Exception as e:  # a warm-up is an optimisation: never fail the migration for it
            log.warning("warm-up step failed (the first real step will be slower): %s", e)
        finally:
            self.warming_up = False
            model.zero_grad(set_to_none=True)
        log.info("warm-up step took %.3fs", time.monotonic() - t0)

    def between_steps(self) -> ReconfigureMsg | None:
        """Before a step: the reconfigure that ends this generation -- sent by the coordinator,
        or the one a migration's boundary pause ended with (:meth:`pause`) -- or None (train on).
        :class:`~nonstop.train.link.PeerFailed` when the coordinator asked the survivors to
        leave their step (:mod:`nonstop.train.rescue`)."""
        link, pos = self._link, self._pos
        pending = link.poll_reconfigure()
        pause_at = link.pause_at
        if pending is None and pause_at is not None and pos.step >= pause_at:
            pending = self.pause()
        if pending is None and link.leaving(pos.generation):
            raise PeerFailed("the coordinator asked the survivors to leave their step")
        return pending

    def pause(self) -> ReconfigureMsg | None:
        """Live migration: stop after the boundary step (its snapshot complete, for the joiner to
        fetch) until the coordinator swaps the rank (a reconfigure, returned) or gives up
        (continue: None)."""
        pos, link = self._pos, self._link
        if self._snaps.taken != pos.step:
            # the boundary came after this step was reported unsnapshotted (--snapshot-every):
            # snapshot it now, for the joiner to fetch; the report says only that much
            snap = self._snaps.take(pos.step, self._capture(), pos.generation)
            again = StepMsg(gen=pos.generation, step=pos.step, step_s=0.0, again=True).encode()
            if snap is not None:
                snap.on_complete(functools.partial(link.send_quietly, again))
        self._snaps.live.drain()
        link.pause_at = None
        self.live_at = pos.step  # until the next step starts, the live state is that of this step
        link.send(PausedMsg(gen=pos.generation, step=pos.step).encode())
        reply = link.wait_for(ReconfigureMsg, ContinueMsg, LeaveMsg)
        while isinstance(reply, LeaveMsg) and not link.leaving(pos.generation):  # (a stale one)
            reply = link.wait_for(ReconfigureMsg, ContinueMsg, LeaveMsg)
        if isinstance(reply, LeaveMsg):  # a failure while paused: report the boundary (train/rescue.py)
            raise PeerFailed("the coordinator asked the survivors to leave")
        if isinstance(reply, ReconfigureMsg):
            return reply
        self.live_at = None
        return None

    def on_step_error(self, err: BaseException) -> ReconfigureMsg:
        """Tear down the group at once (so blocked peers fail fast), report the fault (with its
        rescue) and return the reconfigure the coordinator answers; re-raise ``err`` when it
        answers ``raise`` (a failure no recovery can fix)."""
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)  # frames hold the old DDP and its group
        destroy_group(self._link, self._group)
        pos = self._pos
        self._link.send(
            FaultMsg(
                gen=pos.generation,
                step=pos.step,
                error=f"{type(err).__name__}: {err}"[:500],
                rescue=self._rescue.rescue(self._trainee.capture, pos.step),
            ).encode()
        )
        reply = self._link.wait_for(ReconfigureMsg, RaiseMsg)
        if not isinstance(reply, ReconfigureMsg):
            raise err
        # mesh groups parked unsevered: keep those without a lost rank (nonstop/train/settle.py)
        self._link.post_settled(self._group.settle(lost_ranks(reply)), reply.gen)
        return reply

    def _inject(self, phase: str, step: int) -> None:
        self._faults.maybe_fire(phase, rank=self._members.rank, step=step, generation=self._pos.generation)

    def reconfigure(self, msg: ReconfigureMsg, warm_up: TrainStep | None) -> torch.nn.Module:
        """Restore the committed step, then rebuild the process group for a new generation;
        return the module the steps of the generation train.

        A data-parallel model restores before the group is joined; a sharded one is built in
        the new group (:mod:`nonstop.train.trainee`), so its snapshot is read (and checked) at the
        restore stage and copied into the fresh model once it is built."""
        trainee, link, snaps, pos, members = self._trainee, self._link, self._snaps, self._pos, self._members
        while True:
            gen = msg.gen
            restore_step = msg.restore_step
            pos.generation = gen
            link.pause_at = None  # a new generation ends any migration's pause
            # here the last step is complete (a failed one tore its groups down already)
            destroy_group(link, self._group, at_boundary=True)
            if restore_step is not None and msg.recovery:
                self._inject("recovery", restore_step)
            elif restore_step is not None and msg.prepare:
                self._inject("prepare", restore_step)
            snaps.live.drain()  # never restore under a copy still writing into the slots
            if msg.rank != members.rank:  # renumbered (elastic): snapshot under the new number
                snaps.open(msg.rank)
            self.take_membership(msg)
            store = snaps.live
            t0 = time.monotonic()
            pos.step, pending = read_restore(
                msg,
                env=self._env,
                store=store,
                in_group=trainee.restore_in_group,
                capture=self._capture,
                step=pos.step,
                live_at=self.live_at,
                mesh=members.mesh,
            )
            self.live_at = None
            bare = trainee.bare
            if msg.prepare and restore_step is not None and bare is not None and warm_up is not None:
                snaps.prefault(self._capture(), pos.step)  # before the warm-up changes the state
                self.warm_up(warm_up, bare)
            link.send(RestoredMsg(gen=gen, step=pos.step, restore_s=time.monotonic() - t0).encode())
            reply = link.wait_for(RebuildMsg, ReconfigureMsg)
            if isinstance(reply, ReconfigureMsg) or not isinstance(reply, RebuildMsg) or reply.gen != gen:
                if pending is not None:
                    pending.close()  # (the next generation reads its own)
                if isinstance(reply, ReconfigureMsg):
                    msg = reply
                continue
            fresh = msg.fresh and restore_step is not None
            if fresh and not trainee.restore_in_group:
                # Every rank has restored (the rebuild says so): what this rank number's slots hold
                # was written under another numbering. Start them over with the restored step.
                store.clear()
                snaps.write(pos.step, self._capture(), gen)
            t1 = time.monotonic()
            try:
                module = self._join_group(gen, restored=restore_step is not None)
                if pending is not None:
                    pending.apply(self._capture(), members.rank)
                    if pending.reads_slots:
                        _resharded_everywhere(link.rdzv, members.world_size)
            except Exception as e:
                if pending is not None:
                    pending.close()
                pending = None
                msg = self.on_step_error(e)
                continue
            if pending is not None:
                pending.close()
            pending = None
            if fresh and trainee.restore_in_group:  # (a sharded model exists only now)
                store.clear()
                snaps.write(pos.step, self._capture(), gen)
            if restore_step is None:
                snaps.write(0, self._capture(), gen)
            sharded = trainee.restore_in_group
            layouts = self._layouts() if sharded and members.rank == 0 else None
            link.send(_ready(gen, time.monotonic() - t1, self._group if sharded else None, layouts).encode())
            return module

    def _layouts(self) -> tuple[TensorLayout, ...] | None:
        """The model's DTensor layouts, which the coordinator plans a later reshard's fetches by
        (:mod:`nonstop.reshardplan`); None when it cannot plan by them."""
        from nonstop.reshardplan import layouts_of

        try:
            found = layouts_of(self._capture().model.state_dict().values())
        except Exception:  # an optimisation only: a model it cannot read is planned as before
            log.warning(
                "the model's layouts could not be read; a reshard will gather every old rank", exc_info=True
            )
            return None
        return tuple(found) if found else None

    def _join_group(self, gen: int, *, restored: bool) -> torch.nn.Module:
        # Rendezvous through the coordinator (authenticated, fenced by generation, abortable).
        # A generation that is already stale fails at once: the coordinator refuses its keys.
        timeout_s = self._env.rebuild_timeout_s
        store = self._link.open_rdzv(gen, timeout_s)
        members = self._members
        return self._trainee.join(
            self._group,
            store,
            rank=members.rank,
            world_size=members.world_size,
            timeout_s=timeout_s,
            restored=restored,
            divisor=members.shards_played,
            generation=gen,
        )


def destroy_group(link: CoordinatorLink, group: GenerationGroup, *, at_boundary: bool = False) -> None:
    """Drop this generation's rendezvous store (``link``'s), DDP wrapper and groups
    (:meth:`GenerationGroup.destroy`); the mesh groups a recovery left open are parked, and their
    sequence numbers posted for the peers still settling them (:mod:`nonstop.train.settle`)."""
    link.drop_rdzv("the process group was torn down")
    link.post_settled(group.destroy(at_boundary=at_boundary))


def _resharded_everywhere(store: ChannelStore | None, world_size: int) -> None:
    """Return once every rank of the generation has resharded. A resharding rank reads the old
    ranks' slots on its node as views (:class:`~nonstop.train.restore.Resharding`), and a fresh
    rank starts its own slots over right after its restore: without this, a rank that finished
    first could write into the slots of its rank number while another rank of its node still
    cuts its shards out of them. A barrier on the generation's rendezvous store, not a collective
    of the world: a sharded job's world has no connections (``join_plain``'s ``unbound``), and a
    failure aborts the store, so a rank waiting here for a dead peer fails at once."""
    if store is None:
        raise RuntimeError("the generation's rendezvous store is gone: a recovery began")
    if store.add("nonstop/resharded", 1) == world_size:
        store.set("nonstop/resharded/all", b"1")
    store.get("nonstop/resharded/all")


def _ready(
    gen: int,
    rebuild_s: float,
    sharded: GenerationGroup | None,
    layouts: tuple[TensorLayout, ...] | None = None,
) -> ReadyMsg:
    """The message that says this rank joined generation ``gen``; a sharded job's says which of
    its mesh groups it kept, and rank 0's how its model's tensors are laid out."""
    groups = None
    if sharded is not None:
        g = sharded.mesh_groups
        groups = (g.kept, g.built, g.build_s)
    return ReadyMsg(gen=gen, rebuild_s=rebuild_s, groups=groups, layouts=layouts)
