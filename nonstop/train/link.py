"""A worker's link to its coordinator: the control connection, its threads and its inbox.

:class:`CoordinatorLink` is the control-channel side of a :class:`~nonstop.train.session.Session`:
it connects (``hello``), receives everything the coordinator sends, heartbeats, reconnects to
a restarted coordinator (store mode), and hands the session the messages it waits for between
steps. It also carries the current generation's rendezvous store
(:class:`~nonstop.control.rdzv.ChannelStore`), whose requests and replies travel on this same
connection.

Threading contract:

* The **reader thread** (``nonstop-reader``) is the only one that receives. It delivers ``kv``
  replies to ``rdzv``, ``event`` messages (``Session.on_event``) to ``on_feed`` (which queues
  them without blocking: :mod:`nonstop.train.eventhooks`), aborts ``rdzv`` when a reconfigure
  or an abort arrives (so a rendezvous in progress gives up), and queues every other message
  in the inbox. A reconfigure that
  arrives while the main thread is inside a step (``in_step``) interrupts it: SIGUSR1, sent to
  the main thread (``pthread_kill``, so a system call it is blocked in -- a sleep, a read --
  returns EINTR), makes the handler raise :class:`PeerFailed` there. A signal handler runs
  only between bytecodes, though, and a main thread blocked in a collective with a peer that will never
  answer (a partition: no reset ever arrives) would wait out the group's timeout, so the reader
  also calls the owner's ``sever`` callback for every reconfigure but a live swap's (a recovery,
  a re-plan: the peers leave wherever they are, and a peer that left at a boundary parks a
  sharded job's mesh groups without closing them, so nothing else would fail a collective on
  them), which fails the collectives in flight at once
  (:meth:`~nonstop.train.group.GenerationGroup.sever`). A recovery's names the failed ranks:
  a sharded job's mesh groups without one are left open, and a
  :class:`~nonstop.train.settle.Settling` thread (``nonstop-settle``) severs those a peer's post
  shows cannot complete; its store's ``kv`` replies are delivered like ``rdzv``'s. A live
  swap's reconfigure comes after every rank paused at the boundary; a rank found in a step
  then is severed by the heartbeat thread once the reconfigure has waited :data:`STUCK_DUMP_S`.
  When the connection ends the reader reconnects within ``reconnect_s`` (store mode, replacing
  ``chan``) or ends the process with :data:`EXIT_COORDINATOR_LOST`; after ``closing`` it just
  returns.
* The **heartbeat thread** (``nonstop-heartbeat``) sends the owner's heartbeat message every
  ``heartbeat_interval_s`` until ``closing``.
* The **main thread** (the one that built the link, the training loop's) alone consumes the
  inbox (:meth:`wait_for`, :meth:`poll_reconfigure`), reads and writes ``pause_at`` and
  writes ``in_step``, ``rdzv`` and ``closing``; the other threads only read them.
* :meth:`send` and :meth:`send_quietly` may be called from any thread (the channel serialises
  sends); ``send_quietly`` is the one for helper threads such as the snapshot copier.
* The owner's ``heartbeat`` and ``resume`` callbacks run on the heartbeat and reader threads:
  they must only read the owner's state.
"""

from __future__ import annotations

import _thread
import faulthandler
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Collection, Sequence
from types import CodeType, FrameType
from typing import Any, TypeVar

from nonstop.config import WorkerEnv
from nonstop.control.channel import Channel, Message, connect
from nonstop.control.rdzv import ChannelStore
from nonstop.errors import ControlError, JobFailedError
from nonstop.policy.cadence import Cadence
from nonstop.protocol.base import RawMsg, WireError, kind_of
from nonstop.protocol.worker import (
    AbortMsg,
    CadenceMsg,
    ContinueMsg,
    DoneMsg,
    EventMsg,
    HeartbeatMsg,
    LeaveMsg,
    PauseMsg,
    ReconfigureMsg,
    ResumeMsg,
    SubscribeMsg,
    WorkerHelloMsg,
    WorkerOrder,
    decode_order,
)
from nonstop.train.meshgroups import GroupClaim, OpenGroup
from nonstop.train.settle import Settling, lost_ranks, post

__all__ = ["EXIT_COORDINATOR_LOST", "CoordinatorLink", "PeerFailed", "severs", "uninterruptible"]

log = logging.getLogger(__name__)

EXIT_COORDINATOR_LOST = 75
STUCK_DUMP_S = 10.0  # a reconfigure untaken this long: the main thread's stacks go to the log
SETTLE_STORE_S = 5.0  # a settling post or read that takes longer: settle nothing (sever it all)
REDELIVER_S = 0.001  # an interrupt that landed where it may not raise is sent again this much later
F = TypeVar("F", bound=Callable[..., Any])

_NOT_HERE: set[CodeType] = set()


def uninterruptible(fn: F) -> F:
    """Mark ``fn`` as a place where a recovery never raises :class:`PeerFailed` (the main thread
    entering or leaving a step: an exception raised there would escape the step's handler); the
    interrupt is delivered again at the next instruction outside it."""
    _NOT_HERE.add(fn.__code__)
    return fn


def severs(order: ReconfigureMsg | LeaveMsg) -> bool:
    """Whether a reconfigure (or a leave) that finds the main thread in a step severs the
    generation's group first (:meth:`CoordinatorLink._leave_step_now`): every one but a live
    swap's -- a recovery's, and a re-plan's, whose peers leave wherever they are."""
    return order.recovery or not (isinstance(order, ReconfigureMsg) and order.live)


class PeerFailed(BaseException):
    """Raised in the main thread inside ``train_step`` when the coordinator has started a
    recovery: the rank stops computing a step that cannot complete. A BaseException, like
    KeyboardInterrupt, so a broad ``except Exception`` in user code does not swallow it."""


class CoordinatorLink:
    """The control connection of one worker process. See the module docstring for threads.

    ``heartbeat()`` returns the heartbeat message to send; ``resume()`` what a reconnecting
    worker tells a restarted coordinator about where it is (the hello's ``resume``).

    Every order is decoded once, by the reader (:func:`~nonstop.protocol.worker.decode_order`);
    the inbox holds them typed. One that is malformed is queued as its
    :class:`~nonstop.protocol.base.WireError`, raised in the main thread where it takes it (the
    training loop handles it as any error there); a ``leave`` or an ``event`` that cannot be read
    is dropped (the reader ignored such a leave, and the event hook such an event, before).
    """

    def __init__(
        self,
        env: WorkerEnv,
        *,
        timeout: float,
        heartbeat: Callable[[], HeartbeatMsg],
        resume: Callable[[], ResumeMsg],
        sever: Callable[[Collection[int] | None], Sequence[OpenGroup]] | None = None,
    ) -> None:
        self.env = env
        self._sever = sever
        self._settle_store: ChannelStore | None = None  # a recovery's settling posts (settle.py)
        self.settling: Settling | None = None
        self._heartbeat_msg = heartbeat
        self._resume = resume
        self._inbox: queue.Queue[WorkerOrder | WireError] = queue.Queue()
        self._arrived = 0  # reconfigures the reader put in the inbox (reader thread writes)
        self._stuck_since: float | None = None  # since when one has waited (heartbeat thread)
        self._dumped = False  # the stacks of a stuck main thread are written once per process
        self._taken = 0  # reconfigures the main thread took out (main thread writes)
        self.closing = False
        self.rdzv: ChannelStore | None = None  # this generation's rendezvous store, if any
        self.pause_at: int | None = None  # live migration: stop after this step, wait for the swap
        # a new snapshot cadence (--snapshot-budget) arrived: handed here between steps
        self.on_cadence: Callable[[Cadence], None] | None = None
        self.leave_gen: int | None = None  # a ``leave`` for this generation arrived (_on_leave)
        self.in_step = False
        # Session.on_event: the reader hands each ``event`` message here (it must not block),
        # and a reconnect to a restarted coordinator repeats the subscription
        self.on_feed: Callable[[EventMsg], None] | None = None
        self._subscription: SubscribeMsg | None = None
        self._can_interrupt = threading.current_thread() is threading.main_thread()
        self._main_ident = threading.main_thread().ident or 0
        if self._can_interrupt:
            self._start_redelivery()
            signal.signal(signal.SIGUSR1, self._on_interrupt)
        self.chan: Channel = connect(env.control_addr, env.secret, self._hello().encode(), timeout=timeout)
        threading.Thread(target=self._reader, name="nonstop-reader", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="nonstop-heartbeat", daemon=True).start()

    # -- the reader thread -----------------------------------------------------------------
    def _reader(self) -> None:
        while True:
            self._read()
            if self.closing or self.env.reconnect_s <= 0 or not self._reconnect():
                # The coordinator is gone: nobody can recover this job; do not linger.
                if not self.closing:
                    os._exit(EXIT_COORDINATOR_LOST)
                return

    def _hello(self, resume: ResumeMsg | None = None) -> WorkerHelloMsg:
        return WorkerHelloMsg(role=self.env.role, spawn_id=self.env.spawn_id, pid=os.getpid(), resume=resume)

    def _reconnect(self) -> bool:
        """Store mode: the coordinator restarts; reach the new one (same address) within
        ``reconnect_s``, telling it where this rank is. Training goes on meanwhile."""
        deadline = time.monotonic() + self.env.reconnect_s
        while time.monotonic() < deadline and not self.closing:
            # where this rank is *now*: it trains on while the coordinator is away, and what it
            # sends meanwhile (steps, done) is lost -- a resume point taken when the connection
            # broke would leave the new coordinator waiting for steps already taken
            said = self._resume()
            hello = self._hello(said).encode()
            try:
                self.chan = connect(self.env.control_addr, self.env.secret, hello, timeout=1.0)
                log.info("reconnected to the coordinator")
                if self._subscription is not None:
                    self.send_quietly(self._subscription.encode())
                now = self._resume()
                if now.done and not said.done:
                    # it finished while the hello was on its way, and sent its done to the dead
                    # connection: the coordinator would wait for it forever (a repeat is harmless)
                    self.send_quietly(DoneMsg(gen=now.gen, step=now.step).encode())
                return True
            except (ControlError, OSError):
                time.sleep(0.2)
        return False

    def _read(self) -> None:
        """Deliver the coordinator's messages until the connection ends."""
        try:
            while True:
                raw = self.chan.recv()
                try:
                    msg = decode_order(raw)
                except WireError as e:
                    self._malformed(kind_of(raw), e)
                    continue
                if msg is None:  # a kind this worker does not know: ignored
                    continue
                if isinstance(msg, EventMsg):
                    feed = self.on_feed
                    if feed is not None:
                        feed(msg)
                    continue
                if isinstance(msg, RawMsg):  # a rendezvous kv reply
                    for store in (self.rdzv, self._settle_store):  # (each takes its own replies)
                        if store is not None:
                            store.deliver(msg.msg)
                    continue
                if isinstance(msg, ReconfigureMsg | AbortMsg):
                    self._abort_stores()
                if isinstance(msg, LeaveMsg):
                    self._on_leave(msg)  # (and to the inbox: a rank paused at a swap's boundary leaves too)
                self._inbox.put(msg)
                if isinstance(msg, ReconfigureMsg):
                    self._arrived += 1  # before in_step is read: see enter_step
                    if self.in_step:
                        self._leave_step_now(msg)
        except (ControlError, OSError, ValueError):
            return

    def _abort_stores(self) -> None:
        rdzv, settle = self.rdzv, self._settle_store  # read once: the main thread may drop them
        for store in (rdzv, settle):
            if store is not None:
                store.abort("a newer generation started")  # unblock a rendezvous in progress

    def _malformed(self, kind: Any, err: WireError) -> None:
        """Reader thread: an order that breaks the protocol. A leave or an event is dropped; any
        other goes to the inbox as its error, which the main thread raises where it takes it (a
        reconfigure's or an abort's still ends the rendezvous in progress)."""
        if kind in (LeaveMsg.T, EventMsg.T):
            log.warning("ignored a malformed %r message: %s", kind, err)
            return
        if kind in (ReconfigureMsg.T, AbortMsg.T):
            self._abort_stores()
        self._inbox.put(err)

    def _leave_step_now(self, msg: ReconfigureMsg | LeaveMsg) -> None:
        """Reader thread: a reconfigure arrived while the main thread is in a step. Abort first,
        then interrupt: every reconfigure but a live swap's (:func:`severs`) severs the
        generation's group (gloo: sockets shut for reading; NCCL: communicators aborted), so a
        main thread blocked in a collective or on the device returns to Python; then SIGUSR1 -- a
        real signal, not ``interrupt_main``'s simulated one, so a main thread blocked in a system
        call (a sleep, a read of data) wakes with EINTR -- makes the handler raise
        :class:`PeerFailed` there.

        A recovery's reconfigure names the lost ranks: a sharded job's mesh groups without one
        are left open, and a :class:`~nonstop.train.settle.Settling` severs those of them that
        cannot complete (the rest are kept by the next generation). A second reconfigure in the
        same step severs everything.

        Why a re-plan severs too (found under a CPU load, an HSDP job): its peers leave at their
        boundary and a sharded job's peer *parks* its mesh groups there, keeping their sockets
        open for the next generation; a rank that had begun the next step waited in FSDP2's
        all-gather for that peer, which in turn waited in the next generation's rendezvous for it,
        until the stage timed out. Severing costs nothing kept: a rank that leaves mid-step makes
        no claim on its groups, so they are built again anyway."""
        if severs(msg) and self._sever is not None:
            left = self._sever(lost_ranks(msg) if self._settle_store is None else None)
            if left:
                self.settling = Settling(self._settling_store(msg.gen), left, lambda: self.in_step)
        if self._can_interrupt:
            signal.pthread_kill(self._main_ident, signal.SIGUSR1)

    def _on_leave(self, msg: LeaveMsg) -> None:
        """Reader thread: the coordinator plans generation ``msg.gen`` after a failure and
        asks the survivors to leave their step now, so that each reports what it rescued
        (:mod:`nonstop.train.rescue`) before the plan: one still in a step is severed and
        interrupted as a recovery's reconfigure would (a sharded job's groups without a lost rank
        settled); one between steps leaves before its next (``leave_gen``, read by
        :meth:`enter_step` and the loop). A leave for a generation this rank is in already is
        stale: ignored (one that cannot be read is dropped by the reader)."""
        gen = msg.gen
        if gen <= self._resume().gen:
            return
        self.leave_gen = gen  # before in_step is read: see enter_step
        if self.in_step:
            self._leave_step_now(msg)

    def leaving(self, generation: int) -> bool:
        """Main thread: whether the coordinator asked this rank, in ``generation``, to leave."""
        return self.leave_gen is not None and self.leave_gen > generation

    def post_settled(self, claims: Sequence[GroupClaim], gen: int | None = None) -> None:
        """Main thread, its step left: post the final sequence numbers of the mesh groups it
        parked open (:func:`nonstop.train.settle.post`), for peers a settling watches, through
        the store of the recovery that interrupted the step (or of generation ``gen``'s)."""
        if not claims:
            return
        store = self._settle_store if gen is None else self._settling_store(gen)
        if store is None:
            return
        try:
            post(store, claims)
        except ControlError as e:  # (a newer generation: its peers sever everything anyway)
            log.info("posting the groups' sequence numbers failed: %s", e)

    def _settling_store(self, gen: int) -> ChannelStore:
        """The store a recovery's settling posts go through: the one already open, or a new one
        for generation ``gen`` (its replies are delivered beside ``rdzv``'s)."""
        if self._settle_store is None:
            self._settle_store = ChannelStore(self.chan.send, gen, SETTLE_STORE_S)
        return self._settle_store

    def _on_interrupt(self, _signum: int, frame: FrameType | None) -> None:
        if self.in_step:  # outside train_step the loop sees the message between steps
            if _inside_no_raise(frame):
                # entering or leaving a step (Step.__enter__/__exit__): an exception raised here
                # would escape the step's handler. Deliver it again a moment later: inside the
                # step's body it raises; once the step is left, in_step is False. Not at once
                # (interrupt_main): that delivery comes inside this handler, whose frame is then
                # the one interrupted -- raised there, it left through Step.__exit__ and killed a
                # healthy survivor under load; re-delivered there, it recursed.
                self._redeliver_later()
                return
            self.in_step = False
            raise PeerFailed("a peer failed; abandoning this step")

    def _start_redelivery(self) -> None:
        """The thread that sends a deferred interrupt again (:meth:`_redeliver_later`), woken
        through a pipe. The handler only writes a byte to it: a thread started from inside the
        handler made the main thread wait in ``threading`` for it to start, and on a loaded
        machine the redelivery landed in that wait -- inside the handler, in a frame not marked
        -- and was raised there, out through the step's entry (found under a parallel test load)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._wake_fd = write_fd

        def loop() -> None:
            while True:
                try:
                    if not os.read(read_fd, 64):  # (wake-ups that came meanwhile: one redelivery)
                        return
                except OSError:
                    return
                time.sleep(REDELIVER_S)
                if self.in_step:
                    signal.pthread_kill(self._main_ident, signal.SIGUSR1)

        threading.Thread(target=loop, name="nonstop-redeliver", daemon=True).start()

    def _redeliver_later(self) -> None:
        """SIGUSR1 to the main thread again in :data:`REDELIVER_S`, if it is still in a step (from
        the handler: one non-blocking write, no lock, no thread started here)."""
        try:
            os.write(self._wake_fd, b"x")
        except OSError:  # (BlockingIOError: the pipe is full of wake-ups the thread has yet to read)
            pass

    # -- the heartbeat thread --------------------------------------------------------------
    def _heartbeat(self) -> None:
        interval = self.env.heartbeat_interval_s
        while not self.closing:
            self._dump_if_stuck()
            msg = self._heartbeat_msg()
            try:
                self.chan.send(msg.encode())
            except ControlError:
                if self.env.reconnect_s <= 0:
                    return  # the reader ends the process
            time.sleep(interval)

    def _dump_if_stuck(self) -> None:
        """Heartbeat thread: a reconfigure the main thread has not taken for STUCK_DUMP_S means it
        is stuck where an abort and an interrupt did not reach it (a collective, the device, a
        lock): write every thread's stack to stderr (the rank's log) once, for whoever
        investigates. The coordinator's stage timeout replaces the rank as before."""
        waiting = self._arrived > self._taken
        if not waiting:
            self._stuck_since = None
            return
        now = time.monotonic()
        if self._stuck_since is None:
            self._stuck_since = now
        elif now - self._stuck_since > STUCK_DUMP_S and not self._dumped:
            self._dumped = True
            log.warning("a reconfigure has waited %.0f s for the main thread; its stacks:", STUCK_DUMP_S)
            faulthandler.dump_traceback(all_threads=True)
            if self.in_step and self._sever is not None:  # (a live swap's, which did not sever)
                log.warning("severing the generation's group: the step cannot finish")
                self._sever(None)

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: Message) -> None:
        try:
            self.chan.send(msg)
        except ControlError:
            if self.env.reconnect_s <= 0:
                raise
            # store mode: the coordinator is restarting; the reconnect tells it where we are

    def subscribe(self, kinds: list[str] | None) -> None:
        """Ask the coordinator for the job's events of ``kinds`` (None: all), now and after
        every reconnect; they arrive through :attr:`on_feed`."""
        self._subscription = SubscribeMsg(kinds=None if kinds is None else tuple(kinds))
        self.send(self._subscription.encode())

    def send_quietly(self, msg: Message) -> None:
        """Send from a helper thread: a lost coordinator is the reader thread's business."""
        try:
            self.chan.send(msg)
        except ControlError:
            pass

    # -- the inbox (main thread) -----------------------------------------------------------
    def _take(self, msg: WorkerOrder | WireError) -> WorkerOrder:
        """An order out of the inbox; a malformed one raises its error here (the main thread)."""
        if isinstance(msg, WireError):
            raise msg
        if isinstance(msg, ReconfigureMsg):
            self._taken += 1
        return msg

    @uninterruptible
    def enter_step(self) -> None:
        """The main thread enters a step: from now on a recovery interrupts it. A reconfigure that
        arrived since the last poll (while no step ran, so nobody was interrupted) interrupts it
        at once: the step is not run to its end against a group that is being replaced. (The
        reader counts a reconfigure before it reads ``in_step``, this sets ``in_step`` before it
        reads the count: one of the two sees the other.)"""
        self.in_step = True
        left = self.leaving(self._resume().gen)
        if (self._arrived > self._taken or left) and self._can_interrupt:
            _thread.interrupt_main(signal.SIGUSR1)  # raised in the step's body (see uninterruptible)

    def wait_for(self, *kinds: type[Any]) -> WorkerOrder:
        """The next order of one of ``kinds`` (the classes); those that come first are noted
        (:meth:`_note`), and an abort raises :class:`~nonstop.errors.JobFailedError`."""
        while True:
            msg = self._take(self._inbox.get())
            if type(msg) in kinds:
                return msg
            self._note(msg)
            if isinstance(msg, AbortMsg):
                raise JobFailedError(
                    msg.error if msg.error is not None else "the coordinator aborted the job"
                )

    def await_abort(self, timeout_s: float) -> str | None:
        """Wait up to ``timeout_s`` for the coordinator's ``abort`` (after this process reported
        a mistake that fails the job: exiting first would look like a crash to recover from);
        its error line, or None when none came."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self._take(self._inbox.get(timeout=left))
            except queue.Empty:
                return None
            if isinstance(msg, AbortMsg):
                return msg.error if msg.error is not None else ""
        return None

    def _note(self, msg: WorkerOrder) -> None:
        """What a message between steps changes: a swap's pause, its end, the snapshot cadence."""
        if isinstance(msg, PauseMsg):
            self.pause_at = msg.at
        elif isinstance(msg, ContinueMsg):
            self.pause_at = None
        elif isinstance(msg, CadenceMsg) and self.on_cadence is not None:
            self.on_cadence(Cadence(every=msg.every, since=msg.since))

    def poll_reconfigure(self) -> ReconfigureMsg | None:
        """A reconfigure that arrived between steps, if any (newest wins)."""
        found = None
        while True:
            try:
                msg = self._take(self._inbox.get_nowait())
            except queue.Empty:
                return found
            if isinstance(msg, ReconfigureMsg):
                found = msg
            self._note(msg)
            if isinstance(msg, AbortMsg):
                raise JobFailedError(
                    msg.error if msg.error is not None else "the coordinator aborted the job"
                )

    # -- the rendezvous store --------------------------------------------------------------
    def open_rdzv(self, gen: int, timeout_s: float) -> ChannelStore:
        """A rendezvous store for generation ``gen`` over this connection (authenticated, fenced
        by generation, abortable): a generation that is already stale fails at once, since the
        coordinator refuses its keys. The reader delivers its replies until :meth:`drop_rdzv`."""
        store = ChannelStore(self.chan.send, gen, timeout_s)
        self.rdzv = store
        settle, self._settle_store, self.settling = self._settle_store, None, None
        if settle is not None:  # (its posts are read by the peers of the last generation only)
            settle.abort("the next generation's rendezvous started")
        return store

    def drop_rdzv(self, why: str) -> None:
        """Abort the generation's rendezvous store (a request blocked on it fails) and forget it."""
        if self.rdzv is not None:
            self.rdzv.abort(why)
            self.rdzv = None

    def close(self) -> None:
        """Stop the threads' work (the reader returns instead of reconnecting) and disconnect."""
        self.closing = True
        self.chan.close()
        wake_fd = getattr(self, "_wake_fd", None)
        if wake_fd is not None:
            self._wake_fd = -1  # (a late write fails quietly; the redelivery thread reads EOF)
            os.close(wake_fd)


_HANDLER = CoordinatorLink._on_interrupt.__code__  # the SIGUSR1 handler itself (see _on_interrupt)


def _inside_no_raise(frame: FrameType | None) -> bool:
    """Whether ``frame`` -- where an interrupt landed -- is, or is called from, a place where it
    may not raise: an ``@uninterruptible`` function (a helper it calls included) or the handler
    itself (a redelivery that came while the handler was still deferring the first one: raised
    there, it leaves through whatever the first one interrupted)."""
    while frame is not None:
        if frame.f_code in _NOT_HERE or frame.f_code is _HANDLER:
            return True
        frame = frame.f_back
    return False
