"""The base of the typed events: :class:`Event` (a line of the log), :data:`REGISTRY` (kind ->
class, filled as each kind's class is defined), :func:`decode` for readers and :func:`from_fields`
for writers that log by name. See :mod:`nonstop.events`."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "ABSENT",
    "JSON_KEY",
    "OPTIONAL",
    "REGISTRY",
    "VERSION",
    "Event",
    "LogHeader",
    "UnknownEvent",
    "as_int",
    "as_str",
    "decode",
    "from_fields",
]

VERSION = 1  # of the log's format: LogHeader's version

ABSENT = "absent"  # metadata: what decode gives for the field when a line lacks it
OMIT = "omit"  # metadata: to_json leaves the field out while it holds its default
JSON_KEY = "json"  # metadata: the field's key in the line, when not its name (``kind``)


# a field only some writers pass: its default when not passed, and then not in the line
OPTIONAL = {OMIT: True}


REGISTRY: dict[str, type[Event]] = {}


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of the log. ``ts``: unix time it was logged (None until :class:`EventLog` stamps
    it); ``extra``: keys of a decoded line that this class does not know (a newer writer's)."""

    kind: ClassVar[str] = ""
    ts: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.kind:
            if cls.kind in REGISTRY:
                raise TypeError(f"two event classes for kind {cls.kind!r}")
            REGISTRY[cls.kind] = cls

    @property
    def event(self) -> str:
        """The line's ``"event"``: the kind."""
        return self.kind

    def fields(self) -> dict[str, Any]:
        """The line's keys but ``ts`` and ``event``, in declaration order (then ``extra``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("ts", "extra"):
                continue
            value = getattr(self, f.name)
            if f.metadata.get(OMIT) and value == f.default:
                continue
            out[f.metadata.get(JSON_KEY, f.name)] = value
        out.update(self.extra)
        return out

    def to_json(self) -> dict[str, Any]:
        """The line as a JSON object."""
        head: dict[str, Any] = {} if self.ts is None else {"ts": self.ts}
        return {**head, "event": self.event, **self.fields()}


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """A line of a kind no class is registered for: ``name`` and its other keys, as read."""

    name: str
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def event(self) -> str:
        return self.name

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in self.raw.items() if k not in ("ts", "event")}


# -- the log ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LogHeader(Event):
    """The first line of a log: its format's version."""

    kind: ClassVar[str] = "eventlog"
    version: int = VERSION


# -- reading ------------------------------------------------------------------------------------------
def as_int(x: object) -> int | None:
    """An int from a JSON value: an int (not a bool) or its decimal text; else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str) and x.lstrip("-").isdigit():
        return int(x)
    return None


def as_str(x: object) -> str | None:
    """Text from a JSON scalar (a number as its text); None for null, a list or an object."""
    return str(x) if isinstance(x, str | int | float) else None


_NO = object()  # a value that does not convert


def _convert(value: object, tp: Any) -> Any:
    """``value`` as type ``tp`` (the field types used above), or ``_NO``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            return None if type(None) in args else _NO
        for arg in args:
            if arg is not type(None) and (got := _convert(value, arg)) is not _NO:
                return got
        return _NO
    if origin is list:
        if not isinstance(value, list):
            return _NO
        (item,) = typing.get_args(tp)
        return [got for v in value if (got := _convert(v, item)) is not _NO]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            return _NO
        _, item = typing.get_args(tp)
        return {str(k): got for k, v in value.items() if (got := _convert(v, item)) is not _NO}
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        got = as_int(value)
        return _NO if got is None else got
    if tp is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _NO
    if tp is str:
        text = as_str(value)
        return _NO if text is None else text
    raise TypeError(f"no decoding for field type {tp!r}")


def _empty(tp: Any) -> Any:
    """What a missing field of type ``tp`` decodes to, when it names nothing else."""
    origin = typing.get_origin(tp)
    if tp is Any or (origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)):
        return None
    if origin is list:
        return []
    if origin in (dict, Mapping):
        return {}
    return {bool: False, int: 0, float: 0.0, str: ""}[tp]


_SCHEMAS: dict[type[Event], list[tuple[str, str, Any, Any]]] = {}


def _schema(cls: type[Event]) -> list[tuple[str, str, Any, Any]]:
    """(attribute, JSON key, type, value when missing) of each of ``cls``'s line fields."""
    if cls not in _SCHEMAS:
        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            if f.name in ("ts", "extra"):
                continue
            tp = hints[f.name]
            if ABSENT in f.metadata:
                missing = f.metadata[ABSENT]
            elif f.default is not dataclasses.MISSING:
                missing = f.default
            else:
                missing = _empty(tp)
            out.append((f.name, f.metadata.get(JSON_KEY, f.name), tp, missing))
        _SCHEMAS[cls] = out
    return _SCHEMAS[cls]


def decode(obj: Mapping[str, Any]) -> Event:
    """The typed event of one log line (see the module docstring: unknown kinds, missing fields)."""
    name = obj.get("event")
    ts = obj.get("ts")
    stamp = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        return UnknownEvent(ts=stamp, name=str(name), raw=dict(obj))
    values: dict[str, Any] = {}
    known = {"ts", "event"}
    for attr, key, tp, missing in _schema(cls):
        known.add(key)
        got = _convert(obj[key], tp) if key in obj else _NO
        values[attr] = missing if got is _NO else got
    extra = {k: v for k, v in obj.items() if k not in known}
    return cls(ts=stamp, extra=extra, **values)


def from_fields(kind: str, fields: Mapping[str, Any]) -> Event:
    """The event ``kind`` with the line fields ``fields`` as a writer names them; ``TypeError`` for an
    unknown kind or a field the kind does not have (or lacks), so a renamed field fails loudly."""
    cls = REGISTRY.get(kind)
    if cls is None:
        raise TypeError(f"unknown event kind {kind!r}: add its class to nonstop/events.py")
    args: dict[str, Any] = {}
    by_key = {key: attr for attr, key, _, _ in _schema(cls)}
    for key, value in fields.items():
        if key not in by_key:
            raise TypeError(f"event {kind!r} has no field {key!r} (it has: {', '.join(by_key)})")
        args[by_key[key]] = value
    return cls(**args)
