"""Process-group rendezvous over the authenticated control channel.

gloo needs a key-value store to exchange addresses when a process group is
built. torchrun uses an unauthenticated TCPStore; nonstop's workers instead
ask the coordinator over their (HMAC-authenticated) control channel, so:

* a peer without the job secret cannot read or plant rendezvous keys;
* requests carry the worker's generation and the coordinator refuses keys of
  any generation but the current one (a fenced worker cannot join a group);
* a blocked ``get`` is interruptible: when the coordinator starts a newer
  generation every waiting call fails at once (a ``FileStore`` wait could
  only time out).

Coordinator side: :class:`KeyValueTable` (no I/O; ``get`` of a missing key
parks the request until a ``set``). Worker side: :class:`ChannelStore`, a
``torch.distributed.Store`` whose calls become ``kv`` messages.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from nonstop.errors import ControlError
from nonstop.protocol.rendezvous import KvReplyMsg, KvRequestError, KvRequestMsg, b64

__all__ = ["ChannelStore", "KeyValueTable", "KvWaiter"]

Message = dict[str, Any]
Reply = Callable[[Message], None]


@dataclass
class KvWaiter:
    """A parked ``get``/``wait``: who asked, under which request id, for which keys."""

    reply: Callable[[Message], None]
    req_id: int
    keys: list[str]
    op: str


@dataclass
class KeyValueTable:
    """The coordinator's rendezvous keys of the current generation.

    :meth:`handle` takes one ``kv`` request and returns the replies to send now
    (to the caller, and to parked callers the request released).
    """

    generation: int = 0
    data: dict[str, bytes] = field(default_factory=dict)
    waiters: list[KvWaiter] = field(default_factory=list)

    def new_generation(self, generation: int) -> list[tuple[Reply, Message]]:
        """Drop every key of older generations; fail their parked calls."""
        self.generation = generation
        self.data.clear()
        failed: list[tuple[Reply, Message]] = [
            (w.reply, KvReplyMsg(id=w.req_id, error="reconfigured").encode()) for w in self.waiters
        ]
        self.waiters.clear()
        return failed

    def handle(
        self, msg: Mapping[str, Any], reply: Callable[[Message], None]
    ) -> list[tuple[Callable[[Message], None], Message]]:
        """The replies to send for one request. A request that cannot be carried out (a
        malformed field, ``add`` on a key holding text) is answered with an error, which the
        caller's store raises, as torch's ``TCPStore`` does; it never raises here."""
        try:
            req = KvRequestMsg.decode(msg)
        except KvRequestError as e:
            return [(reply, KvReplyMsg(id=e.req_id, error=str(e)).encode())]
        return [(to, answer.encode()) for to, answer in self._handle(req, reply)]

    def _handle(self, req: KvRequestMsg, reply: Reply) -> list[tuple[Reply, KvReplyMsg]]:
        out: list[tuple[Reply, KvReplyMsg]] = []
        req_id = req.id
        if req.gen != self.generation:
            return [(reply, KvReplyMsg(id=req_id, error=f"fenced: generation {req.gen} is not current"))]
        op = req.op
        key = "" if req.key is None else req.key
        if op == "set":
            self.data[key] = b"" if req.value is None else req.value
            out.append((reply, KvReplyMsg(id=req_id)))
            out.extend(self._release())
        elif op == "add":
            held = self.data.get(key, b"0")
            try:
                current = int(held)
            except ValueError:
                error = f"add: key {key!r} holds {held[:32]!r}, not a counter"
                return [(reply, KvReplyMsg(id=req_id, error=error))]
            value = current + (req.amount or 0)
            self.data[key] = str(value).encode()
            out.append((reply, KvReplyMsg(id=req_id, value=value)))
            out.extend(self._release())
        elif op == "compare_set":
            cur = self.data.get(key)
            expected, desired = req.expected or b"", req.desired or b""
            if (cur is None and expected == b"") or cur == expected:
                self.data[key] = cur = desired
                out.extend(self._release())
            result = cur if cur is not None else expected
            out.append((reply, KvReplyMsg(id=req_id, value=b64(result))))
        elif op in ("get", "wait"):
            keys = list(req.keys) if req.keys is not None else [key]
            waiter = KvWaiter(reply=reply, req_id=req_id, keys=keys, op=op)
            done = self._answer(waiter)
            if done is None:
                self.waiters.append(waiter)
            else:
                out.append((reply, done))
        elif op == "check":
            keys = list(req.keys or ())
            out.append((reply, KvReplyMsg(id=req_id, value=all(k in self.data for k in keys))))
        elif op == "delete":
            out.append((reply, KvReplyMsg(id=req_id, value=self.data.pop(key, None) is not None)))
        elif op == "num_keys":
            out.append((reply, KvReplyMsg(id=req_id, value=len(self.data))))
        else:
            out.append((reply, KvReplyMsg(id=req_id, error=f"unknown kv op {op!r}")))
        return out

    def _answer(self, w: KvWaiter) -> KvReplyMsg | None:
        if not all(k in self.data for k in w.keys):
            return None
        if w.op == "get":
            return KvReplyMsg(id=w.req_id, value=b64(self.data[w.keys[0]]))
        return KvReplyMsg(id=w.req_id)

    def _release(self) -> list[tuple[Reply, KvReplyMsg]]:
        out: list[tuple[Reply, KvReplyMsg]] = []
        keep: list[KvWaiter] = []
        for w in self.waiters:
            done = self._answer(w)
            if done is None:
                keep.append(w)
            else:
                out.append((w.reply, done))
        self.waiters = keep
        return out


_REQUEST_IDS = itertools.count()  # every ChannelStore's requests, process-wide (see ChannelStore)


class ChannelStore(dist.Store):  # type: ignore[name-defined,misc]
    """A ``torch.distributed.Store`` served by the coordinator (worker side).

    ``send`` sends one message on the control channel; the channel's reader
    thread must pass every ``kv`` reply to :meth:`deliver`. :meth:`abort` fails
    every call in flight (a newer generation started). Request ids are unique in
    the process, so several stores may share one channel: each takes only the
    replies to its own requests (the reader may hand every reply to all of them).
    """

    def __init__(self, send: Callable[[Message], None], generation: int, timeout_s: float) -> None:
        super().__init__()
        self._send = send
        self._gen = generation
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[threading.Event, list[KvReplyMsg]]] = {}
        self._aborted: str | None = None

    def deliver(self, msg: Mapping[str, Any]) -> None:
        """A ``kv`` reply from the coordinator (raises :class:`WireError` for a malformed one)."""
        reply = KvReplyMsg.decode(msg)
        with self._lock:
            got = self._pending.get(reply.id)
        if got is not None:
            got[1].append(reply)
            got[0].set()

    def abort(self, why: str) -> None:
        with self._lock:
            self._aborted = why
            pending = list(self._pending.values())
        for ev, box in pending:
            box.append(KvReplyMsg(id=-1, error=why))
            ev.set()

    def _call(self, op: str, **fields: Any) -> KvReplyMsg:
        ev: threading.Event = threading.Event()
        box: list[KvReplyMsg] = []
        with self._lock:
            if self._aborted is not None:
                raise ControlError(f"rendezvous aborted: {self._aborted}")
            req_id = next(_REQUEST_IDS)
            self._pending[req_id] = (ev, box)
        try:
            self._send(KvRequestMsg(id=req_id, gen=self._gen, op=op, **fields).encode())
            if not ev.wait(self._timeout_s):
                raise ControlError(f"rendezvous {op} {fields.get('key', fields.get('keys'))} timed out")
        finally:
            with self._lock:
                self._pending.pop(req_id, None)
        reply = box[0]
        if reply.error:
            raise ControlError(f"rendezvous {op} failed: {reply.error}")
        return reply

    # -- torch.distributed.Store ------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._call("set", key=key, value=raw)

    def get(self, key: str) -> bytes:
        return self._call("get", key=key, keys=(key,)).value_bytes()

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount)).value or 0)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        e = expected.encode() if isinstance(expected, str) else bytes(expected)
        d = desired.encode() if isinstance(desired, str) else bytes(desired)
        return self._call("compare_set", key=key, expected=e, desired=d).value_bytes()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", keys=tuple(keys))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=tuple(keys)).value)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key=key).value)

    def num_keys(self) -> int:
        return int(self._call("num_keys").value or 0)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def clone(self) -> ChannelStore:
        """This store: torch clones a group's store for each group split from it (a device
        node's mesh groups, :mod:`nonstop.train.devicegroups`), and every call here is already
        safe from any thread. Without it the split fails on a pure virtual ``clone``."""
        return self
