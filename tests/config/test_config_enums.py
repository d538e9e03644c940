"""The job config's closed sets are enums (nonstop/config/): a string from a flag, a TOML file or
JSON becomes its member, a value outside the set fails at start in one line (exit 2 from the CLI),
and the JSON the launcher hands the coordinator process reads back as before."""

from __future__ import annotations

import enum
import json

import pytest

from nonstop.cli import build_parser, main
from nonstop.config import (
    JobConfig,
    OperationsConfig,
    ShrinkBatch,
    SnapshotConfig,
    SnapshotCopies,
    SnapshotMode,
    SurvivorMode,
    SwapTransfer,
    job_config_from_flat,
    job_config_from_json,
    job_config_to_flat,
    job_config_to_json,
)
from nonstop.errors import UsageError

CLOSED: list[tuple[str, type[enum.StrEnum], str]] = [
    ("snapshot", SnapshotMode, "--snapshot"),
    ("snapshot_copies", SnapshotCopies, "--snapshot-copies"),
    ("survivors", SurvivorMode, "--survivors"),
    ("shrink_batch", ShrinkBatch, "--shrink-batch"),
    ("swap_transfer", SwapTransfer, "--swap-transfer"),
]


@pytest.mark.parametrize(("name", "kind", "flag"), CLOSED)
def test_a_string_becomes_its_member_and_a_bad_one_fails_in_one_line(
    name: str, kind: type[enum.StrEnum], flag: str
) -> None:
    last = list(kind)[-1]
    extra = {"min_world_size": 1, "nproc_per_node": 2} if last in ("continue", "drop") else {}
    cfg = job_config_from_flat({"script": "x.py", **{name: last.value}, **extra})
    assert job_config_to_flat(cfg)[name] is last
    with pytest.raises(UsageError) as e:
        job_config_from_flat({"script": "x.py", **{name: "bogus"}})
    values = ", ".join(m.value for m in kind)
    assert str(e.value) == f"{flag} must be one of {values} (got 'bogus')"


@pytest.mark.parametrize(("name", "kind", "flag"), CLOSED)
def test_each_flags_choices_are_its_enums_values_in_order(
    name: str, kind: type[enum.StrEnum], flag: str
) -> None:
    _, parsers = build_parser()
    action = next(a for a in parsers["run"]._actions if flag in a.option_strings)
    assert list(action.choices or ()) == [m.value for m in kind]
    assert action.default == job_config_to_flat(JobConfig(script="x.py"))[name]


def test_the_json_keeps_the_strings_and_todays_records_read_back() -> None:
    cfg = JobConfig(
        script="x.py",
        snapshot=SnapshotConfig(mode="sync", copies="rank"),
        operations=OperationsConfig(swap_transfer="whole"),
    )  # type: ignore[arg-type]
    doc = json.loads(job_config_to_json(cfg))
    assert (doc["snapshot"], doc["snapshot_copies"], doc["swap_transfer"]) == ("sync", "rank", "whole")
    assert (doc["survivors"], doc["shrink_batch"]) == ("auto", "keep")
    back = job_config_from_json(json.dumps(doc))  # what a launcher of today writes: plain strings
    assert job_config_to_json(back) == job_config_to_json(cfg)
    assert back.snapshot.mode is SnapshotMode.SYNC and back.elastic.survivors is SurvivorMode.AUTO


def test_a_bad_value_from_the_environment_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NONSTOP_SHRINK_BATCH", "half")
    assert main(["run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err == "nonstop: error: $NONSTOP_SHRINK_BATCH='half': one of keep, drop\n"


def test_a_bad_value_in_the_config_record_is_one_line() -> None:
    doc = json.loads(job_config_to_json(JobConfig(script="x.py")))
    with pytest.raises(
        UsageError, match=r"^--survivors must be one of auto, wait, continue \(got 'later'\)$"
    ):
        job_config_from_json(json.dumps({**doc, "survivors": "later"}))
