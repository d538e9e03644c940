"""The durable tier's retention policy (nonstop.snapshot.durable.retention), pure: a table of
step directories, what is committed, the step just committed, keep and the delta bases, and
what the writer could not tell (uncertain) or declared of a timeline it left (superseded)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from nonstop.snapshot.durable.retention import kept, survivors, to_delete

# name: (present, committed, current, keep, bases of each step (None: unreadable), expected
# deletions newest first[, uncertain, superseded])
Case = (
    tuple[list[int], list[int], int, int, Mapping[int, list[int] | None], list[int]]
    | tuple[list[int], list[int], int, int, Mapping[int, list[int] | None], list[int], list[int], list[int]]
)
CASES: dict[str, Case] = {
    "nothing to delete": ([10, 20], [10, 20], 20, 3, {}, []),
    "keep the newest full checkpoints": ([10, 20, 30, 40], [10, 20, 30, 40], 40, 2, {}, [20, 10]),
    "keep one": ([1, 2, 3], [1, 2, 3], 3, 1, {}, [2, 1]),
    "a kept delta's base stays": (
        [50, 60, 70, 80],
        [50, 60, 70, 80],
        80,
        2,
        {60: [50], 70: [50], 80: [50]},
        [60],
    ),
    "a base is kept once, for every kept dependent": (
        [10, 20, 30, 40, 50],
        [10, 20, 30, 40, 50],
        50,
        2,
        {40: [10], 50: [30]},
        [20],
    ),
    "a dropped delta's base goes too": ([50, 60, 90, 100], [50, 60, 90, 100], 100, 2, {60: [50]}, [60, 50]),
    "bases of steps not kept do not count": ([10, 20, 30], [10, 20, 30], 30, 1, {20: [10]}, [20, 10]),
    "abandoned (uncommitted) directories older than current go": ([10, 15, 20], [10, 20], 20, 3, {}, [15]),
    "an uncommitted directory newer than current stays (maybe being written)": (
        [10, 20, 30, 40],
        [10, 20, 30],
        30,
        3,
        {},
        [],
    ),
    "an abandoned directory does not count toward keep": ([10, 15, 20], [10, 20], 20, 2, {}, [15]),
    "a newer committed checkpoint stays: not ours to judge": (
        [10, 20, 25, 30],
        [10, 20, 25, 30],
        25,
        3,
        {},
        [],
    ),
    "a newer checkpoint that stays keeps its base": (
        [5, 10, 20, 30],
        [5, 10, 20, 30],
        20,
        1,
        {30: [5]},
        [10],
    ),
    "a declared superseded timeline (newer than current) goes": (
        [10, 20, 25, 30, 40],
        [10, 20, 25, 30],
        25,
        3,
        {},
        [40, 30],
        [],
        [30, 40],
    ),
    "only what was declared superseded goes, not what came later": (
        [10, 20, 25, 30, 50],
        [10, 20, 25, 30, 50],
        25,
        3,
        {},
        [30],
        [],
        [30],
    ),
    "a superseded checkpoint older than current goes and does not count toward keep": (
        [10, 20, 25, 30, 35],
        [10, 20, 25, 30, 35],
        35,
        2,
        {},
        [25, 20, 10],
        [],
        [25],
    ),
    "a superseded base still needed by a kept checkpoint stays": (
        [10, 20, 25, 30],
        [10, 20, 25, 30],
        30,
        2,
        {30: [25]},
        [10],
        [],
        [25],
    ),
    "an uncertain directory stays, and everything older": (
        [10, 20, 30, 40, 50],
        [10, 20, 40, 50],
        50,
        2,
        {},
        [],
        [30],
        [],
    ),
    "an uncertain directory blocks only what is older": (
        [10, 20, 30, 40, 50, 60],
        [10, 20, 30, 40, 50, 60],
        60,
        1,
        {},
        [50, 40],
        [30],
        [],
    ),
    "an uncertain superseded directory stays": (
        [10, 20, 30],
        [10, 20],
        20,
        3,
        {},
        [],
        [30],
        [30],
    ),
    "an unreadable manifest of a kept checkpoint keeps everything older": (
        [10, 20, 30, 40],
        [10, 20, 30, 40],
        40,
        1,
        {40: None},
        [],
    ),
    "an unreadable manifest keeps only what is older": (
        [10, 20, 30, 40, 50],
        [10, 20, 30, 40, 50],
        50,
        2,
        {40: None, 50: [30]},
        [],
    ),
    "an unreadable newer checkpoint keeps everything older": (
        [10, 20, 30],
        [10, 20, 30],
        20,
        1,
        {30: None},
        [],
    ),
    "a kept checkpoint missing from bases needs none": ([10, 20, 30], [10, 20, 30], 30, 2, {}, [10]),
    "current without a manifest listed is still kept": ([10, 20], [10], 20, 1, {20: [10]}, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_to_delete(name: str) -> None:
    case = CASES[name]
    present, committed, current, keep, bases, expected = case[:6]
    uncertain, superseded = (case[6], case[7]) if len(case) == 8 else ([], [])
    policy = {"uncertain": uncertain, "superseded": superseded}
    doomed = to_delete(present, committed, current, keep, bases, **policy)
    assert doomed == expected
    left = set(present) - set(doomed)
    # invariants over every case
    assert current not in doomed
    assert doomed == sorted(doomed, reverse=True)  # dependents (newer) before their bases
    assert not set(doomed) & set(uncertain)
    assert all(s < current or s in superseded for s in doomed)  # nothing newer unless declared
    assert survivors(present, committed, current, keep, **policy) <= left | {current}
    for s in left:
        needs = bases.get(s, ())
        if needs is None or s in uncertain:  # unknown needs: nothing older went
            assert all(d > s for d in doomed), f"step {s}'s needs are unknown, yet older went"
        else:
            assert set(needs) <= left, f"a base of surviving step {s} was deleted"
    eligible = sorted((s for s in committed if s <= current and s not in superseded), reverse=True)
    assert set(eligible[:keep]) <= left  # the keep newest committed chains survive


def test_kept() -> None:
    assert kept([10, 20, 30, 40], 40, 2) == {30, 40}
    assert kept([10, 20, 30, 40], 20, 3) == {10, 20}  # never a step newer than current
    assert kept([], 5, 3) == {5}  # the step just committed, even before it is listed
    assert kept([5, 1, 3], 5, 2) == {5, 3}  # any order in
    with pytest.raises(ValueError, match="keep"):
        kept([1], 1, 0)


def test_inputs_are_not_modified() -> None:
    present, committed, bases = [10, 20, 30], [10, 20, 30], {30: [10]}
    assert to_delete(present, committed, 30, 1, bases) == [20]
    assert present == [10, 20, 30] and committed == [10, 20, 30] and bases == {30: [10]}


def test_survivors() -> None:
    """The committed checkpoints whose manifests the caller reads: kept ones, newer ones."""
    assert survivors([10, 20, 30, 40], [10, 20, 30, 40], 30, 2) == {20, 30, 40}
    assert survivors([10, 20, 30, 40], [10, 20, 30, 40], 30, 2, superseded=[40]) == {20, 30}
    assert survivors([10, 15, 20], [10, 20], 20, 3) == {10, 20}  # not the uncommitted 15
    assert survivors([10, 20, 30], [10, 30], 30, 1, uncertain=[20]) == {30}
