"""The worker side of nonstop: join the job, train, snapshot every step, recover.

Usage in a training script (run it with ``nonstop run``)::

    import nonstop
    session = nonstop.init()               # a hot spare blocks here until it gets a rank
    model, opt = build()                   # same on every rank
    def train_step(ddp_model, step):       # one optimizer step; returns the loss
        ...
    session.run(train_step, model=model, optimizer=opt, num_steps=1000)

A script that owns its loop (or a framework that does) iterates :meth:`Session.steps` instead,
each step inside ``with step:`` (:mod:`nonstop.train.steps`)::

    for step in session.steps(1000, model=model, optimizer=opt, state={"sched": sched}):
        with step:
            loss = train(step.model, step)

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
* ``state={name: obj}``: objects with ``state_dict()``/``load_state_dict()`` (LR schedulers,
  ``GradScaler``, ``StatefulDataLoader``, :class:`~nonstop.train.steps.Batches`) are snapshotted
  with every step and restored with it. A mistake in the arguments (an object without those
  methods) is a :class:`~nonstop.errors.UsageError` that fails the whole job at once: ``nonstop
  run`` exits 2 with its line.

The :class:`Session` joins the job and holds the worker's collaborators; the loop that
:meth:`Session.steps` returns is a :class:`~nonstop.train.loop.TrainingLoop` of its own, made
for the script's trainee from those collaborators.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nonstop.config import WorkerEnv
from nonstop.control.rdzv import ChannelStore
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.protocol.worker import CadenceMsg, FaultMsg, FinishMsg, ReconfigureMsg, ResumeMsg
from nonstop.train.backend import set_current_device, worker_device
from nonstop.train.eventhooks import EventCallback, EventHooks
from nonstop.train.group import GenerationGroup
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import EXIT_COORDINATOR_LOST as EXIT_COORDINATOR_LOST
from nonstop.train.link import CoordinatorLink
from nonstop.train.loop import RunResult, TrainingLoop
from nonstop.train.membership import Membership
from nonstop.train.position import Position
from nonstop.train.prewarm import Warmed, prepare_spare
from nonstop.train.rejoin import TrainStep, destroy_group
from nonstop.train.reports import StepReports
from nonstop.train.rescue import StepRescue
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.steps import Step
from nonstop.train.threadprogress import ThreadProgress
from nonstop.train.trainee import Build, Sharded, Trainee, accumulate, trainee_for

__all__ = ["RunResult", "Session", "init"]

log = logging.getLogger(__name__)

# Imported by a hot spare before it waits: the first torch.optim construction
# imports torch._dynamo (~1 s on these machines), which a spare must not pay
# after it has been given a rank.
PREWARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.algorithms")


USAGE_ABORT_WAIT_S = 10.0  # a worker that failed the job waits this long for the abort, then exits


class Session:
    """A worker's connection to its job. Create it with :func:`init`.

    The session joins the job, answers what a script reads (its rank's place, the store, the
    event hook) and starts the training loop on the main thread; it holds the collaborators,
    each an object of its own: the control connection and its threads
    (:class:`~nonstop.train.link.CoordinatorLink`), the process group of the current generation
    (:class:`~nonstop.train.group.GenerationGroup`), the rank's place in the generation
    (:class:`~nonstop.train.membership.Membership`) and in the job
    (:class:`~nonstop.train.position.Position`), the heartbeat's words
    (:class:`~nonstop.train.heartbeat.HeartbeatWords`), the snapshot slots and their schedule
    (:class:`~nonstop.train.snapshots.LoopSnapshots`), rescues
    (:class:`~nonstop.train.rescue.StepRescue`), step reports
    (:class:`~nonstop.train.reports.StepReports`), injected faults
    (:class:`~nonstop.train.injection.WorkerFaults`), the event hook
    (:class:`~nonstop.train.eventhooks.EventHooks`) and, once :meth:`steps` has started, the
    loop (:class:`~nonstop.train.loop.TrainingLoop`: the model side,
    :class:`~nonstop.train.trainee.Trainee`, and its generation change,
    :class:`~nonstop.train.rejoin.Rejoin`).
    """

    def __init__(
        self,
        env: WorkerEnv,
        *,
        connect_timeout: float = 30.0,
        prewarm: tuple[str, ...] = PREWARM_MODULES,
        warm_build: Build | None = None,
    ) -> None:
        self.env = env
        # issue 20: this process's own device (its agent's choice at spawn, LOCAL_RANK's index;
        # cpu on a CPU node), made current before anything here or in a spare touches CUDA.
        # A script moves its model there: ``model.to(session.device)`` (train/backend.py).
        self.device: torch.device = worker_device()
        set_current_device(self.device)
        self._members = Membership(env.mesh)
        self._pos = Position()
        self._beat = HeartbeatWords(self._pos)
        self._group = GenerationGroup(keep_groups=env.keep_groups)
        self.result: RunResult | None = None  # once the job finished (run() returns it too)
        self._snaps = LoopSnapshots(env)  # (before the link: a reconnect's resume point reads it)
        self._link = CoordinatorLink(
            env,
            timeout=connect_timeout,
            heartbeat=self._beat.message,
            resume=self._resume_point,
            sever=self._group.sever,
        )
        self._link.on_cadence = self._snaps.schedule  # (--snapshot-budget: policy/cadence.py)
        self._faults = WorkerFaults(env, self._link)
        self._hooks = EventHooks()  # on_event's callbacks (train/eventhooks.py)
        self._rescue = StepRescue(self._snaps, snapshot=env.snapshot)
        self._reports = StepReports(link=self._link, snaps=self._snaps, snapshot_budget=env.snapshot_budget)
        self._training: TrainingLoop | None = None  # from steps(): the trainee's (train/loop.py)
        # A spare waits here, imported, connected and (a sharded job's) warmed up, until it is
        # given a rank (its warm-up is adopted at its first join); ``prewarm_s``: seconds the
        # warm-up took (None: none, it failed or was interrupted)
        self._warmed: Warmed | None = prepare_spare(
            env, prewarm, warm_build, device_type=self.device.type, link=self._link
        )
        self.prewarm_s: float | None = self._warmed.took_s if self._warmed is not None else None
        first = self._link.wait_for(ReconfigureMsg, FinishMsg)
        if not isinstance(first, ReconfigureMsg):  # the job ended while this process waited as a spare
            self._link.close()
            raise SystemExit(0)
        self._pending_reconfigure: ReconfigureMsg | None = first
        self._members.apply(first)

    # -- what a script reads: the rank's place in its generation (train/membership.py) --------
    @property
    def rank(self) -> int:
        """This process's rank in the current generation."""
        return self._members.rank

    @property
    def world_size(self) -> int:
        """The number of ranks of the current generation (0 before the first)."""
        return self._members.world_size

    @property
    def generation(self) -> int:
        """The generation this rank plays (a new one after every recovery or resize)."""
        return self._pos.generation

    @property
    def shards(self) -> tuple[int, ...]:
        """The data shards this rank plays (its rank at full size; more after a shrink)."""
        return self._members.shards

    @property
    def num_shards(self) -> int:
        """The job's data shards: the full-size job's world size."""
        return self._members.num_shards

    @property
    def shards_played(self) -> int:
        """The shards the generation plays: the gradient mean's divisor (``num_shards``, or
        fewer while ``--shrink-batch drop`` drops the lost ranks' shares)."""
        return self._members.shards_played

    @property
    def mesh(self) -> MeshSpec | None:
        """This generation's mesh: the job's ``--mesh``, with fewer replica groups after an
        elastic shrink (None: a data-parallel job)."""
        return self._members.mesh

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the batch it reads (ranks of one TP group read the
        same); the rank itself in a data-parallel job."""
        return self._members.dp_rank

    @property
    def dp_size(self) -> int:
        """How many different batches the job reads per step (its data-parallel degree)."""
        return self._members.dp_size

    @property
    def warming_up(self) -> bool:
        """True during a migration's joiner's sandboxed warm-up step: a script skips its side
        effects (logs, counters) then (:meth:`Rejoin.warm_up <nonstop.train.rejoin.Rejoin.warm_up>`)."""
        return self._training is not None and self._training.rejoin.warming_up

    def shard_steps(self, model: torch.nn.Module) -> Iterator[int]:
        """The data shards this rank plays in this step, for gradient accumulation::

            for shard in session.shard_steps(model):
                x, y = batch_for(step, shard)          # shard k: what rank k of the full job reads
                loss_fn(model(x), y).backward()

        In a job at its full size each rank plays one shard (its rank; a sharded job's: its
        ``dp_rank``). After an elastic shrink a rank plays several: the gradients of all but the
        last are accumulated locally (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``),
        the last backward reduces, and the sum is divided by the number of shards, so the global
        batch and its samples are those of the full-size job (with ``--shrink-batch drop`` a
        shrunk rank plays its own shards only, the sum divided by the shards played). In an
        elastic data-parallel job the mean is bitwise the same at every world size
        (:mod:`nonstop.train.exactsum`): each shard's gradient is kept apart and the shards are
        summed in their order."""
        sync = self._training.sync if self._training is not None else None
        if sync is not None and sync.exact and isinstance(model, DistributedDataParallel):
            return sync.accumulate(model)
        return accumulate(model, self._members.shards)

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
        :class:`~nonstop.events.Event`: ``event.kind``, its fields, ``event.to_json()``):
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

    # -- what the link's reader thread reports (read-only on the session) ---------------------
    def _resume_point(self) -> ResumeMsg:
        # the interval this rank snapshots at: a restarted coordinator's tuner takes it up
        heard = self._snaps.announced()
        cadence = CadenceMsg(every=heard.every, since=heard.since)
        pos = self._pos
        return ResumeMsg(gen=pos.generation, step=pos.step, done=pos.done, cadence=cadence)

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
        state: Mapping[str, Any] | None = None,
        deterministic: bool = True,
    ) -> RunResult:
        """Train ``num_steps`` steps through failures. See the module docstring.

        Data-parallel (DDP): give ``model`` and ``optimizer``. Sharded (the job's ``--mesh``:
        FSDP2, HSDP, tensor parallel): give ``build(mesh) -> (model, optimizer)`` instead; it is
        called on every rank of every generation with a ``DeviceMesh`` whose dims carry the
        mesh's names, and must run no collective (``fully_shard`` is local; give
        ``parallelize_module`` ``src_data_rank=None``). ``state``: named objects with
        ``state_dict()``/``load_state_dict()`` (LR scheduler, GradScaler, StatefulDataLoader),
        captured every step and restored exactly. The loop is :meth:`steps`'s."""
        for step in self.steps(
            num_steps,
            model=model,
            optimizer=optimizer,
            build=build,
            state=state,
            extras=extras,
            load_extras=load_extras,
            deterministic=deterministic,
            warm_up=train_step,
        ):
            with step:
                step.loss = train_step(step.model, int(step))
        assert self.result is not None
        return self.result

    def steps(
        self,
        num_steps: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        build: Build | None = None,
        state: Mapping[str, Any] | None = None,
        extras: Callable[[], dict[str, Any]] | None = None,
        load_extras: Callable[[dict[str, Any]], None] | None = None,
        deterministic: bool = True,
        wrap: bool = True,
        warm_up: TrainStep | None = None,
    ) -> Iterator[Step]:
        """The training loop, owned by the script: yields one :class:`~nonstop.train.steps.Step`
        per optimizer step, to run inside ``with step:``; same guarantees as :meth:`run`::

            for step in session.steps(N, model=model, optimizer=opt, state={"sched": sched}):
                with step:
                    loss = train(step.model, step)   # step: the 0-based step index (an int)

        A failure inside ``with step:`` is recovered and the loop goes on at the committed
        step (see :mod:`nonstop.train.steps`). The iterator ends when the job has finished
        (:attr:`result` then holds the :class:`RunResult`); do not leave the loop early.
        ``wrap=False`` (data-parallel): the model is not wrapped in DDP -- the default process
        group exists in every generation and a framework that owns the loop wraps the model
        itself (again when ``step.new_generation``). ``warm_up(model, step)``: one sandboxed step
        a migration's joiner runs on the bare model (``run`` passes its ``train_step``). Arguments
        are checked here, before the first step: a mistake fails the job at once (exit 2)."""
        try:
            self._beat.watch_thread(threading.get_ident(), ThreadProgress.of_this_thread())
            trainee = trainee_for(
                model=model,
                optimizer=optimizer,
                build=build,
                state=state,
                extras=extras,
                load_extras=load_extras,
                deterministic=deterministic,
                wrap=wrap,
                mesh=self.env.mesh,
                fence=self._snaps.fence if self.env.snapshot == "overlapped" else None,
                device_type=self.device.type,
                warmed=self._warmed,
            )
            loop = self._start(trainee)
        except UsageError as e:
            self._fail_usage(e)
            raise
        return loop.steps(num_steps, warm_up, self._first_reconfigure)

    def _start(self, trainee: Trainee) -> TrainingLoop:
        """The loop that trains ``trainee`` from here (the loop's thread: this one)."""
        if isinstance(trainee, Sharded):
            self._warmed = None  # (adopted at its first join)
        if self._training is not None:
            self._training.stop_clock()
        self._training = loop = TrainingLoop(
            self.env,
            trainee,
            link=self._link,
            group=self._group,
            snaps=self._snaps,
            rescue=self._rescue,
            faults=self._faults,
            members=self._members,
            position=self._pos,
            beat=self._beat,
            hooks=self._hooks,
            reports=self._reports,
            device_type=self.device.type,
            fail_usage=self._fail_usage,
            finished=self._finished,
        )
        return loop

    def _first_reconfigure(self) -> ReconfigureMsg | None:
        """The reconfigure that made this process a rank (once: the loop starts with it)."""
        msg, self._pending_reconfigure = self._pending_reconfigure, None
        return msg

    def _finished(self, result: RunResult) -> None:
        self.result = result

    @property
    def trainee(self) -> Trainee:
        """The model side of the loop :meth:`steps` started (:mod:`nonstop.train.trainee`)."""
        if self._training is None:
            raise AttributeError("the trainee exists once Session.steps() has started")
        return self._training.trainee

    def _fail_usage(self, err: UsageError) -> None:
        """Fail the job for the script's mistake ``err``: ``nonstop run`` exits 2 with its line
        (``err.reported`` once the coordinator's abort carries it: this process prints nothing)."""
        line = str(err)[:500]
        self._link.send_quietly(
            FaultMsg(gen=self.generation, step=self._pos.step, error=line, usage=True).encode()
        )
        abort = self._link.await_abort(USAGE_ABORT_WAIT_S)
        err.reported = abort is not None and abort.endswith(line)

    def close(self) -> None:
        """Leave the job: tear this generation's group down and close the control connection."""
        self._link.closing = True
        destroy_group(self._link, self._group)
        self._link.close()


def init(*, build: Build | None = None) -> Session:
    """Join the job this process was started for by ``nonstop run``.

    A hot spare returns only when it has been given a rank. Raises UsageError
    when the process was not started by ``nonstop run``. From here an uncaught
    :class:`UsageError` (a mistake in the script's use of nonstop, which fails the job) prints
    its one line, not a traceback.

    ``build``: a sharded job's ``build(mesh)`` (the one given to :meth:`Session.run`), defined
    before this call. A hot spare then calls it once while it waits, in a fake world of the
    job's mesh, and takes one optimizer step on zero gradients there, so that its first step
    after taking a rank finds DTensor's caches warm (:mod:`nonstop.train.prewarm`: 0.2-0.28 s
    of an HSDP spare's first step on the demo model). Ranks, and a data-parallel job's spares,
    ignore it.
    """
    session = Session(WorkerEnv.from_environ(), warm_build=build)
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _one_line_usage_errors
    return session


def _one_line_usage_errors(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
    if isinstance(err, UsageError):
        if err.reported:
            return  # nonstop run prints the line
        print(f"nonstop: error: {err}", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, err, tb)
