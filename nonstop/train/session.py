"""The worker side of nonstop: join the job, train, snapshot every step, recover.

Usage in a training script (run it with ``nonstop run``)::

    import nonstop
    session = nonstop.init()               # a hot spare blocks here until it gets a rank
    model, opt = build()                   # same on every rank
    def train_step(ddp_model, step):       # one optimizer step; returns the loss
        ...
    session.run(train_step, model=model, optimizer=opt, num_steps=1000)

A sharded job (``nonstop run --mesh shard=S,...``: FSDP2, HSDP, tensor parallel) gives a
collective-free ``build(mesh) -> (model, optimizer)`` instead, called on every rank of every
generation (:mod:`nonstop.train.trainee`)::

    session.run(train_step, build=build, num_steps=1000)   # train_step(model, step)

Contract of :meth:`Session.run`:

* ``train_step(ddp_model, step)`` performs optimizer step number ``step``
  (0-based). It must derive its batch from ``step`` (or from state it returns
  through ``extras``/``load_extras``) so a step can be redone. In an elastic job
  (``--min-world-size``) it reads one micro-batch per shard of
  :meth:`Session.shard_steps` (shard k: what rank k of the full-size job reads).
* After each step the state after ``step + 1`` steps is snapshotted into the
  agent's shared memory before the next step starts.
* When any rank fails, ``train_step`` may raise (a collective error) or the
  loop may be told to stop between steps; either way every rank restores the
  **committed step** (newest step snapshotted by all ranks), rejoins a new
  process group and continues. ``ddp_model`` is a new object after a recovery:
  do not keep it between calls.
* An exception that is not caused by another rank's failure is re-raised (the
  worker then exits and the agent restarts the rank, within its budget).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from nonstop.config import WorkerEnv
from nonstop.control.channel import Message
from nonstop.control.rdzv import ChannelStore
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.train.collectives import in_collective
from nonstop.train.eventhooks import FLUSH_S, EventCallback, EventHooks
from nonstop.train.group import GenerationGroup
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import EXIT_COORDINATOR_LOST as EXIT_COORDINATOR_LOST
from nonstop.train.link import CoordinatorLink, PeerFailed
from nonstop.train.membership import Membership
from nonstop.train.restore import read_restore
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.trainee import Build, Replicated, Sharded, Trainee

__all__ = ["RunResult", "Session", "init"]

log = logging.getLogger(__name__)

TrainStep = Callable[[torch.nn.Module, int], float | None]
# Imported by a hot spare before it waits: the first torch.optim construction
# imports torch._dynamo (~1 s on these machines), which a spare must not pay
# after it has been given a rank.
PREWARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.algorithms")


@dataclass(frozen=True)
class RunResult:
    """What :meth:`Session.run` returns on every rank once the job finished."""

    step: int
    last_loss: float | None
    generation: int


class _Reconfigure(Exception):
    def __init__(self, msg: Message) -> None:
        super().__init__(f"reconfigure to generation {msg['gen']}")
        self.msg = msg


class Session(Membership):
    """A worker's connection to its job. Create it with :func:`init`.

    The control connection and its threads are a :class:`~nonstop.train.link.CoordinatorLink`,
    the process group of the current generation a :class:`~nonstop.train.group.GenerationGroup`;
    the session runs the training loop and the worker's side of recovery on the main thread.
    """

    def __init__(
        self, env: WorkerEnv, *, connect_timeout: float = 30.0, prewarm: tuple[str, ...] = PREWARM_MODULES
    ) -> None:
        self.env = env
        self.world_size = 0
        self.generation = 0
        self._sync = None
        self._group = GenerationGroup(keep_groups=env.keep_groups)
        self._step = 0
        self._progress_at = time.monotonic()  # when this rank last completed a step (heartbeat "idle")
        self._done = False  # this rank reported its last step (a restarted coordinator asks)
        self._live_at: int | None = None  # paused after this step: the live state is that step's
        self.warming_up = False  # a joiner's sandboxed step (see _warm_up): skip side effects
        self._train_thread: int | None = None  # the thread in run(): its collectives are watched
        self._link = CoordinatorLink(
            env,
            timeout=connect_timeout,
            heartbeat=self._heartbeat_msg,
            resume=self._resume_point,
            sever=self._group.sever,
        )
        self._faults = WorkerFaults(env, self._link)
        self._hooks = EventHooks()  # on_event's callbacks (train/eventhooks.py)
        # A spare waits here, imported and connected, until it is given a rank. Pay
        # the lazy imports a first optimizer / DDP construction would pay now.
        if env.role == "spare":
            for name in prewarm:
                importlib.import_module(name)
        first = self._link.wait_for("reconfigure", "finish")
        if first["t"] == "finish":  # the job ended while this process waited as a spare
            self._link.close()
            raise SystemExit(0)
        self._pending_reconfigure: Message | None = first
        self.rank: int = int(first["rank"])
        self._set_membership(first)
        self._snaps = LoopSnapshots(env)

    @property
    def store(self) -> ChannelStore:
        """The key-value store of this generation's process group (a ``torch.distributed.Store``
        served by the coordinator), for the script's own rendezvous keys. Its keys are dropped
        when a new generation starts. A request the coordinator refuses (``add`` on a key that
        holds text, a fenced generation) raises :class:`~nonstop.errors.ControlError` here, as
        torch's ``TCPStore`` raises; the job goes on."""
        rdzv = self._link.rdzv
        if rdzv is None:
            raise ValueError("the process group's store exists once Session.run() has joined a generation")
        return rdzv

    # -- the event hook ----------------------------------------------------------------------
    def on_event(
        self,
        callback: EventCallback,
        *,
        kinds: Iterable[str] | None = None,
        deliver: str = "thread",
        max_pending: int = 1024,
    ) -> None:
        """Call ``callback(event)`` with each of the job's events from now on (a typed
        :class:`~nonstop.runtime.events.Event`: ``event.kind``, its fields, ``event.to_json()``):
        what the coordinator logs to ``events.jsonl`` -- ``failure``, ``recovery`` (MTTR, stages,
        lost steps), ``generation``, ``shrink``, ``grow``, ``migration_done``, ``persist``, ... --
        and ``committed`` (the committed step, at most once a second). ``kinds``: only these.

        Only processes that call this receive events (usually: ``if session.rank == 0``); a
        spare that takes over the rank runs the same script and subscribes anew. Never blocks
        training: events wait in a bounded queue (``max_pending``; when full the oldest is
        dropped, :attr:`events_dropped`) and are delivered on a thread of their own
        (``deliver="thread"``) or by the loop between two steps (``deliver="step"``).
        :mod:`nonstop.loggers` has callbacks for TensorBoard and Weights & Biases. See
        :mod:`nonstop.train.eventhooks` for the whole contract."""
        kinds_wanted = self._hooks.add(callback, kinds=kinds, deliver=deliver, max_pending=max_pending)
        self._link.on_feed = self._hooks.put
        self._link.subscribe(kinds_wanted)

    @property
    def events_dropped(self) -> int:
        """Events this process's :meth:`on_event` queue dropped because it was full."""
        return self._hooks.dropped

    # -- what the link's threads report (read-only on the session) -----------------------
    def _heartbeat_msg(self) -> Message:
        since = self._sync.pending_since if self._sync is not None else None
        coll = since is not None or in_collective(self._train_thread)
        idle = round(time.monotonic() - self._progress_at, 3)
        return {"t": "hb", "coll": coll, "step": self._step, "idle": idle}

    def _resume_point(self) -> Message:
        return {"gen": self.generation, "step": self._step, "done": self._done}

    # -- the training loop -----------------------------------------------------------------
    def run(
        self,
        train_step: TrainStep,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        build: Build | None = None,
        num_steps: int,
        extras: Callable[[], dict[str, Any]] | None = None,
        load_extras: Callable[[dict[str, Any]], None] | None = None,
        deterministic: bool = True,
    ) -> RunResult:
        """Train ``num_steps`` steps through failures. See the module docstring.

        Data-parallel (DDP): give ``model`` and ``optimizer``. Sharded (the job's ``--mesh``:
        FSDP2, HSDP, tensor parallel): give ``build(mesh) -> (model, optimizer)`` instead; it is
        called on every rank of every generation with a ``DeviceMesh`` whose dims carry the
        mesh's names, and must run no collective (``fully_shard`` is local; give
        ``parallelize_module`` ``src_data_rank=None``)."""
        self._train_thread = threading.get_ident()
        fence = self._snaps.fence if self.env.snapshot == "overlapped" else None
        if (model is None) == (build is None):
            raise UsageError("Session.run: give model= (and optimizer=) for DDP, or build= for a --mesh job")
        if build is not None:
            if self.env.mesh is None:
                raise UsageError("Session.run(build=...) trains a sharded model: start the job with --mesh")
            self.trainee: Trainee = Sharded(
                build, MeshSpec.parse(self.env.mesh), extras=extras, load_extras=load_extras, fence=fence
            )
        else:
            assert model is not None
            if self.env.mesh is not None:
                raise UsageError(f"this job has --mesh {self.env.mesh}: train through Session.run(build=...)")
            self.trainee = Replicated(
                model,
                optimizer,
                extras=extras,
                load_extras=load_extras,
                deterministic=deterministic,
                fence=fence if optimizer is not None else None,
            )
        self._sync = self.trainee.sync
        if self._sync is not None:
            self._sync.exact = self.env.elastic
            self._sync.set_shards(self.shards, self.num_shards)
        self._snaps.open(self.rank)
        self._progress_at = time.monotonic()
        loss: float | None = None
        msg = self._pending_reconfigure
        self._pending_reconfigure = None
        try:
            while True:
                if msg is not None:
                    ddp = self._reconfigure(msg, train_step)
                    msg = None
                    self._progress_at = time.monotonic()
                try:
                    while self._step < num_steps:
                        self._hooks.deliver_pending()  # on_event(deliver="step")
                        pending = self._link.poll_reconfigure()
                        pause_at = self._link.pause_at
                        if pending is None and pause_at is not None and self._step >= pause_at:
                            pending = self._pause(self._snaps.live)
                        if pending is not None:
                            raise _Reconfigure(pending)
                        t0 = time.monotonic()
                        self._link.in_step = True  # from here a recovery interrupts the step
                        self._maybe_inject("step", self._step)
                        loss = train_step(ddp, self._step)
                        self._link.in_step = False
                        step_s = time.monotonic() - t0
                        self._step += 1
                        t1 = self._progress_at = time.monotonic()
                        snap = self._snaps.take(self._step, self._capture())
                        # Stall: time the loop spent on this snapshot now, plus what the
                        # step just run waited for the previous snapshot's background copy.
                        stall_s = time.monotonic() - t1 + self._snaps.waited_s()
                        report = {
                            "t": "step",
                            "gen": self.generation,
                            "step": self._step,
                            "step_s": step_s,
                            "snap_s": stall_s,
                            "bytes": snap.nbytes if snap is not None else 0,
                            "loss": loss,
                        }
                        # A step counts as done (committed) once its snapshot is complete:
                        # with overlapped capture that is when the background copy finishes.
                        if snap is None:
                            self._link.send(report)
                        else:
                            snap.on_complete(functools.partial(self._link.send_quietly, report))
                    self._snaps.live.drain()  # the last snapshot is complete before we report done
                    self._done = True
                    self._link.send({"t": "done", "gen": self.generation, "step": self._step})
                    reply = self._link.wait_for("finish", "reconfigure")
                    if reply["t"] == "finish":
                        self._link.closing = True
                        if self._hooks.active:
                            self._hooks.flush(FLUSH_S)
                        return RunResult(step=self._step, last_loss=loss, generation=self.generation)
                    msg = reply
                except _Reconfigure as r:
                    msg = r.msg
                except PeerFailed as e:
                    msg = self._on_step_error(e)
                except Exception as e:  # a collective failed, or the user's code raised
                    self._link.in_step = False
                    msg = self._on_step_error(e)
        finally:
            self.trainee.close()
            self._snaps.live.close()

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
        store.drain()
        self._link.pause_at = None
        self._live_at = self._step  # until the next step starts, the live state is that of this step
        self._link.send({"t": "paused", "gen": self.generation, "step": self._step})
        reply = self._link.wait_for("reconfigure", "continue")
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
            }
        )
        reply = self._link.wait_for("reconfigure", "raise")
        if reply["t"] == "raise":
            raise err
        return reply

    def _maybe_inject(self, phase: str, step: int) -> None:
        self._faults.maybe_fire(phase, rank=self.rank, step=step, generation=self.generation)

    def _destroy_group(self, *, at_boundary: bool = False) -> None:
        """Drop this generation's rendezvous store, DDP wrapper and groups (GenerationGroup.destroy)."""
        self._link.drop_rdzv("the process group was torn down")
        self._group.destroy(at_boundary=at_boundary)

    def _reconfigure(self, msg: Message, train_step: TrainStep) -> torch.nn.Module:
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
            )
            self._live_at = None
            bare = trainee.bare
            if msg.get("prepare") and restore_step is not None and bare is not None:
                store.prefault(self._capture().state(self._step))  # before the warm-up changes the state
                self._warm_up(train_step, bare)
            self._link.send(
                {"t": "restored", "gen": gen, "step": self._step, "restore_s": time.monotonic() - t0}
            )
            reply = self._link.wait_for("rebuild", "reconfigure")
            if reply["t"] == "reconfigure":
                msg = reply
                continue
            if int(reply["gen"]) != gen:
                continue
            fresh = bool(msg.get("fresh")) and restore_step is not None
            if fresh and not trainee.restore_in_group:
                # Every rank has restored (the rebuild says so): what this rank number's slots hold
                # was written under another numbering. Start them over with the restored step.
                store.clear()
                store.write(self._step, self._capture().state(self._step))
            t1 = time.monotonic()
            try:
                module = self._join_group(gen, restored=restore_step is not None)
                if pending is not None:
                    pending.apply(self._capture(), self.rank)
            except Exception as e:
                pending = None
                msg = self._on_step_error(e)
                continue
            pending = None
            if fresh and trainee.restore_in_group:  # (a sharded model exists only now)
                store.clear()
                store.write(self._step, self._capture().state(self._step))
            if restore_step is None:
                store.write(0, self._capture().state(0))
            self._link.send(
                _ready(gen, time.monotonic() - t1, self._group if trainee.restore_in_group else None)
            )
            return module

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
            divisor=self.num_shards,
            generation=gen,
        )

    def close(self) -> None:
        self._link.closing = True
        self._destroy_group()
        self._link.close()


def _ready(gen: int, rebuild_s: float, sharded: GenerationGroup | None) -> Message:
    """The message that says this rank joined generation ``gen``; a sharded job's says which of
    its mesh groups it kept."""
    out: Message = {"t": "ready", "gen": gen, "rebuild_s": rebuild_s}
    if sharded is not None:
        g = sharded.mesh_groups
        out["groups"] = [g.kept, g.built, g.build_s]
    return out


def init() -> Session:
    """Join the job this process was started for by ``nonstop run``.

    A hot spare returns only when it has been given a rank. Raises UsageError
    when the process was not started by ``nonstop run``.
    """
    return Session(WorkerEnv.from_environ())
