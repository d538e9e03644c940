"""The training loop of one trainee: yield its steps through generations, account for each one.

:class:`TrainingLoop` drives what :meth:`Session.steps <nonstop.train.session.Session.steps>`
returns: between two steps it delivers the event hook's step-delivered events, asks the
:class:`~nonstop.train.rejoin.Rejoin` whether the generation ends (a reconfigure, a leave) and
lets it rebuild the generation; it makes each step's :class:`~nonstop.train.steps.Step` (the
link told the main thread is in a step while the body runs: a recovery interrupts it there),
fires the injected faults due at a step, arms the rescue, and takes a failed step's error to the
rejoin. A completed step is counted (:class:`~nonstop.train.position.Position`'s step, the
heartbeat's progress), its seconds in collectives taken (:class:`~nonstop.train.waitclock.CollectiveWaits`)
and it is snapshotted when due and reported (:class:`~nonstop.train.reports.StepReports`). After
the last step it tells the coordinator ``done`` and waits for ``finish`` (the job's end: the
:class:`RunResult`) or a reconfigure (the loop goes on in a new generation).

Its own state: the trainee it trains, its gradient sync (set to the generation's shards here),
the trainee's :class:`~nonstop.train.rejoin.Rejoin`, and the clock of the steps' seconds in
collectives, from the loop's start to its end (the heartbeat watches it meanwhile). The session
holds every other collaborator and hands them in.

Threading contract: main thread only (the training loop's); the link's threads read the
:class:`~nonstop.train.position.Position` it moves and the heartbeat's words it sets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nonstop.config import WorkerEnv
from nonstop.errors import UsageError
from nonstop.protocol.worker import DoneMsg, FinishMsg, ReconfigureMsg
from nonstop.train.eventhooks import FLUSH_S, EventHooks
from nonstop.train.frwatch import flight_recorder_watch
from nonstop.train.group import GenerationGroup
from nonstop.train.heartbeat import HeartbeatWords
from nonstop.train.injection import WorkerFaults
from nonstop.train.link import CoordinatorLink, PeerFailed, uninterruptible
from nonstop.train.membership import Membership
from nonstop.train.position import Position
from nonstop.train.rejoin import Rejoin, TrainStep
from nonstop.train.reports import StepReports
from nonstop.train.rescue import StepRescue
from nonstop.train.snapshots import LoopSnapshots
from nonstop.train.steps import Step
from nonstop.train.trainee import Trainee
from nonstop.train.waitclock import CollectiveWaits

__all__ = ["RunResult", "TrainingLoop"]


@dataclass(frozen=True)
class RunResult:
    """What :meth:`Session.run <nonstop.train.session.Session.run>` returns on every rank once
    the job finished."""

    step: int
    last_loss: float | None
    generation: int


class _Reconfigure(Exception):
    def __init__(self, msg: ReconfigureMsg) -> None:
        super().__init__(f"reconfigure to generation {msg.gen}")
        self.msg = msg


class TrainingLoop:
    """The loop that trains ``trainee`` in the job ``env`` (see the module docstring), started
    on this thread.

    ``link``, ``group``, ``snaps``, ``rescue``, ``faults``, ``members``, ``position``,
    ``beat``, ``hooks`` and ``reports``: the session's own collaborators
    (:class:`~nonstop.train.session.Session`; the first seven are the ``rejoin``'s too);
    ``device_type``: the rank's device's (a CUDA rank's flight recorder is watched).
    ``fail_usage(err)``: fail the job for the script's mistake ``err``; ``finished(result)``:
    the job ended, after ``result.step`` steps."""

    def __init__(
        self,
        env: WorkerEnv,
        trainee: Trainee,
        *,
        link: CoordinatorLink,
        group: GenerationGroup,
        snaps: LoopSnapshots,
        rescue: StepRescue,
        faults: WorkerFaults,
        members: Membership,
        position: Position,
        beat: HeartbeatWords,
        hooks: EventHooks,
        reports: StepReports,
        device_type: str,
        fail_usage: Callable[[UsageError], None],
        finished: Callable[[RunResult], None],
    ) -> None:
        self.trainee = trainee
        self.rejoin = Rejoin(
            env,
            trainee=trainee,
            link=link,
            group=group,
            snaps=snaps,
            rescue=rescue,
            faults=faults,
            members=members,
            position=position,
        )
        self._link, self._group, self._snaps, self._rescue = link, group, snaps, rescue
        self._faults, self._members, self._pos, self._beat = faults, members, position, beat
        self._hooks, self._reports = hooks, reports
        self._fail_usage, self._finished = fail_usage, finished
        self.sync = trainee.sync
        self._waits: CollectiveWaits | None = CollectiveWaits(self.sync, threading.get_ident())  # issue 21
        frwatch = flight_recorder_watch(device_type)  # None on the CPU
        beat.watch_collectives(sync=self.sync, clock=self._waits.clock, frwatch=frwatch)
        if self.sync is not None:
            self.sync.exact = env.elastic
            self.sync.set_shards(members.shards, members.shards_played)
        snaps.open(members.rank)
        beat.progressed()

    def steps(
        self, num_steps: int, warm_up: TrainStep | None, first: Callable[[], ReconfigureMsg | None]
    ) -> Iterator[Step]:
        """Yield the steps up to ``num_steps`` through every generation until the job finished;
        ``first()``: the reconfigure that starts the first generation (asked at the first step
        asked for); ``warm_up``: a migration's joiner's sandboxed step."""
        loss: float | None = None
        module: torch.nn.Module | None = None
        new_generation = False
        msg = first()
        rejoin, link, pos = self.rejoin, self._link, self._pos
        try:
            while True:
                if msg is not None:
                    module = rejoin.reconfigure(msg, warm_up)
                    msg, new_generation = None, True
                    self._beat.progressed()
                try:
                    while pos.step < num_steps:
                        self._hooks.deliver_pending()  # on_event(deliver="step")
                        pending = rejoin.between_steps()
                        if pending is not None:
                            raise _Reconfigure(pending)
                        assert module is not None
                        step = Step(
                            pos.step,
                            model=module,
                            generation=pos.generation,
                            new_generation=new_generation,
                            enter=self._enter_step,
                            leave=self._leave_step,
                        )
                        t0 = time.monotonic()
                        self._take_wait_s()  # issue 21: this step's wait starts at 0
                        link.enter_step()  # a recovery interrupts a fault injected here
                        self._faults.maybe_fire(
                            "step", rank=self._members.rank, step=pos.step, generation=pos.generation
                        )
                        self._faults.stretch()  # issue 21: a slowdown fault's longer compute
                        link.in_step = False
                        self._rescue.arm(self.trainee.capture, pos.step)
                        yield step
                        error = step.outcome()
                        if error is not None:
                            raise error
                        if self._group.severed:  # ran on aborted collectives: never snapshot it
                            raise PeerFailed("the generation's group was aborted during the step")
                        new_generation, loss = False, step.loss
                        self._stepped(time.monotonic() - t0, loss, num_steps)
                    msg = self._done(loss)
                    if msg is None:
                        return
                except _Reconfigure as r:
                    msg = r.msg
                except PeerFailed as e:
                    msg = rejoin.on_step_error(e)
                except UsageError as e:  # the script's mistake: no recovery can fix it
                    self._fail_usage(e)
                    raise
                except Exception as e:  # a collective failed, or the user's code raised
                    link.in_step = False
                    msg = rejoin.on_step_error(e)
        finally:
            self.trainee.close()
            self._snaps.live.close()
            self.stop_clock()

    def _done(self, loss: float | None) -> ReconfigureMsg | None:
        """The last step is done: report it once its snapshot is complete, then the job's end
        (None: :class:`RunResult` handed to ``finished``) or the reconfigure that goes on."""
        link, pos = self._link, self._pos
        self._snaps.live.drain()  # the last snapshot is complete before we report done
        pos.done = True
        link.send(DoneMsg(gen=pos.generation, step=pos.step).encode())
        reply = link.wait_for(FinishMsg, ReconfigureMsg)
        if isinstance(reply, ReconfigureMsg):
            return reply
        link.closing = True
        if self._hooks.active:
            self._hooks.flush(FLUSH_S)
        self._finished(RunResult(step=pos.step, last_loss=loss, generation=pos.generation))
        return None

    def stop_clock(self) -> None:
        """Stop the clock of the steps' seconds in collectives (the heartbeat stops watching it)."""
        if self._waits is not None:
            self._waits.close()
            self._waits = self._beat.clock = None

    def _take_wait_s(self) -> float:
        return self._waits.take_wait_s() if self._waits is not None else 0.0

    @uninterruptible
    def _enter_step(self) -> None:
        self._link.enter_step()  # from here a recovery interrupts the step

    @uninterruptible
    def _leave_step(self) -> None:
        self._link.in_step = False

    def _stepped(self, step_s: float, loss: float | None, num_steps: int | None = None) -> None:
        """The step in flight completed in ``step_s``: count it, then snapshot the state after it
        when due and report it (:class:`~nonstop.train.reports.StepReports`)."""
        pos = self._pos
        pos.step += 1
        self._rescue.disarm()
        t1 = time.monotonic()
        self._beat.stepped(t1, step_s)
        wait_s = self._take_wait_s()  # issue 21
        self._faults.observe(step_s - wait_s)  # a slowdown fault stretches the own compute
        capture = self.trainee.capture
        assert capture is not None, "the model is built once the generation's group is joined"
        self._reports.completed(
            pos.step,
            generation=pos.generation,
            capture=capture,
            step_s=step_s,
            wait_s=wait_s,
            loss=loss,
            num_steps=num_steps,
            since=t1,
        )
