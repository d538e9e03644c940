"""A node's data-plane listener, the holder side of :mod:`nonstop.replica.peer`'s protocol.

:class:`DataPlane` authenticates peers (``purpose="data"``), installs the replicas they send
(``rep`` + chunks, checked before anything is installed) into this node's replica slots (a split
snapshot's own part there, and the shared write it refers to, ``rep_shared``, beside them once
per step -- or, when this node's own ranks wrote the same shared write (a DDP job's, an HSDP
twin's), copied from its own memory instead), and serves fetches of its own ranks' or its
replicas' snapshots -- raw, or a delta against the base a tracked fetch kept (a migration's
catch-up).
:func:`shm_stores` is the cached ``rank -> RankSnapshotStore`` factory both sides use over a
store id.

Threading: one dispatcher thread serves the listener's events in order (replica stores are written
by it alone); each fetch is answered on a thread of its own, so a slow requester never holds an
install.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.control.channel import Channel, Message
from nonstop.control.listener import ControlServer
from nonstop.errors import ControlError, SnapshotError, SnapshotMissingError
from nonstop.protocol.base import kind_of
from nonstop.protocol.dataplane import FetchBeginMsg, FetchMsg, RepAckMsg, RepMsg, RepSharedMsg
from nonstop.replica.peer import (
    RAW_CODEC,
    REPLICA_SLOTS,
    FetchError,
    TrackedBase,
    TrackedBases,
    _Bucket,
    _recv_snapshot,
    _send_chunks,
)
from nonstop.snapshot.codec import CodecConfig, Encoder, segments_for
from nonstop.snapshot.nodecopy import MAX_COPY_GROUPS, NodeCopy, SharedRef, node_slots
from nonstop.snapshot.split import REF_HEAD, ref_of
from nonstop.snapshot.store import RankSnapshotStore

__all__ = ["FETCH_SETTLE_S", "DataPlane", "shm_stores"]

# how long a fetch's source looks again for a step it lacks or that a write tore: the rank may be
# rewriting that step (starting its slots over after a renumbering) -- a fetch failure fails the
# reconfiguration that waits on it
FETCH_SETTLE_S = 2.0

log = logging.getLogger(__name__)


class DataPlane:
    """A node's listener for peers: stores replicas it receives, serves snapshots on request.

    ``local(rank)`` and ``replica(rank)`` give the node's own and replica slot
    stores. Runs one dispatcher thread; a fetch is served on its own thread.
    ``codec`` encodes the deltas of tracked fetches (catch-up); ``bandwidth_bytes_s``
    caps what tracked fetches send (they run while the job trains; a fetch a recovery
    or a swap waits on is never held back) and they say so (``capped``).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        secret: bytes,
        local: Callable[[int], RankSnapshotStore],
        replica: Callable[[int], RankSnapshotStore],
        on_refused: Callable[[str, str], None] | None = None,
        codec: CodecConfig | None = None,
        bandwidth_bytes_s: float | None = None,
    ) -> None:
        self._local = local
        self._replica = replica
        self._codec = codec or CodecConfig()
        self._bucket = _Bucket(bandwidth_bytes_s)
        self._sent: TrackedBases[tuple[str, int, str]] = TrackedBases()
        self._server = ControlServer(
            host=host, port=port, secret=secret, on_refused=on_refused, purpose="data"
        )
        self.address = self._server.address
        self._partial: dict[Channel, tuple[RepMsg | RepSharedMsg, list[Message]]] = {}
        self._nodes: dict[int, NodeCopy] = {}  # the shared writes held for other nodes, by copy group
        self._twin_scratch: np.ndarray | None = None
        self.twin_bytes = 0  # shared writes held from this node's own ranks' instead of the wire
        self._stop = threading.Event()
        self._lock = threading.Lock()  # replica stores are written by the dispatcher only
        self._thread = threading.Thread(target=self._loop, name="nonstop-dataplane", daemon=True)
        self._thread.start()

    @property
    def addr(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                kind, chan, msg = self._server.events.get(timeout=0.1)
            except queue.Empty:
                self._sent.expire()  # an aborted migration's bases expire even if no fetch comes
                continue
            if kind == "close":
                self._partial.pop(chan, None)
                continue
            if kind != "msg" or msg is None:
                continue
            try:
                self._on_message(chan, msg)
            except Exception as e:  # a bad peer message must not kill the data plane
                log.warning("data plane: dropping %s after %s", chan.peer, e)
                self._partial.pop(chan, None)
                try:
                    chan.send(RepAckMsg(ok=False, error=str(e)[:300]).encode())
                except ControlError:
                    pass

    def _on_message(self, chan: Channel, msg: Message) -> None:
        t = kind_of(msg)
        if t in ("rep", "rep_shared"):
            head = RepMsg.decode(msg) if t == "rep" else RepSharedMsg.decode(msg)
            if head.nchunks == 0:
                self._received(chan, head, [])
            else:
                self._partial[chan] = (head, [])
        elif t == "chunk":
            got = self._partial.get(chan)
            if got is None:
                raise FetchError("chunk without a rep header")
            got[1].append(msg)  # its BLOB views a buffer of its own (one per received frame)
            if len(got[1]) == got[0].nchunks:
                del self._partial[chan]
                self._received(chan, got[0], got[1])
        elif t == "fetch":
            threading.Thread(target=self._serve_fetch, args=(chan, msg), daemon=True).start()
        else:
            raise FetchError(f"unknown data-plane message {t!r}")

    def _received(self, chan: Channel, head: RepMsg | RepSharedMsg, chunks: list[Message]) -> None:
        if isinstance(head, RepSharedMsg):
            self._install_shared(chan, head, chunks)
        else:
            self._install(chan, head, chunks)

    def _replica_node(self, store: RankSnapshotStore, group: int) -> NodeCopy:
        """The shared writes of copy ``group`` this node holds for other nodes' ranks (beside
        their replicas)."""
        node = self._nodes.get(group)
        if node is None:
            if group < 0 or len(self._nodes) >= MAX_COPY_GROUPS:
                raise FetchError(f"copy group {group}: a holder keeps at most {MAX_COPY_GROUPS} groups, >= 0")
            node = NodeCopy(
                shm_dir=store.shm_dir, job_id=store.store_id, num_slots=node_slots(REPLICA_SLOTS), group=group
            )
            self._nodes[group] = node
        return node

    def _install_shared(self, chan: Channel, head: RepSharedMsg, chunks: list[Message]) -> None:
        gen, step, key = head.gen, head.step, head.key
        group = head.group
        node = self._replica_node(self._replica(0), group)
        base_data = None
        if head.base is not None:
            b_gen, b_step = head.base
            base_data = node.copy_data(SharedRef(b_gen, b_step, 0, group))
            if base_data is None:
                _ask_whole(chan, "base not held")
                return
        got = _decode(chan, head, chunks, base_data)
        if got is None:
            return
        data = got[1]
        with self._lock:
            if not node.install(gen=gen, step=step, key=key, data=data):
                raise FetchError(f"no slot free for step {step}'s shared write")
        chan.send(RepAckMsg(ok=True, step=step).encode())

    def _install(self, chan: Channel, head: RepMsg, chunks: list[Message]) -> None:
        rank, step = head.rank, head.step
        store = self._replica(rank)
        ref = ref_of(bytes(head.blob[:REF_HEAD]))
        if ref is not None and self._replica_node(store, ref.group).find(ref) is None:
            if not self._from_twin(store, ref, head.key):
                chan.send(RepAckMsg(ok=False, need_shared=True, error="shared write not held").encode())
                return
        base_data = None
        if head.base is not None:
            try:
                base_data = store.copy_out(head.base, split=ref is not None).data
            except SnapshotMissingError:
                _ask_whole(chan, "base not held")
                return
        got = _decode(chan, head, chunks, base_data)
        if got is None:
            return
        meta, data = got
        with self._lock:
            store.write_raw(step, meta, data)
        chan.send(RepAckMsg(ok=True, rank=rank, step=step).encode())

    def _from_twin(self, store: RankSnapshotStore, ref: SharedRef, key: object) -> bool:
        """Hold the shared write ``ref`` (layout ``key``) of another node's rank by copying this
        node's own write of it, when its ranks wrote the same one: a DDP job's ranks, and an HSDP
        job's replica groups' shards, are bitwise alike, so this node's write of (generation,
        step, copy group) in the same layout is those bytes, and they need not travel. False when
        it has none."""
        if not isinstance(key, str):
            return False
        own = self._local(0).node_copy(ref.group)
        if own.key_of(ref) != key:
            return False
        data = own.copy_data(ref, out=self._twin_scratch)
        if data is None:
            return False  # overwritten since: the sender sends it
        if self._twin_scratch is None or self._twin_scratch.size < data.size:
            self._twin_scratch = data
        with self._lock:
            held = self._replica_node(store, ref.group).install(
                gen=ref.gen, step=ref.step, key=key, data=data
            )
        if held:
            self.twin_bytes += len(data)
        return held

    def _serve_fetch(self, chan: Channel, msg: Message) -> None:
        """Answer one fetch; whatever goes wrong -- a missing step, a malformed request (a
        :class:`~nonstop.protocol.base.WireError`), a bug -- the requester gets a ``fetch_begin``
        with ``error`` (it never waits for nothing)."""
        try:
            self._answer_fetch(chan, FetchMsg.decode(msg))
        except Exception as e:
            log.warning("data plane: fetch from %s failed: %s: %s", chan.peer, type(e).__name__, e)
            try:
                chan.send(FetchBeginMsg.failed(f"{type(e).__name__}: {e}"[:300]).encode())
            except ControlError:
                pass

    def _answer_fetch(self, chan: Channel, msg: FetchMsg) -> None:
        rank, step, kind = msg.rank, msg.step, msg.kind
        if kind not in ("replica", "local"):
            raise FetchError(f"unknown snapshot kind {kind!r}")
        track, want = msg.track, msg.base
        key = (msg.node, rank, kind)
        prev = self._sent.take(key)
        try:
            store = self._replica(rank) if kind == "replica" else self._local(rank)
            snap = store.copy_out(
                step, out=prev.spare if prev is not None and track else None, settle_s=FETCH_SETTLE_S
            )
            base, base_step = None, None
            if prev is not None and want is not None and int(want) == prev.step:
                if prev.data.size == snap.data.size:  # the same layout: a delta applies
                    base, base_step = prev.data, prev.step
            with Encoder(self._codec if base is not None else RAW_CODEC) as enc:
                chunks = enc.encode(snap.data, segments_for(snap.entries(), len(snap.data)), base)
            capped = track and bool(self._bucket.rate)
            head = FetchBeginMsg(data_len=len(snap.data), nchunks=len(chunks), base=base_step, capped=capped)
            if track:  # kept before the requester can see the step: its next fetch may ask for a delta
                spare = prev.data if prev is not None else None
                self._sent.put(key, TrackedBase(step=step, data=snap.data, spare=spare))
            chan.send(head.encode(), snap.meta)
            _send_chunks(chan, chunks, self._bucket if capped else lambda n: None)
        except (SnapshotError, ControlError, OSError) as e:
            try:
                chan.send(FetchBeginMsg.failed(str(e)[:300]).encode())
            except ControlError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(timeout=2.0)
        for node in self._nodes.values():
            node.close()


def _ask_whole(chan: Channel, why: str) -> None:
    """Answer a replica sent as a delta: install nothing, send it whole instead."""
    chan.send(RepAckMsg(ok=False, need_full=True, error=why).encode())


def _decode(
    chan: Channel, head: RepMsg | RepSharedMsg, chunks: list[Message], base: Any
) -> tuple[bytes, Any] | None:
    """(meta, data) that ``head`` and its ``chunks`` carry, decoded against ``base`` (None: sent
    whole). A delta that does not decode against this node's copy of its base (one that differs
    from the sender's) installs nothing: None, and the sender is asked for the whole."""
    it = iter(chunks)
    try:
        return _recv_snapshot(head, lambda: next(it), base)
    except SnapshotError as e:
        if base is None:
            raise
        _ask_whole(chan, f"delta rejected: {e}")
        return None


def shm_stores(shm_dir: Path, store_id: str, num_slots: int) -> Callable[[int], RankSnapshotStore]:
    """A cached ``rank -> RankSnapshotStore`` factory over one store id."""
    cache: dict[int, RankSnapshotStore] = {}
    lock = threading.Lock()

    def get(rank: int) -> RankSnapshotStore:
        with lock:
            s = cache.get(rank)
            if s is None:
                s = cache[rank] = RankSnapshotStore(
                    shm_dir=shm_dir, job_id=store_id, rank=rank, num_slots=num_slots
                )
            return s

    return get
