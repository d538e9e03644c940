"""The node-to-node data plane: replicas in, snapshots out.

Messages on a peer channel (all authenticated by :mod:`nonstop.control.channel`):

* ``rep`` (sender -> holder): one rank's snapshot of one step. The first frame
  carries ``rank, step, base, data_len, nchunks`` and the meta as its blob; then
  ``nchunks`` ``chunk`` frames, each a :class:`ChunkInfo` and its payload. The
  holder decodes against its copy of ``base`` (a delta) or alone (``base`` is
  null), verifies every chunk's CRC-32C, installs the step in its replica slots
  and answers ``rep_ack`` (``ok``, or ``need_full`` when it lacks the base).
  A snapshot split with its node's shared write (:mod:`nonstop.snapshot.nodecopy`) goes as the
  rank's own part (its meta names the shared write, ``key`` its layout); a holder that does not
  hold that shared write yet takes it from its own ranks' shared writes when one of them is the
  same (generation, step, copy group, layout: every DDP node's; an HSDP twin's), else
  answers ``need_shared`` and installs nothing.
* ``rep_shared`` (sender -> holder): a node's shared write of one step, ``gen, step, key, group,
  base, data_len, nchunks`` and the chunks (``group``: its copy group, 0 when left out; ``base``:
  the [gen, step] it is a delta against), sent once per holder, group and step, whichever of the
  node's ranks met ``need_shared`` first; then that rank's own part again. So a node of N ranks
  sends the state they hold alike once per copy group, not N times.
* ``fetch`` (a node restoring a rank -> the node holding it): ``rank, step, kind``
  and, for a catch-up, ``node`` (the requester), ``base`` and ``track``. The holder
  answers ``fetch_begin`` (meta as blob, ``data_len, nchunks, base, capped``, or ``error``)
  and the chunks, checksummed like any chunk: raw, or -- when ``base`` names the step
  it last sent this requester's ``track`` ed fetch of the rank -- a delta against that
  step, compressed. ``track`` keeps what was sent as the base of the next catch-up
  (both ends hold one copy per tracked rank, dropped by an untracked fetch of it or
  after :data:`TRACK_TTL_S` unused). A holder that no longer has the base answers the
  whole step (``base`` null), so a catch-up never depends on the holder's memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import numpy as np

from nonstop.control.channel import BLOB, Channel, Message, connect
from nonstop.errors import ControlError, NonstopError, SnapshotError
from nonstop.protocol.dataplane import (
    ChunkMsg,
    FetchBeginMsg,
    FetchMsg,
    RepAckMsg,
    RepMsg,
    RepSharedMsg,
    SnapshotHead,
)
from nonstop.snapshot.codec import ChunkInfo, CodecConfig, Encoder, check_chunks, decode, segments_for
from nonstop.snapshot.store import RankSnapshotStore, RawSnapshot
from nonstop.snapshot.validate import RESIDUAL, alloc

__all__ = [
    "TRACK_TTL_S",
    "TrackedBase",
    "TrackedBases",
    "REPLICA_SLOTS",
    "FetchError",
    "Fetched",
    "ReplicaStats",
    "Replicator",
    "fetch",
    "fetch_snapshot",
    "local_store_id",
    "replica_store_id",
    "replicas_beside",
]

log = logging.getLogger(__name__)

RAW_CODEC = CodecConfig(codec="none", shuffle="none")
K = TypeVar("K")
TRACK_TTL_S = 120.0  # a tracked fetch's base is dropped when no catch-up used it for this long


REPLICA_SLOTS = 3  # slots a node keeps per rank it holds replicas of
# what a fetch may raise that ends in a FetchError: the channel, the snapshot, malformed answers
_FETCH_FAILURES: tuple[type[BaseException], ...] = (ControlError, OSError, SnapshotError, *RESIDUAL)
ACK_TIMEOUT_S = 60.0  # a holder silent this long after a replica's last chunk is taken for gone


def local_store_id(job_id: str, node: str) -> str:
    """Name under which a node keeps its own ranks' snapshot slots."""
    return f"{job_id}.{node}"


def replica_store_id(job_id: str, node: str) -> str:
    """Name under which a node keeps the replicas it holds for other nodes' ranks."""
    return replicas_beside(local_store_id(job_id, node))


def replicas_beside(local_id: str) -> str:
    """The replica store id of the node whose own ranks' store id is ``local_id`` (what a worker
    knows: ``NONSTOP_JOB_ID``)."""
    return f"{local_id}.rep"


class FetchError(NonstopError):
    """A snapshot could not be fetched from (or replicated to) a peer."""


def _send_chunks(chan: Channel, chunks: list[tuple[ChunkInfo, Any]], throttle: Callable[[int], None]) -> int:
    wire = 0
    for info, payload in chunks:
        throttle(info.enc_len)
        chan.send(ChunkMsg(info=info.to_json()).encode(), payload)
        wire += info.enc_len
    return wire


def _recv_snapshot(
    first: SnapshotHead, next_msg: Callable[[], Message], base: Any, out: np.ndarray | None = None
) -> tuple[bytes, Any]:
    """Read the chunks announced by ``first`` and decode them (CRC-checked) against ``base``,
    into ``out`` (a uint8 array, reused when large enough) or a new bytearray."""
    try:
        meta = bytes(first.blob)
        n, data_len = first.nchunks, first.data_len
        if n < 0 or data_len < 0:
            raise FetchError(f"bad snapshot header: {n} chunks, {data_len} bytes")
        chunks = []
        for _ in range(n):
            chunk = ChunkMsg.decode(next_msg())
            chunks.append((ChunkInfo.from_json(chunk.info), chunk.blob))
        check_chunks(chunks, data_len)  # before the buffer is allocated: no length trusted alone
        then = "nothing is installed"
        dest: Any = (
            out[:data_len] if out is not None and out.size >= data_len else alloc(data_len, "snapshot", then)
        )
        decode(chunks, dest, base)
        return meta, dest
    except RESIDUAL as e:
        raise FetchError(f"malformed snapshot from the peer: {type(e).__name__}: {e}") from e


class _Bucket:
    """Token bucket: at most ``rate`` bytes/s on average (None: unlimited)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._t = time.monotonic()
        self._debt = 0.0
        self._lock = threading.Lock()  # a data plane serves fetches on several threads

    def __call__(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._debt = max(0.0, self._debt - (now - self._t) * self.rate) + n
            self._t = now
            wait = self._debt / self.rate - 0.05  # allow a 50 ms burst
        if wait > 0:
            time.sleep(wait)


@dataclass
class ReplicaStats:
    raw_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    full: bool = False


class Replicator:
    """Sender side: replicate a local rank's step to its holders, as a delta when possible.

    Keeps, per (rank, holder), the data last acknowledged by that holder (the
    base of the next delta). One call at a time (the agent's replication thread);
    :meth:`abandon` alone may be called from another thread.
    """

    def __init__(
        self,
        *,
        node: str,
        secret: bytes,
        local: Callable[[int], RankSnapshotStore],
        bandwidth_bytes_s: float | None = None,
        codec: CodecConfig | None = None,
    ) -> None:
        self.node = node
        self._secret = secret
        self._local = local
        self._codec = codec or CodecConfig()
        self._encoder = Encoder(self._codec)
        self._bucket = _Bucket(bandwidth_bytes_s)
        self._chans: dict[str, Channel] = {}
        self._bases: dict[tuple[int, str], tuple[int, np.ndarray]] = {}
        self._scratch: dict[int, np.ndarray] = {}
        # per holder and copy group: the node's shared write last sent there ((gen, step), data):
        # a delta's base
        self._shared_bases: dict[tuple[str, int], tuple[list[int], np.ndarray]] = {}
        self._shared_scratch: np.ndarray | None = None
        self._active: Channel | None = None  # the holder connection a round is using now

    def abandon(self) -> None:
        """Fail the send in progress now (any thread): its holder connection is closed, so a
        round waiting for a holder that went silent (a partition: no reset, only silence)
        raises at once instead of after ``ACK_TIMEOUT_S``. For a round the coordinator has
        given up on; the next round connects again."""
        ch = self._active
        if ch is not None:
            ch.close()

    def _chan(self, addr: str) -> Channel:
        ch = self._chans.get(addr)
        if ch is None or ch.closed:
            host, _, port = addr.rpartition(":")
            ch = connect(
                (host, int(port)),
                self._secret,
                {"role": "peer", "node": self.node},
                timeout=5.0,
                purpose="data",
                read_timeout=ACK_TIMEOUT_S,
            )
            self._chans[addr] = ch
        return ch

    def replicate(self, rank: int, step: int, holders: list[str]) -> ReplicaStats:
        """Send ``rank``'s snapshot of ``step`` to every holder address; raise on any failure."""
        t0 = time.monotonic()
        store = self._local(rank)
        # keep=True: the step stays in this node's memory until a newer round is committed
        # (the agent releases it), so survivors can always return to the replicated step.
        # split=True: a snapshot split with the node's shared write comes as the rank's own part;
        # the shared write goes to a holder once, when it asks for it (need_shared).
        snap = store.copy_out(step, out=self._scratch.get(rank), keep=True, split=True)
        if self._scratch.get(rank) is None or self._scratch[rank].size < snap.data.size:
            self._scratch[rank] = snap.data
        segments = segments_for(snap.entries(), len(snap.data))
        stats = ReplicaStats(raw_bytes=len(snap.data) * len(holders))
        for addr in holders:
            try:
                stats.wire_bytes += self._send(addr, rank, step, snap, segments, stats, store)
            except (ControlError, OSError, FetchError) as e:
                self._chans.pop(addr, None)
                self._bases.pop((rank, addr), None)  # next time send it whole
                for key in [k for k in self._shared_bases if k[0] == addr]:
                    del self._shared_bases[key]
                raise FetchError(f"replicating rank {rank} step {step} to {addr} failed: {e}") from e
        stats.seconds = time.monotonic() - t0
        return stats

    def _send(
        self,
        addr: str,
        rank: int,
        step: int,
        snap: RawSnapshot,
        segments: Any,
        stats: ReplicaStats,
        store: RankSnapshotStore,
    ) -> int:
        ch = self._active = self._chan(addr)
        # a split snapshot's shared write is named by its layout key too: a holder whose own ranks
        # hold the same write (a DDP job's, an HSDP twin's) takes it from its own memory, not the wire
        key = store.node_copy(snap.shared.group).key_of(snap.shared) if snap.shared is not None else None
        try:
            wire = 0
            for _ in range(2):
                sent, need_shared = self._send_on(ch, addr, rank, step, snap, segments, stats, key)
                wire += sent
                if not need_shared:
                    return wire
                wire += self._send_shared(ch, addr, snap, store, stats)
            raise FetchError(f"holder {addr} still lacks step {step}'s shared write after it was sent")
        finally:
            self._active = None

    def _send_shared(
        self, ch: Channel, addr: str, snap: RawSnapshot, store: RankSnapshotStore, stats: ReplicaStats
    ) -> int:
        """Send the node's shared write ``snap`` refers to (once per holder and step: the holder
        asked for it), as a delta against the one last sent to this holder when it still has
        that one."""
        ref = snap.shared
        assert ref is not None
        node = store.node_copy(ref.group)
        key = node.key_of(ref)
        data = node.copy_data(ref, out=self._shared_scratch)
        if data is None or key is None:
            raise FetchError(f"step {ref.step}'s shared write is no longer in this node's memory")
        if self._shared_scratch is None or self._shared_scratch.size < data.size:
            self._shared_scratch = data
        segments = segments_for(snap.shared_entries(), len(data))
        base = self._shared_bases.get((addr, ref.group))
        stats.raw_bytes += len(data)
        head = RepSharedMsg(gen=ref.gen, step=ref.step, key=key, group=ref.group, data_len=0, nchunks=0)
        wire, ack, _ = self._offer(ch, head, None, data, segments, base)
        if not ack.ok:
            raise FetchError(f"holder {addr} refused step {ref.step}'s shared write: {ack.error}")
        _keep_base(self._shared_bases, (addr, ref.group), [ref.gen, ref.step], data)
        return wire

    def _send_on(
        self,
        ch: Channel,
        addr: str,
        rank: int,
        step: int,
        snap: RawSnapshot,
        segments: Any,
        stats: ReplicaStats,
        key: str | None = None,
    ) -> tuple[int, bool]:
        """Send ``snap`` (whole, or a split snapshot's own part, with ``key``: its shared write's
        layout key); (wire bytes, whether the holder lacks the shared write it refers to: then
        nothing was installed)."""
        head = RepMsg(rank=rank, step=step, key=key, data_len=0, nchunks=0)
        base = self._bases.get((rank, addr))
        wire, ack, whole = self._offer(ch, head, snap.meta, snap.data, segments, base)
        if ack.ok:
            _keep_base(self._bases, (rank, addr), step, snap.data)
            stats.full = stats.full or whole
            return wire, False
        if ack.need_shared and snap.shared is not None:
            return wire, True
        raise FetchError(f"holder {addr} refused rank {rank} step {step}: {ack.error}")

    def _offer(
        self,
        ch: Channel,
        head: RepMsg | RepSharedMsg,
        meta: bytes | None,
        data: np.ndarray,
        segments: Any,
        base: tuple[Any, np.ndarray] | None,
    ) -> tuple[int, RepAckMsg, bool]:
        """Send ``data`` (with ``meta``) under ``head``, as a delta against ``base`` (what this
        holder acknowledged last: its id, its bytes) when it has the same size, and once more
        whole when the holder no longer has that base (``need_full``). (wire bytes, the holder's
        last answer, whether that send was whole)."""
        if base is not None and base[1].size != data.size:
            base = None  # the layout changed: a delta needs the same size
        wire = 0
        while True:
            chunks = self._encoder.encode(data, segments, None if base is None else base[1])
            ch.send(
                replace(
                    head, base=None if base is None else base[0], data_len=len(data), nchunks=len(chunks)
                ).encode(),
                meta,
            )
            wire += _send_chunks(ch, chunks, self._bucket) + len(meta or b"")
            ack = RepAckMsg.decode(ch.recv())
            if ack.need_full and base is not None:
                base = None
                continue
            return wire, ack, base is None

    def forget(self, rank: int) -> None:
        """Drop the delta bases of ``rank`` (it moved away from this node)."""
        for key in [k for k in self._bases if k[0] == rank]:
            del self._bases[key]

    def close(self) -> None:
        self._encoder.close()
        for ch in self._chans.values():
            ch.close()
        self._chans.clear()


def _keep_base(bases: dict[Any, tuple[Any, np.ndarray]], key: Any, ident: Any, data: np.ndarray) -> None:
    """Keep a copy of ``data`` (acknowledged by its holder as ``ident``) as the base of the next
    delta to that holder, in the buffer kept before when it has the size."""
    kept = bases.get(key)
    buf = kept[1] if kept is not None and kept[1].size == data.size else np.empty_like(data)
    np.copyto(buf, data)
    bases[key] = (ident, buf)


@dataclass
class Fetched:
    """What :func:`fetch` brought: the snapshot and how it travelled.

    ``data`` is a bytearray, or a view of the ``out`` array given; ``base`` is the step
    it was decoded against (None: sent whole); ``wire_bytes`` counts the payloads."""

    meta: bytes
    data: Any
    base: int | None
    wire_bytes: int
    capped: bool = False  # the holder held it to its bandwidth cap (its time measures the cap)


def fetch(
    addr: str,
    secret: bytes,
    *,
    node: str,
    rank: int,
    step: int,
    kind: str,
    base: tuple[int, Any] | None = None,
    track: bool = False,
    out: np.ndarray | None = None,
    timeout: float = 30.0,
) -> Fetched:
    """``rank``'s snapshot of ``step`` from the node at ``addr`` (module docstring, ``fetch``).

    ``kind``: ``"local"`` (that node's own slots of the rank) or ``"replica"``.
    ``base``: (step, data) this node holds from its last ``track`` ed fetch of the rank
    from ``addr``; the holder then sends a delta against it if it still has that step too.
    Every chunk is CRC-checked (after decoding: against the data the holder encoded, so a
    wrong base cannot pass). Raises FetchError -- and nothing else -- when the peer lacks the
    step, sends anything malformed, or goes ``timeout`` seconds without a byte.
    """
    host, _, port = addr.rpartition(":")
    try:
        ch = connect(
            (host, int(port)),
            secret,
            {"role": "peer", "node": node},
            timeout=timeout,
            purpose="data",
            read_timeout=timeout,
        )
    except (ControlError, OSError) as e:
        raise FetchError(f"cannot reach {addr} to fetch rank {rank} step {step}: {e}") from e
    try:
        ask = FetchMsg(
            rank=rank, step=step, kind=kind, node=node, base=None if base is None else base[0], track=track
        )
        ch.send(ask.encode())
        first = FetchBeginMsg.decode(ch.recv())
        if first.error:
            raise FetchError(f"{addr} cannot serve rank {rank} step {step}: {first.error}")
        got = first.base
        if got is not None and (base is None or int(got) != base[0]):
            raise FetchError(f"{addr} sent a delta against step {got}, which this node did not offer")
        wire = [len(first.blob)]

        def next_chunk() -> Message:
            msg = ch.recv()
            wire[0] += len(msg.get(BLOB, b""))
            return msg

        base_data = base[1] if got is not None and base is not None else None
        meta, data = _recv_snapshot(first, next_chunk, base_data, out)
        return Fetched(
            meta=meta,
            data=data,
            base=None if got is None else int(got),
            wire_bytes=wire[0],
            capped=first.capped,
        )
    except _FETCH_FAILURES as e:
        raise FetchError(f"fetching rank {rank} step {step} from {addr} failed: {e}") from e
    finally:
        ch.close()


def fetch_snapshot(
    addr: str, secret: bytes, *, node: str, rank: int, step: int, kind: str, timeout: float = 30.0
) -> tuple[bytes, Any]:
    """(meta, data) of ``rank``'s snapshot of ``step``, sent whole (:func:`fetch`)."""
    got = fetch(addr, secret, node=node, rank=rank, step=step, kind=kind, timeout=timeout)
    return got.meta, got.data


@dataclass
class TrackedBase:
    """What one end of a tracked fetch keeps (the holder: what it sent; the requester: what it
    received): the base of the next delta. ``spare``: the buffer before, reused for the next
    step; ``source``: the requester's (addr, rank, kind) it came from."""

    step: int
    data: np.ndarray
    spare: np.ndarray | None
    source: tuple[str, int, str] | None = None
    used: float = field(default_factory=time.monotonic)


class TrackedBases(Generic[K]):
    """The bases one node keeps, by key; a base unused for TRACK_TTL_S is dropped (a migration
    aborted before its swap) at the next :meth:`take` or :meth:`expire`. Thread-safe."""

    def __init__(self) -> None:
        self._bases: dict[K, TrackedBase] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._bases)

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for k in [k for k, v in self._bases.items() if now - v.used > TRACK_TTL_S]:
                del self._bases[k]

    def take(self, key: K) -> TrackedBase | None:
        """Remove and return the base kept for ``key`` (a fetch either replaces it or ends it)."""
        self.expire()
        with self._lock:
            return self._bases.pop(key, None)

    def put(self, key: K, base: TrackedBase) -> None:
        with self._lock:
            self._bases[key] = base
