"""The rendezvous channel: a worker's process-group store (:class:`nonstop.control.rdzv.ChannelStore`)
<-> the coordinator's key-value table (:class:`nonstop.control.rdzv.KeyValueTable`), carried on the
worker's control channel as ``kv`` messages.

Worker -> coordinator: :class:`KvRequestMsg`, one per ``torch.distributed.Store`` call (``op``:
set, get, add, compare_set, wait, check, delete, num_keys), tagged with a process-wide request
``id`` and the worker's generation ``gen``. Coordinator -> worker: :class:`KvReplyMsg` with that
``id``: a ``value``, nothing (done), or an ``error`` the worker's store raises (a malformed
request, a fenced generation, a key that is not a counter, a newer generation started).

Byte values (``value`` of set, get and compare_set, ``expected``, ``desired``) travel base64.
A malformed request raises :class:`KvRequestError` (a :class:`~nonstop.protocol.base.WireError`)
carrying the id to answer; the table answers it with an error and never raises (as torch's
``TCPStore`` answers a bad call).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nonstop.protocol.base import Json, WireError

__all__ = ["KvReplyMsg", "KvRequestError", "KvRequestMsg", "b64", "kv_refusal", "unb64"]


def b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def unb64(text: object) -> bytes:
    return base64.b64decode(str(text).encode(), validate=True)


class KvRequestError(WireError):
    """A ``kv`` request the table cannot carry out as sent; ``req_id``: the id to answer (-1
    when the id itself is malformed); the message is the answer's error."""

    def __init__(self, req_id: int, error: str) -> None:
        super().__init__(error)
        self.req_id = req_id


@dataclass(frozen=True, kw_only=True)
class KvRequestMsg:
    """One store call. Fields absent on the wire are None here; each op sends its own:
    set (key, value), get (key, keys), add (key, amount), compare_set (key, expected,
    desired), wait / check (keys), delete (key), num_keys (none)."""

    T: ClassVar[str] = "kv"
    id: int
    gen: int
    op: str | None
    key: str | None = None
    value: bytes | None = None
    amount: int | None = None
    expected: bytes | None = None
    desired: bytes | None = None
    keys: tuple[str, ...] | None = None

    def encode(self) -> Json:
        out: Json = {"t": self.T, "id": self.id, "gen": self.gen, "op": self.op}
        if self.key is not None:
            out["key"] = self.key
        if self.value is not None:
            out["value"] = b64(self.value)
        if self.amount is not None:
            out["amount"] = self.amount
        if self.expected is not None:
            out["expected"] = b64(self.expected)
        if self.desired is not None:
            out["desired"] = b64(self.desired)
        if self.keys is not None:
            out["keys"] = list(self.keys)
        return out

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> KvRequestMsg:
        """Raises :class:`KvRequestError`: ``malformed request id ...`` (answered with id -1) or
        ``bad 'op' request: ...`` (a field that does not convert)."""
        try:
            req_id = int(m.get("id", -1))
        except (TypeError, ValueError):
            raise KvRequestError(-1, f"malformed request id {m.get('id')!r}") from None
        op = m.get("op")
        try:
            return cls(
                id=req_id,
                gen=int(m.get("gen", -1)),
                op=None if op is None else str(op),
                key=None if "key" not in m else str(m["key"]),
                value=None if "value" not in m else unb64(m["value"]),
                amount=None if "amount" not in m else int(m["amount"]),
                expected=None if "expected" not in m else unb64(m["expected"]),
                desired=None if "desired" not in m else unb64(m["desired"]),
                keys=None if "keys" not in m else tuple(str(k) for k in m["keys"]),
            )
        except (TypeError, ValueError) as e:  # binascii.Error is a ValueError
            raise KvRequestError(req_id, f"bad {op!r} request: {e}") from None


@dataclass(frozen=True, kw_only=True)
class KvReplyMsg:
    """The answer to request ``id``: ``error`` (the call raises it), else ``value`` (None: the
    op answers nothing, e.g. set and wait)."""

    T: ClassVar[str] = "kv"
    id: int
    value: int | bool | str | None = None  # get and compare_set: base64 (see value_bytes)
    error: str | None = None

    def encode(self) -> Json:
        if self.error is not None:
            return {"t": self.T, "id": self.id, "error": self.error}
        if self.value is None:
            return {"t": self.T, "id": self.id}
        return {"t": self.T, "id": self.id, "value": self.value}

    @classmethod
    def decode(cls, m: Mapping[str, Any]) -> KvReplyMsg:
        try:
            req_id = int(m.get("id", -1))
        except (TypeError, ValueError):
            raise WireError(f"'kv' reply: malformed id {m.get('id')!r}") from None
        value = m.get("value")
        if value is not None and not isinstance(value, int | str):
            raise WireError(f"'kv' reply: value must be a number, a flag or base64 text, not {value!r}")
        error = m.get("error")
        return cls(id=req_id, value=value, error=None if not error else str(error))

    def value_bytes(self) -> bytes:
        """``value`` as the bytes it encodes (get, compare_set)."""
        try:
            return unb64(self.value)
        except (binascii.Error, ValueError) as e:
            raise WireError(f"'kv' reply: value is not base64 ({e})") from None


def kv_refusal(m: Mapping[str, Any], error: str) -> Json:
    """The ``kv`` answer refusing request ``m`` before it is decoded (a worker fenced out of
    the generation): its ``id`` echoed as sent, whatever it is."""
    return {"t": KvRequestMsg.T, "id": m.get("id"), "error": error}
