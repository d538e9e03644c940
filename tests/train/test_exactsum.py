"""The exact gradient mean of an elastic job: bitwise the same at every world size, on real gloo
groups (one process per rank), through ``exact_mean`` itself and through DDP with the canonical
sync -- both the per-shard path (``shard_steps``) and the comm hook (one shard per rank)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nonstop.policy.elastic import assign_shards

NUM_SHARDS = 4

_WORKER = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from nonstop.policy.elastic import assign_shards
from nonstop.train.ddp import CanonicalGradSync, wrap_ddp
from nonstop.train.exactsum import exact_mean

rdzv, out, path = sys.argv[1], sys.argv[5], sys.argv[6]
rank, world, num_shards = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method="file://" + rdzv, rank=rank, world_size=world)
group = dist.group.WORLD
shards = assign_shards(num_shards, world)[rank]

def grad_of(shard):  # values whose sum depends on the order of addition
    g = torch.Generator().manual_seed(1000 + shard)
    return torch.randn(1001, generator=g) * 10.0 ** torch.randint(-6, 6, (1001,), generator=g)

parts = torch.stack([grad_of(k) for k in shards])
mean = exact_mean(parts, shards=shards, num_shards=num_shards, group=group)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
sync = CanonicalGradSync(model)
sync.exact = True
sync.set_shards(shards, num_shards)
ddp = wrap_ddp(model, sync, group)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    opt.zero_grad()
    def batch(shard):
        g = torch.Generator().manual_seed(step * 100 + shard)
        return torch.randn(5, 7, generator=g), torch.randn(5, 3, generator=g)
    if world == num_shards and path == "hook":
        x, y = batch(shards[0])
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    else:
        for shard in sync.accumulate(ddp):
            x, y = batch(shard)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
json.dump({"mean": hashlib.sha256(mean.numpy().tobytes()).hexdigest(), "params": h.hexdigest(),
           "ref": [float(v) for v in mean[:3]]}, open(out, "w"))
# every rank done with its last collective, then leave without gloo's and DDP's native teardown:
# a rank destroying its group while a peer finished the all-gather's last transfer, or the DDP
# reducer outliving the group at interpreter exit, aborted a loaded machine's run (SIGABRT,
# "terminate called without an active exception"); this test checks the sums, not the teardown
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


def _run(tmp_path: Path, world: int, path: str = "shards") -> list[dict[str, object]]:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    rdzv = tmp_path / f"rdzv-{world}-{path}"
    outs = [tmp_path / f"out-{world}-{path}-{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rdzv), str(r), str(world), str(NUM_SHARDS), str(outs[r]), path]
        )
        for r in range(world)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    return [json.loads(o.read_text()) for o in outs]


def _sequential_mean() -> torch.Tensor:
    parts = []
    for shard in range(NUM_SHARDS):
        g = torch.Generator().manual_seed(1000 + shard)
        parts.append(torch.randn(1001, generator=g) * 10.0 ** torch.randint(-6, 6, (1001,), generator=g))
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc.div_(NUM_SHARDS)


def test_the_mean_and_the_trained_weights_are_bitwise_equal_at_every_world_size(tmp_path: Path) -> None:
    results = {
        (w, path): _run(tmp_path, w, path)
        for w, path in ((4, "hook"), (4, "shards"), (3, "shards"), (2, "shards"), (1, "shards"))
    }
    expected = hashlib.sha256(_sequential_mean().numpy().tobytes()).hexdigest()
    means = {key: {r["mean"] for r in rs} for key, rs in results.items()}
    assert all(m == {expected} for m in means.values()), means
    params = {key: {r["params"] for r in rs} for key, rs in results.items()}
    assert len(set().union(*params.values())) == 1, params
    # the order matters for these values: a pairwise sum differs in the last bits
    parts = torch.stack(
        [
            torch.randn(1001, generator=g) * 10.0 ** torch.randint(-6, 6, (1001,), generator=g)
            for g in (torch.Generator().manual_seed(1000 + s) for s in range(NUM_SHARDS))
        ]
    )
    other = ((parts[0] + parts[1]) + (parts[2] + parts[3])) / NUM_SHARDS
    assert not torch.equal(other, _sequential_mean())


def test_a_rank_with_the_wrong_shards_is_refused() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nonstop.train.exactsum import exact_mean

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        assert assign_shards(4, 2)[1] == (2, 3)
        with pytest.raises(RuntimeError, match=r"plays shards \[1, 2\], expected \[2, 3\]"):
            exact_mean(torch.zeros(2, 5), shards=(1, 2), num_shards=4, group=dist.group.WORLD)
        with pytest.raises(ValueError, match="one row per shard"):
            exact_mean(torch.zeros(1, 5), shards=(2, 3), num_shards=4, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
