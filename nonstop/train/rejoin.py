"""The worker's side of a generation change: restore the committed step, rejoin the process group.

:class:`Rejoin` is the part of :class:`~nonstop.train.session.Session` that runs between two
steps of the training loop when the coordinator starts a generation (a recovery, a resize, a
migration's swap) or a step failed: tear the old group down, restore from this node's memory (or
the durable tier), report ``restored``, wait for ``rebuild``, join the new group and report
``ready``; a migration's boundary pause and a joiner's sandboxed warm-up step. Main thread only.
"""

from __future__ import annotations

import functools
import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from nonstop.control.channel import Message
from nonstop.control.rdzv import ChannelStore
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.train.group import GenerationGroup
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import CoordinatorLink, PeerFailed
from nonstop.train.membership import Membership
from nonstop.train.rescue import StepHead, now
from nonstop.train.restore import read_restore
from nonstop.train.settle import lost_ranks
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.trainee import Trainee

__all__ = ["Rejoin", "TrainStep"]

log = logging.getLogger(__name__)

TrainStep = Callable[[torch.nn.Module, int], float | None]


class Rejoin(Membership):
    """Restore and rejoin for a new generation (see the module docstring)."""

    generation: int
    trainee: Trainee
    warming_up: bool
    _link: CoordinatorLink
    _group: GenerationGroup
    _snaps: LoopSnapshots
    _faults: WorkerFaults
    _step: int
    _live_at: int | None
    _head: StepHead

    def _warm_up(self, train_step: TrainStep, model: torch.nn.Module) -> None:
        """A migration's joiner, while the others train: one sandboxed step on the bare model (no
        DDP, so no collective), so that its first real step does not pay for allocating
        activations and gradients, autograd's and the optimizer's lazy initialisation (its
        snapshot slots are prefaulted just before, for its first snapshots). What it
        changes is overwritten: the swap restores the boundary step. ``warming_up`` is True
        meanwhile: a script skips its side effects (logs, counters) then."""
        self.warming_up = True
        t0 = time.monotonic()
        try:
            train_step(model, self._step)
        except Exception as e:  # a warm-up is an optimisation: never fail the migration for it
            log.warning("warm-up step failed (the first real step will be slower): %s", e)
        finally:
            self.warming_up = False
            model.zero_grad(set_to_none=True)
        log.info("warm-up step took %.3fs", time.monotonic() - t0)

    def _pause(self, store: RankSnapshotStore) -> Message | None:
        """Live migration: stop after the boundary step (its snapshot complete, for the joiner to
        fetch) until the coordinator swaps the rank (a reconfigure) or gives up (continue)."""
        if self._snaps.taken != self._step:
            # the boundary came after this step was reported unsnapshotted (--snapshot-every):
            # snapshot it now, for the joiner to fetch; the report says only that much
            snap = self._snaps.take(self._step, self._capture(), self.generation)
            again = {"t": "step", "gen": self.generation, "step": self._step, "step_s": 0.0, "again": True}
            if snap is not None:
                snap.on_complete(functools.partial(self._link.send_quietly, again))
        store.drain()
        self._link.pause_at = None
        self._live_at = self._step  # until the next step starts, the live state is that of this step
        self._link.send({"t": "paused", "gen": self.generation, "step": self._step})
        reply = self._link.wait_for("reconfigure", "continue", "leave")
        while reply["t"] == "leave" and not self._link.leaving(self.generation):  # (a stale one)
            reply = self._link.wait_for("reconfigure", "continue", "leave")
        if reply["t"] == "leave":  # a failure while paused: report the boundary (train/rescue.py)
            raise PeerFailed("the coordinator asked the survivors to leave")
        if reply["t"] == "reconfigure":
            return reply
        self._live_at = None
        return None

    def _capture(self) -> StateCapture:
        capture = self.trainee.capture
        assert capture is not None, "the model is built once the generation's group is joined"
        return capture

    def _on_step_error(self, err: BaseException) -> Message:
        """Tear down the group at once (so blocked peers fail fast), then ask what to do."""
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)  # frames hold the old DDP and its group
        self._destroy_group()
        self._link.send(
            {
                "t": "fault",
                "gen": self.generation,
                "step": self._step,
                "error": f"{type(err).__name__}: {err}"[:500],
                **self._rescue(),
            }
        )
        reply = self._link.wait_for("reconfigure", "raise")
        if reply["t"] == "raise":
            raise err
        # mesh groups parked unsevered: keep those without a lost rank (nonstop/train/settle.py)
        self._link.post_settled(self._group.settle(lost_ranks(reply)), int(reply["gen"]))
        return reply

    @property
    def _rescues(self) -> bool:
        """Whether this job's failures are rescued: steps go unsnapshotted (``--snapshot-every``
        K > 1, or an interval a ``--snapshot-budget`` widened: from its announcement on, as the
        coordinator's ``WorkerProtocol.rescues``), snapshots on."""
        return self._snaps.may_skip and self.env.snapshot != "off"

    def _arm_rescue(self) -> None:
        """A step begins: note its start for a rescue."""
        if self._rescues:
            self._head.arm(self._capture(), self._step)
        else:
            self._head.disarm()

    def _rescue(self) -> dict[str, Any]:
        """A step failed, or the coordinator asked this rank to leave (a ``leave``, before or
        in a step): have the state after the last completed step in this rank's slots -- the
        live tensors with the step's head if the failed step left them untouched, or as they are
        if no step began (:mod:`nonstop.train.rescue`) -- written unless that step was
        snapshotted; what the fault report says of it. A rescue that fails costs nothing but
        the rescue."""
        if not self._rescues or self.trainee.capture is None:
            return {}
        try:
            capture = self._capture()
            found = self._head.rescue(capture, self._step) if self._head.armed else now(capture, self._step)
            if found is None:
                return {"rescued": None}
            t0 = time.monotonic()
            self._snaps.live.drain()
            if self._snaps.taken != found.step:
                self._snaps.live.write(found.step, found.state)
                self._snaps.taken = found.step
                log.info("rescued step %d into memory in %.3fs", found.step, time.monotonic() - t0)
            return {"rescued": found.step, "rest": found.digest}
        except Exception:
            log.warning("the rescue snapshot failed; recovery restores the last snapshot", exc_info=True)
            return {"rescued": None}
        finally:
            self._head.disarm()

    def _maybe_inject(self, phase: str, step: int) -> None:
        self._faults.maybe_fire(phase, rank=self.rank, step=step, generation=self.generation)

    def _destroy_group(self, *, at_boundary: bool = False) -> None:
        """Drop this generation's rendezvous store, DDP wrapper and groups (GenerationGroup.destroy);
        the mesh groups a recovery left open are parked, and their sequence numbers posted for
        the peers still settling them (:mod:`nonstop.train.settle`)."""
        self._link.drop_rdzv("the process group was torn down")
        self._link.post_settled(self._group.destroy(at_boundary=at_boundary))

    def _reconfigure(self, msg: Message, warm_up: TrainStep | None) -> torch.nn.Module:
        """Restore the committed step, then rebuild the process group for a new generation.

        A data-parallel model restores before the group is joined; a sharded one is built in
        the new group (:mod:`nonstop.train.trainee`), so its snapshot is read (and checked) at the
        restore stage and copied into the fresh model once it is built."""
        trainee = self.trainee
        while True:
            gen = int(msg["gen"])
            restore_step = msg.get("restore_step")
            self.generation = gen
            self._link.pause_at = None  # a new generation ends any migration's pause
            # here the last step is complete (a failed one tore its groups down already)
            self._destroy_group(at_boundary=True)
            if restore_step is not None and msg.get("recovery"):
                self._maybe_inject("recovery", int(restore_step))
            elif restore_step is not None and msg.get("prepare"):
                self._maybe_inject("prepare", int(restore_step))
            self._snaps.live.drain()  # never restore under a copy still writing into the slots
            if int(msg["rank"]) != self.rank:  # renumbered (elastic): snapshot under the new number
                self._snaps.open(int(msg["rank"]))
            self._set_membership(msg)
            store = self._snaps.live
            t0 = time.monotonic()
            self._step, pending = read_restore(
                msg,
                env=self.env,
                store=store,
                in_group=trainee.restore_in_group,
                capture=self._capture,
                step=self._step,
                live_at=self._live_at,
                mesh=self.mesh,
            )
            self._live_at = None
            bare = trainee.bare
            if msg.get("prepare") and restore_step is not None and bare is not None and warm_up is not None:
                self._snaps.prefault(self._capture(), self._step)  # before the warm-up changes the state
                self._warm_up(warm_up, bare)
            self._link.send(
                {"t": "restored", "gen": gen, "step": self._step, "restore_s": time.monotonic() - t0}
            )
            reply = self._link.wait_for("rebuild", "reconfigure")
            if reply["t"] == "reconfigure" or int(reply["gen"]) != gen:
                if pending is not None:
                    pending.close()  # (the next generation reads its own)
                if reply["t"] == "reconfigure":
                    msg = reply
                continue
            fresh = bool(msg.get("fresh")) and restore_step is not None
            if fresh and not trainee.restore_in_group:
                # Every rank has restored (the rebuild says so): what this rank number's slots hold
                # was written under another numbering. Start them over with the restored step.
                store.clear()
                self._snaps.write(self._step, self._capture(), gen)
            t1 = time.monotonic()
            try:
                module = self._join_group(gen, restored=restore_step is not None)
                if pending is not None:
                    pending.apply(self._capture(), self.rank)
                    if pending.reads_slots:
                        _resharded_everywhere(self._link.rdzv, self.world_size)
            except Exception as e:
                if pending is not None:
                    pending.close()
                pending = None
                msg = self._on_step_error(e)
                continue
            if pending is not None:
                pending.close()
            pending = None
            if fresh and trainee.restore_in_group:  # (a sharded model exists only now)
                store.clear()
                self._snaps.write(self._step, self._capture(), gen)
            if restore_step is None:
                self._snaps.write(0, self._capture(), gen)
            sharded = trainee.restore_in_group
            layouts = self._layouts() if sharded and self.rank == 0 else None
            self._link.send(_ready(gen, time.monotonic() - t1, self._group if sharded else None, layouts))
            return module

    def _layouts(self) -> list[Any] | None:
        """The model's DTensor layouts, which the coordinator plans a later reshard's fetches by
        (:mod:`nonstop.reshardplan`); None when it cannot plan by them."""
        from nonstop.reshardplan import encode_layouts, layouts_of

        try:
            found = layouts_of(self._capture().model.state_dict().values())
        except Exception:  # an optimisation only: a model it cannot read is planned as before
            log.warning(
                "the model's layouts could not be read; a reshard will gather every old rank", exc_info=True
            )
            return None
        return encode_layouts(found) if found else None

    def _join_group(self, gen: int, *, restored: bool) -> torch.nn.Module:
        # Rendezvous through the coordinator (authenticated, fenced by generation, abortable).
        # A generation that is already stale fails at once: the coordinator refuses its keys.
        store = self._link.open_rdzv(gen, self.env.rebuild_timeout_s)
        return self.trainee.join(
            self._group,
            store,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.env.rebuild_timeout_s,
            restored=restored,
            divisor=self.shards_played,
            generation=gen,
        )


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
    gen: int, rebuild_s: float, sharded: GenerationGroup | None, layouts: list[Any] | None = None
) -> Message:
    """The message that says this rank joined generation ``gen``; a sharded job's says which of
    its mesh groups it kept, and rank 0's how its model's tensors are laid out."""
    out: Message = {"t": "ready", "gen": gen, "rebuild_s": rebuild_s}
    if sharded is not None:
        g = sharded.mesh_groups
        out["groups"] = [g.kept, g.built, g.build_s]
    if layouts is not None:
        out["layouts"] = layouts
    return out
