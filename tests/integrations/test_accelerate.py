"""nonstop.integrations.accelerate in one process (a 1-rank gloo group standing for nonstop's): the
Accelerator refuses to exist without the process group and refuses a comm hook of the script's
own; the DDP wrapper it prepares carries nonstop's canonical gradient sync; and
register_canonical_hook refuses a wrapper whose buckets cannot hold every gradient, and its
allreduce in flight counts as a collective for the heartbeat."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nonstop.errors import UsageError
from nonstop.train.collectives import in_collective
from nonstop.train.ddp import register_canonical_hook

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType

from nonstop.integrations.accelerate import Accelerator


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A default process group as nonstop makes it (gloo on its own store), torchrun's variables."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",  # nonstop's coordinator: never a TCPStore
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # else Accelerate sets this process's threads
    }.items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def test_an_accelerator_needs_nonstops_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(UsageError, match="inside `with step:`"):
        Accelerator()


def test_the_prepared_model_reduces_in_canonical_order_in_each_generation(group: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # a generation, its group destroyed and made again, a new Accelerator
        accelerator = Accelerator()
        assert accelerator.num_processes == 1 and accelerator.distributed_type == DistributedType.MULTI_CPU
        ddp, ddp_opt = accelerator.prepare(model, opt)
        assert isinstance(ddp, DistributedDataParallel) and ddp.module is model
        assert "CanonicalGradSync" in str(ddp._get_ddp_logging_data().get("comm_hook"))
        accelerator.backward(ddp(torch.randn(3, 4)).sum())
        ddp_opt.step()
        ddp_opt.zero_grad()
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_a_comm_hook_of_the_script_excludes_the_deterministic_sync(group: None) -> None:
    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(UsageError, match="deterministic=False"):
        Accelerator(kwargs_handlers=[hook])
    Accelerator(kwargs_handlers=[hook], deterministic=False)


def test_register_canonical_hook_needs_one_bucket(group: None) -> None:
    big = torch.nn.Linear(1024, 512)  # 2 MiB of float32 gradients
    with pytest.raises(ValueError, match="bucket_cap_mb=3 or more"):
        register_canonical_hook(DistributedDataParallel(big))  # default: a 1 MiB first bucket
    with pytest.raises(ValueError, match="bucket_cap_mb=3 or more"):
        register_canonical_hook(DistributedDataParallel(big, bucket_cap_mb=1))
    ddp = DistributedDataParallel(big, bucket_cap_mb=3)
    sync = register_canonical_hook(ddp)
    ddp(torch.randn(2, 1024)).sum().backward()
    assert sync.flat.numel() == sum(p.numel() for p in big.parameters())


def test_a_framework_wrappers_allreduce_in_flight_counts_as_in_a_collective(group: None) -> None:
    """A framework's DDP blocks in C++ under autograd's frames: the heartbeat still reports the
    rank as waiting on a peer, so the no-progress rule blames the peer (as for nonstop's DDP)."""
    sync = register_canonical_hook(DistributedDataParallel(torch.nn.Linear(4, 1), bucket_cap_mb=1))
    me = threading.get_ident()
    assert not in_collective(me)
    sync.pending_since = time.monotonic()  # what the hook stamps until the allreduce completes
    assert in_collective(me)
    sync.pending_since = None
    assert not in_collective(me)
