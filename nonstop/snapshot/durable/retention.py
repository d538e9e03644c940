"""Which checkpoints to delete after a commit: a pure policy (no I/O, no clock, any thread).

After checkpoint ``current`` is committed, a step directory is deleted only when it is one of
- a committed checkpoint older than ``current`` that is not among the ``keep`` newest committed
  ones no newer than ``current`` (``current`` itself always is one);
- an abandoned directory: older than ``current``, no manifest (the caller looks twice before
  it deletes one, and passes one it saw committed as ``uncertain`` until a later pass finds
  its manifest still gone);
- a directory of a superseded timeline: the writer resumed from an older step and declared
  every directory newer than that step at the time (``superseded``), none of which it wrote.
and no directory is deleted that a surviving checkpoint may need:
- the bases of every surviving committed checkpoint (a rank of it is a delta against that
  step), and
- every step older than a surviving directory whose needs are unknown: an ``uncertain`` one
  (its manifest could not be probed, or it vanished from one the writer saw committed) or a
  committed one whose manifest could not be read (``bases[s] is None``). An unreadable
  manifest never leads to a deletion in the same pass.

Never deleted, whatever else holds: ``current``; a directory newer than ``current`` that is not
declared superseded (another writer's checkpoint, an older run's the job did not resume from,
one being written); anything ``uncertain``.

The caller reads the manifests of the surviving committed checkpoints (see :func:`survivors`),
then asks :func:`to_delete`; deletion goes in the order returned (newest first: a dependent
before its base).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

__all__ = ["kept", "survivors", "to_delete"]


def kept(committed: Iterable[int], current: int, keep: int) -> set[int]:
    """The checkpoints kept for their own sake: the ``keep`` newest of ``committed`` that are
    no newer than ``current``, and ``current``."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (got {keep})")
    eligible = sorted((s for s in committed if s <= current), reverse=True)
    return set(eligible[:keep]) | {current}


def _candidates(
    present: Collection[int],
    committed: Collection[int],
    current: int,
    keep: int,
    uncertain: Collection[int],
    superseded: Collection[int],
) -> set[int]:
    """What goes before the needs of the survivors are counted."""
    heads = kept((s for s in committed if s not in superseded), current, keep)
    return {
        s
        for s in present
        if s not in heads and s not in uncertain and (s < current or s in superseded) and s != current
    }


def survivors(
    present: Iterable[int],
    committed: Iterable[int],
    current: int,
    keep: int,
    *,
    uncertain: Iterable[int] = (),
    superseded: Iterable[int] = (),
) -> set[int]:
    """The committed checkpoints that survive for their own sake: the ones whose manifests
    the caller reads to learn the bases they need (see :func:`to_delete`)."""
    present_s, committed_s = set(present), set(committed)
    doomed = _candidates(present_s, committed_s, current, keep, set(uncertain), set(superseded))
    return {s for s in present_s & committed_s if s not in doomed} | {current}


def to_delete(
    present: Iterable[int],
    committed: Iterable[int],
    current: int,
    keep: int,
    bases: Mapping[int, Iterable[int] | None],
    *,
    uncertain: Iterable[int] = (),
    superseded: Iterable[int] = (),
) -> list[int]:
    """The step directories to delete, newest first.

    ``present``: every step directory; ``committed``: those with a manifest; ``uncertain``:
    those whose manifest's presence is unknown (never deleted; nothing older either);
    ``superseded``: the directories of a timeline the writer resumed away from; ``bases``: for
    each of :func:`survivors`, the base steps its ranks need, or None when its manifest could
    not be read (nothing older is deleted). A survivor missing from ``bases`` needs none."""
    present_s, committed_s = set(present), set(committed)
    uncertain_s, superseded_s = set(uncertain), set(superseded)
    doomed = _candidates(present_s, committed_s, current, keep, uncertain_s, superseded_s)
    alive = (present_s | {current}) - doomed
    floor = -1  # every step below it is needed: some survivor's needs are unknown
    for s in alive:
        if s in uncertain_s:
            needs: Iterable[int] | None = None
        elif s in committed_s or s == current:
            needs = bases.get(s, ())
        else:  # newer than current, no manifest: nothing of it is committed to need anything
            needs = ()
        if needs is None:
            floor = max(floor, s)
        else:
            doomed.difference_update(needs)
    return [s for s in sorted(doomed, reverse=True) if s >= floor]
