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
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from nonstop.config import WorkerEnv
from nonstop.control.channel import Message
from nonstop.control.rdzv import ChannelStore
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.policy import cadence
from nonstop.train.backend import set_current_device, worker_device
from nonstop.train.eventhooks import FLUSH_S, EventCallback, EventHooks
from nonstop.train.frwatch import FlightRecorderWatch, flight_recorder_watch
from nonstop.train.group import GenerationGroup
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import EXIT_COORDINATOR_LOST as EXIT_COORDINATOR_LOST
from nonstop.train.link import CoordinatorLink, PeerFailed, uninterruptible
from nonstop.train.prewarm import prepare_spare
from nonstop.train.rejoin import Rejoin, TrainStep
from nonstop.train.rescue import StepHead, rest_digest
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.steps import Step, check_objects
from nonstop.train.threadprogress import ThreadProgress
from nonstop.train.trainee import Build, Replicated, Sharded, Trainee
from nonstop.train.waitclock import CollectiveClock

__all__ = ["RunResult", "Session", "init"]

log = logging.getLogger(__name__)

# Imported by a hot spare before it waits: the first torch.optim construction
# imports torch._dynamo (~1 s on these machines), which a spare must not pay
# after it has been given a rank.
PREWARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.algorithms")


USAGE_ABORT_WAIT_S = 10.0  # a worker that failed the job waits this long for the abort, then exits


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


class Session(Rejoin, HeartbeatWords):
    """A worker's connection to its job. Create it with :func:`init`.

    The control connection and its threads are a :class:`~nonstop.train.link.CoordinatorLink`,
    the process group of the current generation a :class:`~nonstop.train.group.GenerationGroup`;
    the session runs the training loop and the worker's side of recovery on the main thread.
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
        self.world_size = 0
        self.generation = 0
        self._sync = None
        self._clock: CollectiveClock | None = None  # a sharded model's waits (train/waitclock.py)
        self._frwatch: FlightRecorderWatch | None = None  # any collective's wait on a GPU (frwatch.py)
        self._last_step_s: float | None = None  # how long the last completed step took
        self._train_progress = ThreadProgress()  # the training thread's CPU and run-queue clocks
        self._group = GenerationGroup(keep_groups=env.keep_groups)
        self._step = 0
        self._progress_at = time.monotonic()  # when this rank last completed a step (heartbeat "idle")
        self._coll_at = 0.0  # when the heartbeat last saw it in a collective (monotonic; its thread)
        self._done = False  # this rank reported its last step (a restarted coordinator asks)
        self._live_at: int | None = None  # paused after this step: the live state is that step's
        self.warming_up = False  # a joiner's sandboxed step (see _warm_up): skip side effects
        self._train_thread: int | None = None  # the thread in run(): its collectives are watched
        self.result: RunResult | None = None  # once the job finished (run() returns it too)
        self._snaps = LoopSnapshots(env)  # (before the link: a reconnect's resume point reads it)
        self._link = CoordinatorLink(
            env,
            timeout=connect_timeout,
            heartbeat=self._heartbeat_msg,
            resume=self._resume_point,
            sever=self._group.sever,
        )
        self._link.on_cadence = self._snaps.schedule  # (--snapshot-budget: policy/cadence.py)
        self._faults = WorkerFaults(env, self._link)
        self._hooks = EventHooks()  # on_event's callbacks (train/eventhooks.py)
        # A spare waits here, imported, connected and (a sharded job's) warmed up, until it is
        # given a rank (its warm-up is adopted at its first join); ``prewarm_s``: seconds the
        # warm-up took (None: none, it failed or was interrupted)
        self._warmed = prepare_spare(env, prewarm, warm_build, device_type=self.device.type, link=self._link)
        self.prewarm_s: float | None = self._warmed.took_s if self._warmed is not None else None
        first = self._link.wait_for("reconfigure", "finish")
        if first["t"] == "finish":  # the job ended while this process waited as a spare
            self._link.close()
            raise SystemExit(0)
        self._pending_reconfigure: Message | None = first
        self.rank: int = int(first["rank"])
        self._set_membership(first)
        self._rest_gen: int | None = None  # the generation whose digest this rank reported
        self._head = StepHead()  # the step in flight's start, for a rescue (train/rescue.py)

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

    # -- what the link's threads report (read-only on the session) -----------------------
    def _resume_point(self) -> Message:
        # the interval this rank snapshots at: a restarted coordinator's tuner takes it up
        heard = self._snaps.announced()
        cadence = {"every": heard.every, "since": heard.since}
        return {"gen": self.generation, "step": self._step, "done": self._done, "cadence": cadence}

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
            self._start(model, optimizer, build, state, extras, load_extras, deterministic, wrap)
        except UsageError as e:
            self._fail_usage(e)
            raise
        return self._loop(num_steps, warm_up)

    def _start(
        self,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        build: Build | None,
        state: Mapping[str, Any] | None,
        extras: Callable[[], dict[str, Any]] | None,
        load_extras: Callable[[dict[str, Any]], None] | None,
        deterministic: bool,
        wrap: bool,
    ) -> None:
        self._train_thread = threading.get_ident()
        self._train_progress = ThreadProgress.of_this_thread()
        fence = self._snaps.fence if self.env.snapshot == "overlapped" else None
        if (model is None) == (build is None):
            raise UsageError("give model= (and optimizer=) for DDP, or build= for a --mesh job")
        if (extras is None) != (load_extras is None):
            raise UsageError("give both extras= and load_extras=, or neither")
        objects = check_objects(state)
        if build is not None:
            if self.env.mesh is None:
                raise UsageError("build=... trains a sharded model: start the job with --mesh")
            if not wrap:
                raise UsageError("wrap=False is for a data-parallel model= (a --mesh job's build wraps it)")
            self.trainee: Trainee = Sharded(
                build,
                MeshSpec.parse(self.env.mesh),
                extras=extras,
                load_extras=load_extras,
                fence=fence,
                objects=objects,
                device_type=self.device.type,  # the mesh on the rank's device (cuda on a GPU node)
                warmed=self._warmed,
            )
            self._warmed = None
        else:
            assert model is not None
            if self.env.mesh is not None:
                raise UsageError(f"this job has --mesh {self.env.mesh}: train through build=...")
            self.trainee = Replicated(
                model,
                optimizer,
                extras=extras,
                load_extras=load_extras,
                deterministic=deterministic,
                fence=fence if optimizer is not None else None,
                objects=objects,
                wrap=wrap,
            )
        self._sync = self.trainee.sync
        self._frwatch = flight_recorder_watch(self.device.type)  # None on the CPU
        if self._sync is None and self._clock is None:  # issue 21: a sharded model's waits, sampled
            self._clock = CollectiveClock(self._train_thread)
        if self._sync is not None:
            self._sync.exact = self.env.elastic
            self._sync.set_shards(self.shards, self.shards_played)
        self._snaps.open(self.rank)
        self._progress_at = time.monotonic()

    def _loop(self, num_steps: int, warm_up: TrainStep | None) -> Iterator[Step]:
        loss: float | None = None
        module: torch.nn.Module | None = None
        new_generation = False
        msg = self._pending_reconfigure
        self._pending_reconfigure = None
        try:
            while True:
                if msg is not None:
                    module = self._reconfigure(msg, warm_up)
                    msg, new_generation = None, True
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
                        if self._link.leaving(self.generation):  # (train/rescue.py)
                            raise PeerFailed("the coordinator asked the survivors to leave their step")
                        assert module is not None
                        step = Step(
                            self._step,
                            model=module,
                            generation=self.generation,
                            new_generation=new_generation,
                            enter=self._enter_step,
                            leave=self._leave_step,
                        )
                        t0 = time.monotonic()
                        self._take_wait_s()  # issue 21: this step's wait starts at 0
                        self._link.enter_step()  # a recovery interrupts a fault injected here
                        self._maybe_inject("step", self._step)
                        self._faults.stretch()  # issue 21: a slowdown fault's longer compute
                        self._link.in_step = False
                        self._arm_rescue()
                        yield step
                        error = step.outcome()
                        if error is not None:
                            raise error
                        if self._group.severed:  # ran on aborted collectives: never snapshot it
                            raise PeerFailed("the generation's group was aborted during the step")
                        new_generation, loss = False, step.loss
                        self._stepped(time.monotonic() - t0, loss, num_steps)
                    self._snaps.live.drain()  # the last snapshot is complete before we report done
                    self._done = True
                    self._link.send({"t": "done", "gen": self.generation, "step": self._step})
                    reply = self._link.wait_for("finish", "reconfigure")
                    if reply["t"] == "finish":
                        self._link.closing = True
                        if self._hooks.active:
                            self._hooks.flush(FLUSH_S)
                        self.result = RunResult(step=self._step, last_loss=loss, generation=self.generation)
                        return
                    msg = reply
                except _Reconfigure as r:
                    msg = r.msg
                except PeerFailed as e:
                    msg = self._on_step_error(e)
                except UsageError as e:  # the script's mistake: no recovery can fix it
                    self._fail_usage(e)
                    raise
                except Exception as e:  # a collective failed, or the user's code raised
                    self._link.in_step = False
                    msg = self._on_step_error(e)
        finally:
            self.trainee.close()
            self._snaps.live.close()
            if self._clock is not None:
                self._clock.close()
                self._clock = None

    def _take_wait_s(self) -> float:
        """Seconds in collectives since the last call: DDP's stamped allreduce, else sampled."""
        src = self._sync if self._sync is not None else self._clock
        return src.take_wait_s() if src is not None else 0.0

    @uninterruptible
    def _enter_step(self) -> None:
        self._link.enter_step()  # from here a recovery interrupts the step

    @uninterruptible
    def _leave_step(self) -> None:
        self._link.in_step = False

    def _stepped(self, step_s: float, loss: float | None, num_steps: int | None = None) -> None:
        """Step ``self._step`` completed in ``step_s``: count it, snapshot the state after it
        (when due: ``--snapshot-every``) and report it (a snapshotted step once its snapshot is
        complete: a step counts as committed only then)."""
        self._step += 1
        self._head.disarm()
        t1 = self._progress_at = time.monotonic()
        self._last_step_s = step_s
        wait_s = self._take_wait_s()  # issue 21
        self._faults.observe(step_s - wait_s)  # a slowdown fault stretches the own compute
        final = num_steps is not None and self._step >= num_steps
        due = self._snaps.due(self._step, final=final, pause_at=self._link.pause_at)
        snap = self._snaps.take(self._step, self._capture(), self.generation) if due else None
        # Stall: time the loop spent on this snapshot now, plus what the step just run
        # waited for the previous snapshot's background copy.
        stall_s = time.monotonic() - t1 + self._snaps.waited_s()
        report = {
            "t": "step",
            "gen": self.generation,
            "step": self._step,
            "step_s": step_s,
            # issue 21: seconds of the step spent waiting in the gradient allreduce (step_s minus
            # this is the rank's own compute: the coordinator's fail-slow detection compares it)
            "wait_s": round(wait_s, 6),
            "snap_s": stall_s,
            "of": num_steps,  # issue 21: the run's length (the proactive policy's remaining steps)
            "bytes": snap.nbytes if snap is not None else 0,
            "loss": loss,
        }
        if not due:
            report["snapped"] = False  # progress only: the committed step stays where it is
        if self.env.snapshot_budget > 0 and self._step >= cadence.SKIP and self._rest_gen != self.generation:
            report["rest"] = rest_digest(self._capture().head())  # once a generation (policy/cadence.py)
            self._rest_gen = self.generation
        # with overlapped capture the snapshot is complete when the background copy finishes
        if snap is None:
            self._link.send(report)
        else:
            snap.on_complete(functools.partial(self._link.send_quietly, report))

    def _fail_usage(self, err: UsageError) -> None:
        """Fail the job for the script's mistake ``err``: ``nonstop run`` exits 2 with its line
        (``err.reported`` once the coordinator's abort carries it: this process prints nothing)."""
        line = str(err)[:500]
        self._link.send_quietly(
            {"t": "fault", "gen": self.generation, "step": self._step, "error": line, "usage": True}
        )
        abort = self._link.await_abort(USAGE_ABORT_WAIT_S)
        err.reported = abort is not None and abort.endswith(line)

    def close(self) -> None:
        self._link.closing = True
        self._destroy_group()
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
