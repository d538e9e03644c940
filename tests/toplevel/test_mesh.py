"""--mesh: parsing, the checks at start, rank <-> coordinates (pure)."""

from __future__ import annotations

import pytest

from nonstop.config import ElasticConfig, JobConfig
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec


def test_dims_nest_in_one_order_whatever_order_they_are_given() -> None:
    m = MeshSpec.parse("tp=2, replicate=2,shard=3")
    assert m.names == ("replicate", "shard", "tp") and m.shape == (2, 3, 2) and m.world_size == 12
    assert str(m) == "replicate=2,shard=3,tp=2" and MeshSpec.parse(str(m)) == m


def test_ranks_are_row_major_so_a_tp_group_is_consecutive() -> None:
    m = MeshSpec.parse("replicate=2,shard=2,tp=2")
    assert m.coords(0) == {"replicate": 0, "shard": 0, "tp": 0}
    assert m.coords(5) == {"replicate": 1, "shard": 0, "tp": 1}
    assert all(m.rank_of(m.coords(r)) == r for r in range(8))
    assert m.group_of(5, "tp") == [4, 5] and m.group_of(5, "shard") == [5, 7]
    assert m.group_of(5, "replicate") == [1, 5]
    # ranks of one TP group read the same batch
    assert [m.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3] and m.dp_size == 4
    hsdp = MeshSpec.parse("replicate=2,shard=2")
    assert hsdp.group_of(1, "shard") == [0, 1] and hsdp.group_of(1, "replicate") == [1, 3]
    assert hsdp.size("tp") == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("shard", "is not NAME=SIZE"),
        ("pp=2", "unknown dim 'pp'"),
        ("shard=2,shard=2", "given twice"),
        ("shard=two", "must be an integer"),
        ("shard=0", "at least 1"),
        ("", "is not NAME=SIZE"),
    ],
)
def test_a_malformed_mesh_is_refused_with_one_line(text: str, says: str) -> None:
    with pytest.raises(UsageError, match=says) as e:
        MeshSpec.parse(text)
    assert "\n" not in str(e.value)


def test_a_mesh_the_job_cannot_run_fails_at_start() -> None:
    ok = JobConfig(script="t.py", nproc_per_node=2, mesh="shard=2")
    assert ok.mesh == "shard=2"
    with pytest.raises(UsageError, match="has 3 ranks but the job has 2"):
        JobConfig(script="t.py", nproc_per_node=2, mesh="shard=3")
    with pytest.raises(UsageError, match="tp must divide --nproc-per-node"):
        JobConfig(
            script="t.py", nproc_per_node=2, nnodes=2, coordinator="127.0.0.1:1", mesh="replicate=1,tp=4"
        )
    with pytest.raises(UsageError, match="unknown dim"):
        JobConfig(script="t.py", nproc_per_node=2, mesh="dp=2")
    with pytest.raises(UsageError, match="has neither"):  # elastic: replica or shard groups to drop
        JobConfig(script="t.py", nproc_per_node=2, mesh="tp=2", elastic=ElasticConfig(min_world_size=1))


def test_a_moved_rank_changes_only_the_groups_it_is_in() -> None:
    spec = MeshSpec.parse("replicate=2,shard=2")  # shard {0,1} {2,3}, replicate {0,2} {1,3}
    assert spec.changed_groups([3]) == [("replicate", (1, 3)), ("shard", (2, 3))]
    assert spec.changed_groups([]) == []
    # a whole replica group coming back changes every replica group and its own shard group
    assert spec.changed_groups([2, 3]) == [("replicate", (0, 2)), ("replicate", (1, 3)), ("shard", (2, 3))]
