"""The rank's place in its generation (train/membership.py): what a reconfigure sets, and the
mesh coordinates a script reads."""

from __future__ import annotations

import os

from nonstop.train.membership import Membership
from tests.worker_fakes import order


def test_a_spare_plays_nothing_until_its_first_generation() -> None:
    m = Membership(None)
    assert (m.rank, m.world_size, m.shards, m.num_shards, m.shards_played) == (0, 0, (), 0, 0)
    assert m.mesh is None and m.dp_size == 0


def test_a_full_size_generation_plays_its_own_shard_and_sets_torchruns_variables() -> None:
    m = Membership(None)
    m.apply(
        order({"t": "reconfigure", "rank": 2, "world_size": 3, "env": {"LOCAL_RANK": "0", "GROUP_RANK": "2"}})
    )
    assert (m.rank, m.world_size, m.shards, m.num_shards, m.shards_played) == (2, 3, (2,), 3, 3)
    assert (m.dp_rank, m.dp_size) == (2, 3)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["GROUP_RANK"]) == ("2", "3", "2")
    assert (os.environ["ROLE_RANK"], os.environ["ROLE_WORLD_SIZE"]) == ("2", "3")


def test_a_shrunk_generation_plays_the_lost_ranks_shards_and_divides_by_those_played() -> None:
    m = Membership(None)
    m.apply(
        order(
            {"t": "reconfigure", "rank": 0, "world_size": 2, "shards": [0, 2], "num_shards": 3, "divisor": 2}
        )
    )
    assert (m.shards, m.num_shards, m.shards_played) == ((0, 2), 3, 2)
    m.apply(
        order({"t": "reconfigure", "rank": 1, "world_size": 3})
    )  # grown back: the message's defaults again
    assert (m.shards, m.num_shards, m.shards_played) == ((1,), 3, 3)


def test_a_mesh_job_reads_its_data_parallel_coordinates_from_the_generations_mesh() -> None:
    m = Membership("shard=2,tp=2")  # TP groups {0,1}, {2,3} read one batch each
    assert m.mesh is not None and m.mesh.world_size == 4  # before any generation: the job's
    m.apply(order({"t": "reconfigure", "rank": 3, "world_size": 4}))
    assert (m.dp_rank, m.dp_size) == (1, 2)
    m.apply(order({"t": "reconfigure", "rank": 1, "world_size": 2}))  # an elastic shrink to one TP group
    assert m.mesh is not None and m.mesh.world_size == 2 and (m.dp_rank, m.dp_size) == (0, 1)
