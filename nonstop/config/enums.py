"""The job config's closed sets, each a :class:`enum.StrEnum` whose values are its flag's choices,
and :func:`member`, which turns a flag's, a TOML file's or a record's string into a member (one
line naming the flag for a value outside the set)."""

from __future__ import annotations

import enum
from typing import TypeVar

from nonstop.errors import UsageError
from nonstop.policy.survivors import SurvivorMode  # the elastic policy's own closed set

__all__ = [
    "SHRINK_BATCHES",
    "SNAPSHOT_COPIES",
    "SNAPSHOT_MODES",
    "SURVIVOR_MODES",
    "SWAP_TRANSFERS",
    "ShrinkBatch",
    "SnapshotCopies",
    "SnapshotMode",
    "SurvivorMode",
    "SwapTransfer",
    "member",
]


class SnapshotMode(enum.StrEnum):
    """``--snapshot``: how each step's state is captured."""

    OVERLAPPED = "overlapped"  # copied out while the next step runs
    SYNC = "sync"  # copied out before the next step starts
    OFF = "off"  # not captured


class SnapshotCopies(enum.StrEnum):
    """``--snapshot-copies``: where the state a node's ranks hold alike lives in its memory tier."""

    NODE = "node"  # one copy per node (snapshot/nodecopy.py)
    RANK = "rank"  # every rank its own whole copy


class SwapTransfer(enum.StrEnum):
    """``--swap-transfer``: how a live migration's swap brings the boundary step to the joiner
    (policy/migration.py: swap_as_delta)."""

    AUTO = "auto"  # a delta when the catch-up measured deltas faster
    DELTA = "delta"
    WHOLE = "whole"


class ShrinkBatch(enum.StrEnum):
    """``--shrink-batch``: what a shrunk job trains on (policy/elastic.py: play_shards)."""

    KEEP = "keep"  # the global batch: the lost ranks' shards played by the others (bitwise)
    DROP = "drop"  # the lost ranks' shares dropped until the job grows back (torchft's)


# each closed set's values, in order: the flags' choices (and so their help and errors)
SNAPSHOT_MODES = tuple(m.value for m in SnapshotMode)
SNAPSHOT_COPIES = tuple(m.value for m in SnapshotCopies)
SWAP_TRANSFERS = tuple(m.value for m in SwapTransfer)
SURVIVOR_MODES = tuple(m.value for m in SurvivorMode)  # policy/survivors.py
SHRINK_BATCHES = tuple(m.value for m in ShrinkBatch)

_E = TypeVar("_E", bound=enum.StrEnum)


def member(kind: type[_E], value: object, flag: str) -> _E:
    """``value`` (a member or its string, as a flag, a TOML file or JSON gives it) as a member of
    ``kind``; UsageError (one line naming ``flag`` and the values it takes) when it is none."""
    try:
        return kind(str(value))
    except ValueError:
        raise UsageError(f"{flag} must be one of {', '.join(kind)} (got {value!r})") from None


def set_members(config: object, closed: tuple[tuple[str, type[enum.StrEnum], str], ...]) -> None:
    """Each ``(field, kind, flag)`` of the frozen dataclass ``config`` as its member (a caller, a
    TOML file or JSON may give the string); UsageError, one line, for a value outside it. For the
    configs' ``__post_init__``."""
    for name, kind, flag in closed:
        object.__setattr__(config, name, member(kind, getattr(config, name), flag))
