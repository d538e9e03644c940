"""A node agent's data path: inventories, replication, fetches, installs and persists.

:class:`NodeWork` carries out the commands of the coordinator that move snapshot
bytes (their messages are in :mod:`nonstop.protocol.agent`): ``inventory``,
``replicate``, ``install_durable``, ``forget``, ``committed``, ``fetch`` and
``persist``. The :class:`~nonstop.agent.node.NodeAgent` owns one, made once the
coordinator has welcomed the node, and hands it these commands with :meth:`NodeWork.submit`.

Threading: :meth:`NodeWork.start` starts four daemon threads, each serving its own
queue in order, so that slow work never delays urgent work:

* ``nonstop-agent-work``: inventories, durable installs and ``committed`` (one at a
  time, in arrival order);
* ``nonstop-agent-replicate``: replication rounds and ``forget`` (the replicator's
  state), on their own because a round to a holder that went silent (a partition: no
  reset, packets dropped) waits out its ack timeout, and a recovery's inventory or
  install must not wait behind it. A ``replicate`` that arrives while a round is in
  progress supersedes it: the coordinator runs one round at a time and starts another
  only once it has given up on the previous one (a node lost, a round failed), so the
  round in progress is abandoned at once (:meth:`Replicator.abandon`) and its remaining
  ranks are skipped, unanswered -- the committed step would otherwise wait out a silent
  holder's ack timeout;
* ``nonstop-agent-fetch``: fetches, on their own because a recovery or a swap waits
  on them; while idle it drops tracked bases unused for ``TRACK_TTL_S``;
* ``nonstop-agent-persist``: persist rounds (slow I/O), at the agent's own priority (a
  nice-19 thread held the agent's GIL while unscheduled: :mod:`nonstop.snapshot.persist`).

:meth:`NodeWork.stop` asks each thread to finish after what it has queued and returns
at once. A failing command is reported (or logged), never fatal to its thread. Replies
go out through ``send``, called from all four threads (the agent's ``_send``; the
control channel serialises frames).

Ownership: the snapshot memory belongs to the node's stores (``local`` and
``replica``, shared memory the agent owns and removes at its shutdown) and the
``replicator`` to the agent, which closes it. The tracked bases of catch-up fetches
(numpy buffers, kept between fetches of one migration) are used only by the fetch
thread; the persist encoders (:class:`~nonstop.snapshot.persist.RankEncoder`, with
their delta bases and scratch buffers) only by the persist thread, which closes them
when it stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from nonstop.agent.processes import Agent, ranks_with_segments
from nonstop.control.channel import Message
from nonstop.errors import NonstopError
from nonstop.protocol.agent import (
    DATA_COMMANDS,
    CommittedMsg,
    FetchedBytes,
    FetchedMsg,
    FetchRequestMsg,
    ForgetMsg,
    InstallDurableMsg,
    InstalledMsg,
    InventoryMsg,
    InventoryRequestMsg,
    PersistRanksMsg,
    RanksPersistedMsg,
    ReplicatedMsg,
    ReplicateMsg,
    decode_command,
    request_id,
)
from nonstop.protocol.base import kind_of
from nonstop.replica.dataplane import FETCH_SETTLE_S, DataPlane
from nonstop.replica.peer import (
    TRACK_TTL_S,
    Replicator,
    TrackedBase,
    TrackedBases,
    fetch,
    local_store_id,
    replica_store_id,
)
from nonstop.snapshot.codec import CodecConfig, preload
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.persist import RankEncoder
from nonstop.snapshot.store import RankSnapshotStore

__all__ = ["NodeWork"]

log = logging.getLogger(__name__)

SETTLE_S = 2.0  # longest an inventory waits for a live writer to finish its snapshot (or its part)


class NodeWork:
    """The data-path commands of one node, on four threads of their own (module docstring)."""

    COMMANDS = DATA_COMMANDS
    """The command kinds :meth:`submit` takes (:data:`nonstop.protocol.agent.DATA_COMMANDS`)."""

    def __init__(
        self,
        *,
        node: str,
        job_id: str,
        shm_dir: Path,
        secret: bytes,
        agent: Agent,
        data: DataPlane,
        local: Callable[[int], RankSnapshotStore],
        replica: Callable[[int], RankSnapshotStore],
        replicator: Replicator,
        send: Callable[[Message], None],
    ) -> None:
        self.node = node
        self.job_id = job_id
        self.shm_dir = shm_dir
        self.secret = secret
        self.agent = agent
        self.data = data
        self._local = local
        self._replica = replica
        self.replicator = replicator
        self._send = send
        self._work: queue.Queue[Message | None] = queue.Queue()
        self._persist_work: queue.Queue[Message | None] = queue.Queue()  # its own thread: slow I/O
        self._fetch_work: queue.Queue[Message | None] = queue.Queue()  # its own thread: on the critical path
        self._replicate_work: queue.Queue[Message | None] = queue.Queue()  # may wait on a silent peer
        self._rounds_queued = 0  # replicate commands submitted (dispatch thread)
        self._rounds_taken = 0  # ... and taken up by the replicate thread
        self._round_running = False
        self._encoders: dict[tuple[str, bool, int], RankEncoder] = {}
        self._tracks: TrackedBases[int] = TrackedBases()  # local rank slot -> base of its catch-up

    def start(self) -> None:
        threading.Thread(target=self._worker, name="nonstop-agent-work", daemon=True).start()
        threading.Thread(target=self._persister, name="nonstop-agent-persist", daemon=True).start()
        threading.Thread(target=self._fetcher, name="nonstop-agent-fetch", daemon=True).start()
        threading.Thread(target=self._replicate_worker, name="nonstop-agent-replicate", daemon=True).start()

    def submit(self, msg: Message) -> None:
        """Queue one command of :data:`COMMANDS` for its thread, as it came: each thread decodes
        its own (a command it cannot read is logged, or for a persist answered as failed, like
        any other failing command)."""
        t = kind_of(msg)
        if t == FetchRequestMsg.T:  # never behind a replication round: a recovery or a swap waits on it
            self._fetch_work.put(msg)
        elif t == PersistRanksMsg.T:
            self._persist_work.put(msg)
        elif t in (ReplicateMsg.T, ForgetMsg.T):  # never ahead of a recovery's inventory or install
            if t == ReplicateMsg.T:
                self._rounds_queued += 1
                if self._round_running:  # superseded (module docstring): stop waiting on it
                    self.replicator.abandon()
            self._replicate_work.put(msg)
        else:
            self._work.put(msg)

    def stop(self) -> None:
        """Tell the threads to end once their queues are drained; does not wait for them."""
        self._work.put(None)
        self._fetch_work.put(None)
        self._replicate_work.put(None)
        self._persist_work.put(None)

    # -- the threads (one for inventories, replication and installs; fetches and persists on their own)
    def _fetcher(self) -> None:
        while True:
            try:
                msg = self._fetch_work.get(timeout=TRACK_TTL_S / 4)
            except queue.Empty:
                self._tracks.expire()  # an aborted migration's bases go even if no fetch comes
                continue
            if msg is None:
                return
            try:
                self._fetch(msg)
            except Exception as e:  # report, never die: the coordinator decides
                log.warning("node %s: fetch failed: %s", self.node, e)

    def _worker(self) -> None:
        while True:
            msg = self._work.get()
            if msg is None:
                return
            try:
                cmd = decode_command(msg)
                if isinstance(cmd, InventoryRequestMsg):
                    self._send(self._inventory(cmd.id))
                elif isinstance(cmd, InstallDurableMsg):
                    self._install_durable(cmd)
                elif isinstance(cmd, CommittedMsg):
                    self._keep(cmd.step)
            except Exception as e:  # report, never die: the coordinator decides
                log.warning("node %s: %s failed: %s", self.node, kind_of(msg), e)

    def _replicate_worker(self) -> None:
        preload()
        while True:
            msg = self._replicate_work.get()
            if msg is None:
                return
            try:
                if kind_of(msg) == ReplicateMsg.T:
                    self._replicate(msg)
                else:
                    self.replicator.forget(ForgetMsg.decode(msg).rank)
            except Exception as e:  # report, never die: the coordinator decides
                log.warning("node %s: %s failed: %s", self.node, kind_of(msg), e)

    def _persister(self) -> None:
        """Writes this node's ranks of a persist round (module docstring of
        :mod:`nonstop.coordinator.persistence`); at the agent's priority, like the single-node
        Persister (no nice 19: its module docstring)."""
        while True:
            msg = self._persist_work.get()
            if msg is None:
                break
            try:
                self._send(self._persist(PersistRanksMsg.decode(msg)).encode())
            except Exception as e:  # report, never die: the coordinator fails the round
                log.warning("node %s: persist failed: %s", self.node, e)
                self._send(RanksPersistedMsg(id=request_id(msg), ok=False, error=str(e)[:300]).encode())
        for enc in self._encoders.values():
            enc.close()

    def _persist(self, cmd: PersistRanksMsg) -> RanksPersistedMsg:
        step, ranks = cmd.step, list(cmd.ranks)
        lossy, bits = cmd.lossy, cmd.lossy_bits
        key = (cmd.url, lossy, bits)
        enc = self._encoders.get(key)
        if enc is None:
            enc = self._encoders[key] = RankEncoder(CodecConfig(lossy=lossy, lossy_bits=bits))
        enc.forget_others(set(ranks))
        t0 = time.monotonic()
        snaps = [self._local(r).copy_out(step, out=enc.scratch(r)) for r in ranks]
        durable = DurableStore(key[0])
        writer = durable.contribute(step, cmd.world_size, enc.codec.describe())
        try:
            raw, stored, full = enc.write(writer, snaps)
        except BaseException:
            enc.reset()  # a base may be what went wrong: the next write is full
            writer.abort()
            raise
        return RanksPersistedMsg(
            id=cmd.id,
            ok=True,
            records=tuple(writer.record(r) for r in ranks),
            raw=raw,
            stored=stored,
            full=full,
            seconds=time.monotonic() - t0,
        )

    def _keep(self, step: int | None) -> None:
        """Hold the replicated (committed) step in this node's memory, its ranks' and its replicas';
        release older holds. Until a newer round commits, every rank can return to it."""
        steps = set() if step is None else {step}
        local = local_store_id(self.job_id, self.node)
        for rank in ranks_with_segments(self.shm_dir, local):
            self._local(rank).keep_only(steps)
        for rank in ranks_with_segments(self.shm_dir, replica_store_id(self.job_id, self.node)):
            self._replica(rank).keep_only(steps)

    def _inventory(self, req_id: int) -> Message:
        """The answer to inventory request ``req_id``, encoded: what this node's memory holds."""
        deadline = time.monotonic() + SETTLE_S
        while self.agent.unsettled() and time.monotonic() < deadline:
            time.sleep(0.002)
        local = self.agent.complete_steps()
        rep_id = replica_store_id(self.job_id, self.node)
        replicas = {r: self._replica(r).complete_steps() for r in ranks_with_segments(self.shm_dir, rep_id)}
        return InventoryMsg(
            id=req_id,
            local={r: tuple(s) for r, s in local.items() if s},
            replicas={r: tuple(s) for r, s in replicas.items() if s},
        ).encode()

    def _replicate(self, msg: Message) -> None:
        """One replication round (``msg``: the ``replicate`` command as it came)."""
        cmd = ReplicateMsg.decode(msg)
        self._rounds_taken += 1
        mine = self._rounds_taken
        self._round_running = True
        try:
            self._replicate_ranks(cmd.step, cmd.ranks, superseded=lambda: self._rounds_queued > mine)
        finally:
            self._round_running = False

    def _replicate_ranks(
        self, step: int, ranks: Mapping[int, tuple[str, ...]], *, superseded: Callable[[], bool]
    ) -> None:
        for rank, holders in ranks.items():
            if superseded():
                log.info("node %s: replication of step %d superseded by a newer round", self.node, step)
                return
            try:
                st = self.replicator.replicate(rank, step, list(holders))
                done = ReplicatedMsg(
                    step=step, rank=rank, ok=True, raw=st.raw_bytes, wire=st.wire_bytes, seconds=st.seconds,
                    full=st.full,
                )  # fmt: skip
                self._send(done.encode())
            except (NonstopError, OSError) as e:
                if superseded():  # abandoned: the coordinator expects nothing of this round
                    return
                self._send(ReplicatedMsg(step=step, rank=rank, ok=False, error=str(e)[:300]).encode())

    def _fetch(self, msg: Message) -> None:
        """Copy a rank's snapshot into this node's slots of ``as_rank`` (from its own stores, or
        from a peer). ``track``: keep the data as the base of a catch-up; ``base``: the step of
        the kept base the peer may send a delta against (see :mod:`nonstop.replica.peer`)."""
        cmd = FetchRequestMsg.decode(msg)
        rank, step, kind, addr = cmd.rank, cmd.step, cmd.kind, cmd.addr
        dest = cmd.dest  # a world-size change: another rank number here
        into = self._replica if cmd.into == "replica" else self._local  # replica: to reshard
        track, want = cmd.track, cmd.base
        t0 = time.monotonic()
        held = self._tracks.take(dest)
        if held is not None and held.source != (addr, rank, kind):
            held = None
        moved: FetchedBytes | None = None
        try:
            if addr == self.data.addr:  # this node holds it: copy between its own stores
                src = self._replica(rank) if kind == "replica" else self._local(rank)
                snap = src.copy_out(step, settle_s=FETCH_SETTLE_S)
                into(dest).write_raw(step, snap.meta, snap.data.data)
                moved = FetchedBytes(raw_bytes=len(snap.data), wire_bytes=0, delta=False)
            else:
                base = (held.step, held.data) if held is not None and want == held.step else None
                got = fetch(
                    addr,
                    self.secret,
                    node=self.node,
                    rank=rank,
                    step=step,
                    kind=kind,
                    base=base,
                    track=track,
                    out=held.spare if held is not None and track else None,
                )
                into(dest).write_raw(step, got.meta, got.data)
                moved = FetchedBytes(
                    raw_bytes=len(got.data),
                    wire_bytes=got.wire_bytes,
                    delta=got.base is not None,
                    capped=got.capped,
                )
                if track:
                    data = np.frombuffer(got.data, dtype=np.uint8)
                    spare = held.data if held is not None else None
                    self._tracks.put(dest, TrackedBase(step, data, spare, source=(addr, rank, kind)))
            done = FetchedMsg(id=cmd.id, rank=rank, ok=True, seconds=time.monotonic() - t0, moved=moved)
            self._send(done.encode())
        except Exception as e:  # whatever failed, the coordinator hears of it (it waits on this fetch)
            error = f"{type(e).__name__}: {e}"[:300]
            self._send(FetchedMsg(id=cmd.id, rank=rank, ok=False, error=error, moved=moved).encode())

    def _install_durable(self, cmd: InstallDurableMsg) -> None:
        step = cmd.step
        t0 = time.monotonic()
        try:
            durable = DurableStore(cmd.url)
            for rank in cmd.ranks:
                meta, data = durable.load_rank(step, cmd.sources.get(rank, rank))
                self._local(rank).write_raw(step, meta, data)
            self._send(InstalledMsg(id=cmd.id, ok=True, seconds=time.monotonic() - t0).encode())
        except Exception as e:  # whatever failed, the coordinator hears of it
            self._send(InstalledMsg(id=cmd.id, ok=False, error=f"{type(e).__name__}: {e}"[:300]).encode())
