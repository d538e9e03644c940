"""Events only the event hook's feed carries (``Session.on_event``), never the job's log: a line per
step would drown the log, but a logger wants the committed step as it moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from nonstop.events.base import Event

__all__ = ["Committed"]


@dataclass(frozen=True, kw_only=True)
class Committed(Event):
    """The committed step (every rank can restore it) moved to ``step`` in ``generation``, with
    ``world_size`` ranks. Sent at most once per the feed's interval (1 s), only when it moved."""

    kind: ClassVar[str] = "committed"
    step: int
    generation: int
    world_size: int
