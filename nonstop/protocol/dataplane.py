"""The data plane: node <-> node snapshot copies (:mod:`nonstop.replica`), on channels keyed
``data``. Every message may carry a binary part (the channel's blob): a snapshot's meta on a
header, a chunk's bytes on a chunk; decoded messages hold it as ``blob``.

Replication, sender (:class:`nonstop.replica.peer.ReplicaSender`) -> holder
(:class:`nonstop.replica.dataplane.DataPlane`): a header, :class:`RepMsg` (one rank's snapshot)
or :class:`RepSharedMsg` (a node's shared write), then ``nchunks`` :class:`ChunkMsg`; the holder
answers :class:`RepAckMsg` (installed, or refused: ``need_full`` -- send it whole, the delta base
is not held -- or ``need_shared`` -- send the shared write it refers to first).

Fetch, requester (:func:`nonstop.replica.peer.fetch`) -> holder: :class:`FetchMsg`; the holder
answers :class:`FetchBeginMsg` (the snapshot's header, or an ``error``) then its chunks.

A malformed message raises :class:`~nonstop.protocol.base.WireError`: the holder drops that
peer's partial transfer and answers a failed ack; a requester's fetch fails (FetchError).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nonstop.control.channel import BLOB
from nonstop.protocol.base import Json, WireError, as_int, kind_of, need, opt_int, opt_str

__all__ = ["ChunkMsg", "FetchBeginMsg", "FetchMsg", "RepAckMsg", "RepMsg", "RepSharedMsg", "SnapshotHead"]


def _blob(m: Mapping[str, Any]) -> Any:
    return m.get(BLOB, b"")


@dataclass(frozen=True, kw_only=True)
class SnapshotHead:
    """What a header announces of the chunks that follow it (``blob``: the snapshot's meta)."""

    data_len: int
    nchunks: int
    blob: Any = b""


@dataclass(frozen=True, kw_only=True)
class RepMsg(SnapshotHead):
    """Replicate ``rank``'s snapshot of ``step`` (``key``: a split snapshot's shared-write layout,
    its own part only is sent; ``base``: the step a delta is against, None: whole)."""

    T: ClassVar[str] = "rep"
    rank: int
    step: int
    key: str | None = None
    base: int | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "rank": self.rank, "step": self.step}
        if self.key is not None:
            out["key"] = self.key
        out.update(base=self.base, data_len=self.data_len, nchunks=self.nchunks)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RepMsg:
        return cls(
            rank=as_int(m, "rank"),
            step=as_int(m, "step"),
            key=opt_str(m, "key"),
            base=opt_int(m, "base"),
            data_len=as_int(m, "data_len"),
            nchunks=as_int(m, "nchunks"),
            blob=_blob(m),
        )


@dataclass(frozen=True, kw_only=True)
class RepSharedMsg(SnapshotHead):
    """Hold the shared write of (``gen``, ``step``, copy ``group``) in layout ``key``; ``base``:
    the (generation, step) of the write a delta is against, None: whole."""

    T: ClassVar[str] = "rep_shared"
    gen: int
    step: int
    key: str
    group: int = 0
    base: tuple[int, int] | None = None

    def encode(self) -> Json:
        base = None if self.base is None else list(self.base)
        return {
            "t": self.T,
            "gen": self.gen,
            "step": self.step,
            "key": self.key,
            "group": self.group,
            "base": base,
            "data_len": self.data_len,
            "nchunks": self.nchunks,
        }

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RepSharedMsg:
        base = m.get("base")
        if base is not None:
            try:
                b_gen, b_step = (int(v) for v in base)
            except (TypeError, ValueError) as e:
                raise WireError(f"'rep_shared' message: base must be [generation, step] ({e})") from None
        return cls(
            gen=as_int(m, "gen"),
            step=as_int(m, "step"),
            key=str(need(m, "key")),
            group=as_int(m, "group", 0),
            base=None if base is None else (b_gen, b_step),
            data_len=as_int(m, "data_len"),
            nchunks=as_int(m, "nchunks"),
            blob=_blob(m),
        )


@dataclass(frozen=True, kw_only=True)
class ChunkMsg:
    """One encoded chunk: ``info`` (a :class:`nonstop.snapshot.codec.ChunkInfo`'s JSON) and its
    bytes (``blob``)."""

    T: ClassVar[str] = "chunk"
    info: Mapping[str, Any]
    blob: Any = b""

    def encode(self) -> Json:
        return {"t": self.T, "info": dict(self.info)}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> ChunkMsg:
        if kind_of(m) != cls.T:
            raise WireError(f"expected a chunk, got {kind_of(m)!r}")
        info = need(m, "info")
        if not isinstance(info, Mapping):
            raise WireError(f"'chunk' message: info must be an object, not {info!r}")
        return cls(info=info, blob=_blob(m))


@dataclass(frozen=True, kw_only=True)
class RepAckMsg:
    """The holder's answer to a replication: ``ok`` (with the ``step`` installed, and ``rank``
    for a rank's snapshot), or refused with ``error``, ``need_full`` or ``need_shared``."""

    T: ClassVar[str] = "rep_ack"
    ok: bool
    need_full: bool = False
    need_shared: bool = False
    rank: int | None = None
    step: int | None = None
    error: str | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "ok": self.ok}
        if self.need_full:
            out["need_full"] = True
        if self.need_shared:
            out["need_shared"] = True
        if self.rank is not None:
            out["rank"] = self.rank
        if self.step is not None:
            out["step"] = self.step
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> RepAckMsg:
        return cls(
            ok=bool(m.get("ok")),
            need_full=bool(m.get("need_full")),
            need_shared=bool(m.get("need_shared")),
            rank=opt_int(m, "rank"),
            step=opt_int(m, "step"),
            error=opt_str(m, "error"),
        )


@dataclass(frozen=True, kw_only=True)
class FetchMsg:
    """Send ``rank``'s ``kind`` (replica / local) snapshot of ``step`` to ``node``; ``base``: the
    step the requester holds (a delta against it is welcome); ``track``: keep what is sent as the
    base of this requester's next fetch."""

    T: ClassVar[str] = "fetch"
    rank: int
    step: int
    kind: str = "replica"
    node: str = ""
    base: int | None = None
    track: bool = False

    def encode(self) -> Json:
        out: Json = {"t": self.T, "rank": self.rank, "step": self.step, "kind": self.kind, "node": self.node}
        if self.base is not None:
            out["base"] = self.base
        if self.track:
            out["track"] = True
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FetchMsg:
        return cls(
            rank=as_int(m, "rank"),
            step=as_int(m, "step"),
            kind=str(m.get("kind", "replica")),
            node=str(m.get("node", "")),
            base=opt_int(m, "base"),
            track=bool(m.get("track")),
        )


@dataclass(frozen=True, kw_only=True)
class FetchBeginMsg(SnapshotHead):
    """A fetch's answer: the snapshot's header (``base``: the step the delta is against, None:
    whole; ``capped``: sent under the bandwidth cap), or ``error`` (nothing follows)."""

    T: ClassVar[str] = "fetch_begin"
    base: int | None = None
    capped: bool = False
    error: str | None = None

    def encode(self) -> Json:
        if self.error is not None:
            return {"t": self.T, "error": self.error}
        return {
            "t": self.T,
            "data_len": self.data_len,
            "nchunks": self.nchunks,
            "base": self.base,
            "capped": self.capped,
        }

    @classmethod
    def failed(cls, error: str) -> FetchBeginMsg:
        return cls(data_len=0, nchunks=0, error=error)

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> FetchBeginMsg:
        if m.get("error"):
            return cls.failed(str(m["error"]))
        return cls(
            data_len=as_int(m, "data_len"),
            nchunks=as_int(m, "nchunks"),
            base=opt_int(m, "base"),
            capped=bool(m.get("capped")),
            blob=_blob(m),
        )
