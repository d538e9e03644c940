"""Which checkpoints to delete after a commit: a pure policy (no I/O, no clock, any thread).

After checkpoint ``current`` is committed, a step directory survives when it is
- among the ``keep`` newest committed checkpoints no newer than ``current`` (``current``
  itself always is), or
- a base that one of those needs (a rank of it is a delta against that step).
Everything else goes: older checkpoints, abandoned (uncommitted) directories, and every
directory newer than ``current`` (a superseded timeline: training resumed from an older
step and committed ``current`` again after it).

The caller reads the manifests of :func:`kept` only, then asks :func:`to_delete`; deletion
goes in the order returned (newest first: a dependent before its base).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

__all__ = ["kept", "to_delete"]


def kept(committed: Iterable[int], current: int, keep: int) -> set[int]:
    """The checkpoints kept for their own sake: the ``keep`` newest of ``committed`` that are
    no newer than ``current``, and ``current``."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep})")
    eligible = sorted((s for s in committed if s <= current), reverse=True)
    return set(eligible[:keep]) | {current}


def to_delete(
    present: Iterable[int],
    committed: Collection[int],
    current: int,
    keep: int,
    bases: Mapping[int, Iterable[int]],
) -> list[int]:
    """The step directories to delete, newest first.

    ``present``: every step directory; ``committed``: those with a manifest; ``bases``: for
    each kept step (see :func:`kept`), the base steps its ranks need (a kept step missing
    from it, e.g. one whose manifest is unreadable, needs none)."""
    needed = kept(committed, current, keep)
    for s in list(needed):
        needed.update(bases.get(s, ()))
    return [s for s in sorted(set(present), reverse=True) if s not in needed]
