"""The node-to-node data plane: replicas in, snapshots out.

Messages on a peer channel (all authenticated by :mod:`nonstop.control.channel`):

* ``rep`` (sender -> holder): one rank's snapshot of one step. The first frame
  carries ``rank, step, base, data_len, nchunks`` and the meta as its blob; then
  ``nchunks`` ``chunk`` frames, each a :class:`ChunkInfo` and its payload. The
  holder decodes against its copy of ``base`` (a delta) or alone (``base`` is
  null), verifies every chunk's CRC-32C, installs the step in its replica slots
  and answers ``rep_ack`` (``ok``, or ``need_full`` when it lacks the base).
* ``fetch`` (a node restoring a rank -> the node holding it): the holder
  answers ``fetch_begin`` (meta as blob, or ``error``) and the chunks, encoded
  without compression but checksummed like any chunk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nonstop.control.channel import BLOB, Channel, ControlServer, Message, connect
from nonstop.errors import ControlError, NonstopError, SnapshotError, SnapshotMissingError
from nonstop.snapshot.codec import ChunkInfo, CodecConfig, Encoder, decode, segments_for
from nonstop.snapshot.store import RankSnapshotStore, RawSnapshot

__all__ = [
    "DataPlane",
    "FetchError",
    "ReplicaStats",
    "Replicator",
    "fetch_snapshot",
    "local_store_id",
    "replica_store_id",
]

log = logging.getLogger(__name__)

RAW_CODEC = CodecConfig(codec="none", shuffle="none")


def local_store_id(job_id: str, node: str) -> str:
    """Name under which a node keeps its own ranks' snapshot slots."""
    return f"{job_id}.{node}"


def replica_store_id(job_id: str, node: str) -> str:
    """Name under which a node keeps the replicas it holds for other nodes' ranks."""
    return f"{job_id}.{node}.rep"


class FetchError(NonstopError):
    """A snapshot could not be fetched from (or replicated to) a peer."""


def _send_chunks(chan: Channel, chunks: list[tuple[ChunkInfo, Any]], throttle: Callable[[int], None]) -> int:
    wire = 0
    for info, payload in chunks:
        throttle(info.enc_len)
        chan.send({"t": "chunk", "info": info.to_json()}, payload)
        wire += info.enc_len
    return wire


def _recv_snapshot(first: Message, next_msg: Callable[[], Message], base: Any) -> tuple[bytes, bytearray]:
    """Read the chunks announced by ``first`` and decode them (CRC-checked) against ``base``."""
    meta = bytes(first.get(BLOB, b""))
    n, data_len = int(first["nchunks"]), int(first["data_len"])
    chunks = []
    for _ in range(n):
        msg = next_msg()
        if msg.get("t") != "chunk":
            raise FetchError(f"expected a chunk, got {msg.get('t')!r}")
        chunks.append((ChunkInfo.from_json(msg["info"]), msg.get(BLOB, b"")))
    out = bytearray(data_len)
    decode(chunks, out, base)
    return meta, out


class _Bucket:
    """Token bucket: at most ``rate`` bytes/s on average (None: unlimited)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self._t = time.monotonic()
        self._debt = 0.0

    def __call__(self, n: int) -> None:
        if not self.rate:
            return
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
    base of the next delta). One call at a time (the agent's replication thread).
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

    def _chan(self, addr: str) -> Channel:
        ch = self._chans.get(addr)
        if ch is None or ch.closed:
            host, _, port = addr.rpartition(":")
            ch = connect((host, int(port)), self._secret, {"role": "peer", "node": self.node}, timeout=5.0)
            self._chans[addr] = ch
        return ch

    def replicate(self, rank: int, step: int, holders: list[str]) -> ReplicaStats:
        """Send ``rank``'s snapshot of ``step`` to every holder address; raise on any failure."""
        t0 = time.monotonic()
        store = self._local(rank)
        # keep=True: the step stays in this node's memory until a newer round is committed
        # (the agent releases it), so survivors can always return to the replicated step.
        snap = store.copy_out(step, out=self._scratch.get(rank), keep=True)
        if self._scratch.get(rank) is None or self._scratch[rank].size < snap.data.size:
            self._scratch[rank] = snap.data
        segments = segments_for(snap.entries(), len(snap.data))
        stats = ReplicaStats(raw_bytes=len(snap.data) * len(holders))
        for addr in holders:
            try:
                stats.wire_bytes += self._send(addr, rank, step, snap, segments, stats)
            except (ControlError, OSError, FetchError) as e:
                self._chans.pop(addr, None)
                self._bases.pop((rank, addr), None)  # next time send it whole
                raise FetchError(f"replicating rank {rank} step {step} to {addr} failed: {e}") from e
        stats.seconds = time.monotonic() - t0
        return stats

    def _send(
        self, addr: str, rank: int, step: int, snap: RawSnapshot, segments: Any, stats: ReplicaStats
    ) -> int:
        ch = self._chan(addr)
        base = self._bases.get((rank, addr))
        if base is not None and base[1].size != snap.data.size:
            base = None  # the layout changed: a delta needs the same size
        for attempt in (0, 1):
            chunks = self._encoder.encode(snap.data, segments, None if base is None else base[1])
            ch.send(
                {
                    "t": "rep",
                    "rank": rank,
                    "step": step,
                    "base": None if base is None else base[0],
                    "data_len": len(snap.data),
                    "nchunks": len(chunks),
                },
                snap.meta,
            )
            wire = _send_chunks(ch, chunks, self._bucket) + len(snap.meta)
            ack = ch.recv()
            if ack.get("ok"):
                keep = self._bases.get((rank, addr))
                buf = (
                    keep[1]
                    if keep is not None and keep[1].size == snap.data.size
                    else np.empty_like(snap.data)
                )
                np.copyto(buf, snap.data)
                self._bases[(rank, addr)] = (step, buf)
                stats.full = stats.full or base is None
                return wire
            if ack.get("need_full") and attempt == 0 and base is not None:
                base = None
                continue
            raise FetchError(f"holder {addr} refused rank {rank} step {step}: {ack.get('error')}")
        raise AssertionError("unreachable")

    def forget(self, rank: int) -> None:
        """Drop the delta bases of ``rank`` (it moved away from this node)."""
        for key in [k for k in self._bases if k[0] == rank]:
            del self._bases[key]

    def close(self) -> None:
        self._encoder.close()
        for ch in self._chans.values():
            ch.close()
        self._chans.clear()


def fetch_snapshot(
    addr: str, secret: bytes, *, node: str, rank: int, step: int, kind: str, timeout: float = 30.0
) -> tuple[bytes, bytearray]:
    """(meta, data) of ``rank``'s snapshot of ``step`` from the node at ``addr``.

    ``kind``: ``"local"`` (that node's own slots of the rank) or ``"replica"``.
    Every chunk is CRC-checked; raises FetchError when the peer lacks the step.
    """
    host, _, port = addr.rpartition(":")
    try:
        ch = connect((host, int(port)), secret, {"role": "peer", "node": node}, timeout=timeout)
    except (ControlError, OSError) as e:
        raise FetchError(f"cannot reach {addr} to fetch rank {rank} step {step}: {e}") from e
    try:
        ch.send({"t": "fetch", "rank": rank, "step": step, "kind": kind})
        first = ch.recv()
        if first.get("error"):
            raise FetchError(f"{addr} cannot serve rank {rank} step {step}: {first['error']}")
        return _recv_snapshot(first, ch.recv, None)
    except (ControlError, OSError, SnapshotError) as e:
        raise FetchError(f"fetching rank {rank} step {step} from {addr} failed: {e}") from e
    finally:
        ch.close()


class DataPlane:
    """A node's listener for peers: stores replicas it receives, serves snapshots on request.

    ``local(rank)`` and ``replica(rank)`` give the node's own and replica slot
    stores. Runs one dispatcher thread; a fetch is served on its own thread.
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
    ) -> None:
        self._local = local
        self._replica = replica
        self._server = ControlServer(host=host, port=port, secret=secret, on_refused=on_refused)
        self.address = self._server.address
        self._partial: dict[Channel, tuple[Message, list[Message]]] = {}
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
                    chan.send({"t": "rep_ack", "ok": False, "error": str(e)[:300]})
                except ControlError:
                    pass

    def _on_message(self, chan: Channel, msg: Message) -> None:
        t = msg.get("t")
        if t == "rep":
            if int(msg["nchunks"]) == 0:
                self._install(chan, msg, [])
            else:
                self._partial[chan] = (msg, [])
        elif t == "chunk":
            got = self._partial.get(chan)
            if got is None:
                raise FetchError("chunk without a rep header")
            got[1].append(msg)  # its BLOB views a buffer of its own (one per received frame)
            if len(got[1]) == int(got[0]["nchunks"]):
                del self._partial[chan]
                self._install(chan, got[0], got[1])
        elif t == "fetch":
            threading.Thread(target=self._serve_fetch, args=(chan, msg), daemon=True).start()
        else:
            raise FetchError(f"unknown data-plane message {t!r}")

    def _install(self, chan: Channel, head: Message, chunks: list[Message]) -> None:
        rank, step = int(head["rank"]), int(head["step"])
        store = self._replica(rank)
        base_data = None
        if head.get("base") is not None:
            try:
                base_data = store.copy_out(int(head["base"])).data
            except SnapshotMissingError:
                chan.send({"t": "rep_ack", "ok": False, "need_full": True, "error": "base not held"})
                return
        it = iter(chunks)
        try:
            meta, data = _recv_snapshot(head, lambda: next(it), base_data)
        except SnapshotError as e:
            if base_data is None:
                raise
            # A delta that does not decode against our copy of the base (a base we hold differs
            # from the sender's): nothing is installed; ask for the whole snapshot instead.
            chan.send({"t": "rep_ack", "ok": False, "need_full": True, "error": f"delta rejected: {e}"})
            return
        with self._lock:
            store.write_raw(step, meta, data)
        chan.send({"t": "rep_ack", "ok": True, "rank": rank, "step": step})

    def _serve_fetch(self, chan: Channel, msg: Message) -> None:
        rank, step, kind = int(msg["rank"]), int(msg["step"]), str(msg.get("kind", "replica"))
        try:
            store = self._replica(rank) if kind == "replica" else self._local(rank)
            snap = store.copy_out(step)
            with Encoder(RAW_CODEC) as enc:
                chunks = enc.encode(snap.data, segments_for(snap.entries(), len(snap.data)))
            chan.send({"t": "fetch_begin", "data_len": len(snap.data), "nchunks": len(chunks)}, snap.meta)
            _send_chunks(chan, chunks, lambda n: None)
        except (SnapshotError, ControlError, OSError) as e:
            try:
                chan.send({"t": "fetch_begin", "error": str(e)[:300]})
            except ControlError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        self._thread.join(timeout=2.0)


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
