"""The durable tier's retention policy (nonstop.snapshot.durable.retention), pure: a table of
step directories, what is committed, the step just committed, keep and the delta bases."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from nonstop.snapshot.durable.retention import kept, to_delete

# name: (present, committed, current, keep, bases of each step, expected deletions newest first)
Case = tuple[list[int], list[int], int, int, Mapping[int, list[int]], list[int]]
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
    "abandoned (uncommitted) directories go": ([10, 20, 30, 40], [10, 20, 30], 30, 3, {}, [40]),
    "an abandoned directory does not count toward keep": ([10, 15, 20], [10, 20], 20, 2, {}, [15]),
    "a superseded timeline (newer than current) goes": (
        [10, 20, 25, 30, 40],
        [10, 20, 25, 30],
        25,
        3,
        {},
        [40, 30],
    ),
    "a newer step goes, bases and all": (
        [10, 20, 30],
        [10, 20, 30],
        20,
        3,
        {30: [10]},
        [30],
    ),
    "an unreadable kept checkpoint needs no base": ([10, 20, 30], [10, 20, 30], 30, 2, {}, [10]),
    "current without a manifest listed is still kept": ([10, 20], [10], 20, 1, {20: [10]}, []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_to_delete(name: str) -> None:
    present, committed, current, keep, bases, expected = CASES[name]
    doomed = to_delete(present, committed, current, keep, bases)
    assert doomed == expected
    survivors = set(present) - set(doomed)
    # invariants over every case
    assert current not in doomed
    assert doomed == sorted(doomed, reverse=True)  # dependents (newer) before their bases
    for s in survivors & kept(committed, current, keep):
        assert set(bases.get(s, ())) <= survivors, f"a base of kept step {s} was deleted"
    eligible = sorted((s for s in committed if s <= current), reverse=True)
    assert set(eligible[:keep]) <= survivors  # the keep newest committed chains survive


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
