"""One error hierarchy for nonstop.

Every error nonstop raises on purpose derives from :class:`NonstopError`. User
mistakes (bad CLI input, bad config) are :class:`UsageError`: their message is
one line that says what to do, and the CLI prints it without a traceback.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "ControlError",
    "FencedError",
    "JobFailedError",
    "NonstopError",
    "SnapshotCorruptError",
    "SnapshotError",
    "SnapshotMissingError",
    "UsageError",
]


class NonstopError(Exception):
    """Base of every error nonstop raises on purpose."""


class UsageError(NonstopError, ValueError):
    """A user mistake: bad flag, bad fault spec, unwritable job dir, busy port.

    The message is a single line that tells the user what to do instead. ``reported``: the
    launcher has the line and prints it (a worker's mistake that failed the job), so the process
    that raised it prints nothing of its own (the line once, not once per rank).
    """

    reported: bool = False


class SnapshotError(NonstopError):
    """A snapshot could not be written or read (layout mismatch, bad header)."""


class SnapshotMissingError(SnapshotError):
    """No complete snapshot of the requested step exists for this rank."""


class SnapshotCorruptError(SnapshotError):
    """Stored snapshot bytes fail their checksum, are truncated, or their manifest is missing
    or malformed. The message is one line naming what is bad and where; readers skip to the
    next good snapshot instead of loading it."""


class ControlError(NonstopError):
    """The control channel between a worker and the coordinator failed."""


class AuthError(ControlError):
    """A peer failed the per-job secret handshake; the connection was refused."""


class FencedError(ControlError):
    """A message came from an older generation than the current one and was refused."""


class JobFailedError(NonstopError):
    """The job could not continue (restart budget exhausted, no way to recover)."""
