"""The simulator charges a boundary swap the rebuild of the groups it changes (MeshSpec.changed_groups)."""

from __future__ import annotations

import pytest

from nonstop.errors import UsageError
from nonstop.sim.api import JobSpec
from nonstop.sim.calibrate import rendezvous_s
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams, swap_rebuild_s
from nonstop.sim.strategies import TorchftLike


def test_a_data_parallel_swap_rebuilds_the_whole_job() -> None:
    job = JobSpec(num_gpus=16_384)
    assert swap_rebuild_s(job, 0) == rendezvous_s(2048)


def test_an_hsdp_swap_rebuilds_its_widest_changed_group_only() -> None:
    job = JobSpec(num_gpus=16_384)  # 2,048 nodes
    # replica groups of 16 nodes: the moved node's shard group spans 16 nodes, its ranks' replica
    # groups one node of each of the 128 replica groups
    assert swap_rebuild_s(job, 16) == rendezvous_s(128)
    assert swap_rebuild_s(job, 256) == rendezvous_s(256)  # 8 replica groups of 256 nodes
    ns = Nonstop(job=job, params=NonstopParams(replica_nodes=16, keep_on_failure=False))
    assert ns.swap_rebuild < ns.rebuild  # a failure that keeps nothing rebuilds every group
    assert ns.migration < Nonstop(job=job, params=NonstopParams(replica_nodes=0)).migration


def test_replica_groups_must_divide_the_job() -> None:
    with pytest.raises(UsageError, match="--replica-nodes"):
        swap_rebuild_s(JobSpec(num_gpus=16_384), 3)


def test_keeping_groups_on_failure_charges_a_failure_what_a_swap_changes() -> None:
    """The runtime keeps a failure's untouched groups (train/settle.py, train/devicegroups.py,
    whose unbound world costs no communicator), and so does the simulator by default; asked
    not to, it charges a failure every group."""
    job = JobSpec(num_gpus=16_384)
    every = Nonstop(job=job, params=NonstopParams(replica_nodes=16, keep_on_failure=False))
    keep = Nonstop(job=job, params=NonstopParams(replica_nodes=16))
    assert every.rebuild == rendezvous_s(2048) and keep.rebuild == keep.swap_rebuild == rendezvous_s(128)
    # data-parallel: one group of the whole job, whatever the setting
    dp = NonstopParams(replica_nodes=0, keep_on_failure=True)
    assert Nonstop(job=job, params=dp).rebuild == rendezvous_s(2048)


def test_by_default_the_job_is_the_one_torchft_like_models() -> None:
    """Side by side, both strategies are charged for the same job: model copies of torchft-like's
    replica groups (16 nodes, fewer where 16 does not divide the job), also through the CLI's
    ``--group-nodes``."""
    for gpus in (16_384, 1024, 64, 8):
        job = JobSpec(num_gpus=gpus)
        assert Nonstop(job=job).replica_nodes == TorchftLike(job=job).group_nodes == min(16, job.num_nodes)
    big = JobSpec(num_gpus=16_384)
    assert Nonstop(job=big).rebuild == rendezvous_s(128)  # one rank of each of the 128 model copies
    assert Nonstop(job=big).describe()["replica_nodes"] == 16
