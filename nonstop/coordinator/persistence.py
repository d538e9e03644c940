"""Durable persistence of a job spread over several nodes, driven by the coordinator.

No node holds the whole job's memory, so no node can write a checkpoint alone. A
**persist round** of step ``S`` (the committed step, which every node keeps in memory
until a newer round of replication commits):

1. the coordinator opens checkpoint ``S`` (:meth:`DurableStore.begin`: clears leftovers);
2. it sends each live node ``persist {id, step, url, ranks}`` for the ranks it plays;
3. each node encodes those ranks (delta against its own last FULL copy of the rank, see
   :class:`~nonstop.snapshot.persist.RankEncoder`) into its own rank files
   (:meth:`DurableStore.contribute`) on a background thread, and answers
   ``persisted {id, ok, records}`` with each rank's manifest entry;
4. the coordinator adopts every entry (validated, file sizes checked) and commits: the
   manifest, then ``latest``, then retention. Until then the checkpoint does not exist.

A round fails as a whole (nothing committed, its directory removed) when a node answers
with an error, is lost, or the round outlives ``timeout_s``; the next round is retried a
moment later. Rounds are sequential. Late answers of an ended round are ignored (by id).

The durable URL must name storage every node reaches (a shared file system or an object
store): nodes write their own files there.

The ticket interface (:meth:`request`, :meth:`wait`, :attr:`last`, :attr:`last_error`,
:attr:`durable`) is :class:`~nonstop.snapshot.persist.Persister`'s, so ``nonstop persist``
is served the same way on one node or many. Not thread-safe: the coordinator's loop only.

:class:`PersistOps` is the coordinator's operation over the rounds: it starts the next round
when one is due, watches the one in flight, and makes the final step durable before the nodes
are released -- :meth:`PersistOps.final_tick` starts the final persist and watches it, turn by
turn of the coordinator's loop, like any other operation.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nonstop.control.channel import Message
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.errors import NonstopError
from nonstop.events import Event, Persist, PersistFailed
from nonstop.policy.phase import Busy, JobPhase, Op
from nonstop.protocol.agent import PersistRanksMsg, RanksPersistedMsg
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import CheckpointWriter, DurableStore
from nonstop.snapshot.persist import PersistResult

if TYPE_CHECKING:
    from nonstop.coordinator.job import JobLife
    from nonstop.coordinator.peers import PersistAnswers, UnderWay
    from nonstop.coordinator.view import JobView

__all__ = ["ClusterPersister", "PersistOps", "PersistRound"]

log = logging.getLogger(__name__)

RETRY_S = 0.5  # after a failed round


@dataclass
class PersistRound:
    """One round in flight: step ``step`` of every rank, written by the nodes in ``pending``."""

    id: int
    step: int
    writer: CheckpointWriter
    pending: set[str]
    started: float
    tickets: int  # requests made before this round started (it serves them)
    raw: int = 0
    stored: int = 0
    full: bool = False
    nodes: dict[str, list[int]] = field(default_factory=dict)


class ClusterPersister:
    """Persist rounds across nodes (see the module docstring).

    ``emit(event)`` writes a typed event to the log; the coordinator :meth:`attach` es the way
    to reach a node's agent before the first round."""

    def __init__(
        self,
        *,
        durable: DurableStore,
        codec: CodecConfig,
        every: int,
        timeout_s: float,
        emit: Callable[[Event], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        if every < 0:
            raise ValueError("every must be >= 0 (0: only on demand)")
        self.durable = durable
        self.codec = codec
        self.every = every
        self.timeout_s = timeout_s
        self._send: Callable[[str, Message], bool] = lambda _node, _msg: False
        self._emit = emit
        self._ids = itertools.count(1)
        self.round: PersistRound | None = None
        self._requested = 0
        self._served = 0
        self._retry_at = 0.0
        self.last: PersistResult | None = None
        self.last_error: str | None = None
        self.last_step: int | None = durable.latest_step() if durable.steps() else None

    def attach(self, send: Callable[[str, Message], bool]) -> None:
        """``send(node, msg)`` delivers a message to a node's agent (False: it is gone)."""
        self._send = send

    # -- the Persister ticket interface ------------------------------------------------------
    def request(self) -> int:
        """Ask for a persist of the newest committed step; returns a ticket for :meth:`wait`."""
        self._requested += 1
        return self._requested

    def wait(self, ticket: int, timeout: float) -> bool:
        """True once a round that started after ``ticket`` was asked has ended (or nothing was
        left to persist). Never blocks: the coordinator's loop drives the rounds."""
        del timeout
        return self._served >= ticket

    # -- driving -------------------------------------------------------------------------------
    def wanted(self, committed: int | None) -> bool:
        """Whether a round of ``committed`` should start now."""
        if self.round is not None or committed is None or self.clock.monotonic() < self._retry_at:
            return False
        if self.last_step is not None and committed <= self.last_step:
            self._served = self._requested  # nothing newer to persist: requests are answered
            return False
        if self._requested > self._served:
            return True
        return self.every > 0 and committed >= (self.last_step or 0) + self.every

    def start(self, step: int, placement: dict[str, list[int]]) -> bool:
        """Open checkpoint ``step`` and ask each node of ``placement`` (node -> its ranks) for
        its ranks. False (and the error recorded) when the checkpoint cannot be opened."""
        tickets = self._requested
        # the ranks playing now: fewer than the job's full size while an elastic job is shrunk
        world_size = len({r for ranks in placement.values() for r in ranks})
        try:
            writer = self.durable.begin(step, world_size, self.codec.describe())
        except (NonstopError, OSError, ValueError) as e:  # ValueError: e.g. step already committed
            self._failed(f"cannot open checkpoint step {step}: {e}", tickets)
            return False
        rd = PersistRound(
            id=next(self._ids),
            step=step,
            writer=writer,
            pending=set(placement),
            started=self.clock.monotonic(),
            tickets=tickets,
            nodes={n: sorted(r) for n, r in placement.items()},
        )
        self.round = rd
        for node, ranks in rd.nodes.items():
            ask = PersistRanksMsg(
                id=rd.id,
                step=step,
                url=self.durable.url,
                world_size=world_size,
                ranks=tuple(ranks),
                lossy=self.codec.lossy,
                lossy_bits=self.codec.lossy_bits,
            )
            if not self._send(node, ask.encode()):
                self.abort(f"node {node} is gone")
                return False
        return True

    def on_reply(self, node: str, msg: Mapping[str, Any]) -> None:
        """A node's ``persisted`` answer, as it came (:class:`RanksPersistedMsg`; a malformed one
        raises :class:`~nonstop.protocol.base.WireError`: its node broke the protocol)."""
        rd = self.round
        if rd is None:
            return
        reply = RanksPersistedMsg.decode(msg)
        if reply.id != rd.id or node not in rd.pending:
            return
        if not reply.ok:
            self.abort(f"node {node}: {reply.error}")
            return
        try:
            adopted = {rd.writer.adopt(doc) for doc in reply.records}
        except (NonstopError, OSError, TypeError, ValueError) as e:
            self.abort(f"node {node}: {e}")
            return
        if adopted != set(rd.nodes[node]):
            self.abort(f"node {node} wrote ranks {sorted(adopted)}, not {rd.nodes[node]}")
            return
        rd.pending.discard(node)
        rd.raw += reply.raw
        rd.stored += reply.stored
        rd.full = rd.full or reply.full
        if not rd.pending:
            self._commit(rd)

    def check(self, alive: set[str]) -> None:
        """End the round when one of its nodes is lost or it outlived ``timeout_s``."""
        rd = self.round
        if rd is None:
            return
        lost = sorted(rd.pending - alive)
        if lost:
            self.abort(f"node(s) {', '.join(lost)} lost during the persist")
        elif self.clock.monotonic() - rd.started > self.timeout_s:
            self.abort(f"no answer from node(s) {', '.join(sorted(rd.pending))} in {self.timeout_s:g}s")

    def abort(self, why: str) -> None:
        """Fail the round in flight (if any): nothing of it is committed."""
        rd = self.round
        if rd is None:
            return
        self.round = None
        try:
            rd.writer.abort()
        except (NonstopError, OSError) as e:
            log.warning("removing the aborted checkpoint step %d: %s", rd.step, e)
        self._failed(f"step {rd.step}: {why}", rd.tickets)

    # -- internals -----------------------------------------------------------------------------
    def _commit(self, rd: PersistRound) -> None:
        try:
            rd.writer.commit()
        except (NonstopError, OSError, ValueError) as e:  # ValueError: the writer refused (misuse)
            self.abort(f"committing it: {e}")  # still the round in flight
            return
        self.round = None
        seconds = self.clock.monotonic() - rd.started
        self.last_step = rd.step
        self.last = PersistResult(
            step=rd.step, raw_bytes=rd.raw, stored_bytes=rd.stored, seconds=seconds, full=rd.full
        )
        self.last_error = None
        self._served = max(self._served, rd.tickets)
        self._emit(
            Persist(
                step=rd.step,
                raw_bytes=rd.raw,
                stored_bytes=rd.stored,
                seconds=round(seconds, 4),
                full=rd.full,
                url=self.durable.url,
                nodes=sorted(rd.nodes),
            )
        )

    def _failed(self, error: str, tickets: int) -> None:
        self.last_error = error
        self._served = max(self._served, tickets)
        self._retry_at = self.clock.monotonic() + RETRY_S
        log.warning("persist failed: %s", error)
        self._emit(PersistFailed(error=error))


class PersistOps:
    """Persist rounds as the job runs and as it ends (see the module docstring)."""

    def __init__(
        self,
        *,
        view: JobView,
        life: JobLife,
        rounds: ClusterPersister | None,
        timeout_s: float,
        store: UnderWay,
        clients: PersistAnswers,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view = view
        self.life = life
        self.rounds = rounds
        self.timeout_s = timeout_s  # --persist-timeout: the final persist waits at most this long
        self.store = store
        self.clients = clients
        self._final_step: int | None = None  # the final persist's step, once started
        self._final_deadline = 0.0
        self._final_over = False

    def tick(self) -> None:
        """Check the persist round in flight; start the next one when due (RUNNING only)."""
        rounds = self.rounds
        if rounds is None or Busy.RESYNCING in self.store.busy():
            return
        rounds.check(set(self.view.alive_nodes()))
        if self.life.may_start(Op.PERSIST) and len(self.view.latest_step) == self.view.world_size:
            if rounds.wanted(self.life.committed()):
                rounds.start(self.life.committed(), self.view.placement())

    def final_tick(self) -> bool:
        """After the job ended, before the nodes are released: make the newest step every rank
        holds durable (the final step of a finished job, else the committed step), waiting at
        most ``persist_timeout_s``. Called once per loop turn; True once nothing is left to wait
        for (persisted, failed, timed out, or nothing to persist)."""
        rounds = self.rounds
        if self._final_over:
            return True
        if self._final_step is None:
            step = self._start_final()
            if step is None:
                return self._end_final()
            self._final_step = step
            self._final_deadline = self.clock.monotonic() + self.timeout_s
        assert rounds is not None
        rounds.check(set(self.view.alive_nodes()))
        if rounds.round is not None and self.clock.monotonic() < self._final_deadline:
            return False
        if rounds.round is not None:
            rounds.abort(f"the final persist did not finish in {self.timeout_s:g}s")
        if rounds.last_step != self._final_step:
            log.warning("final persist of step %d failed: %s", self._final_step, rounds.last_error)
        return self._end_final()

    def _start_final(self) -> int | None:
        """Start the final persist round; its step, or None when there is nothing to persist."""
        rounds = self.rounds
        if rounds is None or len(self.view.latest_step) < self.view.world_size:
            return None
        if any(not self.view.nodes[n].alive for n in self.view.placement()):
            return None  # a rank's memory is gone with its node: the last committed checkpoint stands
        step = (
            min(self.view.latest_step.values()) if self.view.phase is JobPhase.DONE else self.life.committed()
        )
        if rounds.round is not None and rounds.round.step != step:
            rounds.abort(f"superseded by the final persist of step {step}")
        if rounds.round is None and rounds.last_step != step:
            rounds.request()
            rounds.start(step, self.view.placement())
        return step

    def _end_final(self) -> bool:
        self._final_over = True
        self.clients.answer_persists()
        return True
