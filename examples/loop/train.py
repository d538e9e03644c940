"""A torchrun-style training script with only the nonstop lines added (marked ``# nonstop``).

    nonstop run --nproc-per-node 3 --spares 1 --fail kill:rank=1,step=20 examples/loop/train.py

It trains a small regression model on a synthetic data set with AdamW, a cosine LR schedule and a
``StatefulDataLoader`` over a ``DistributedSampler``; rank 0 prints a hash of the final weights,
which is the same with or without the injected failure (``--out FILE`` also writes it there).
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import nonstop  # nonstop


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    x = torch.randn(512, 16)
    dataset = TensorDataset(x, x @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loss_fn = torch.nn.MSELoss()

    session = nonstop.init()  # nonstop: a hot spare waits here until it is given a rank
    sampler = DistributedSampler(dataset, num_replicas=session.world_size, rank=session.rank, seed=1)
    batches = nonstop.Batches(  # nonstop: an endless iterator whose position is restored
        StatefulDataLoader(dataset, batch_size=16, sampler=sampler), on_epoch=sampler.set_epoch
    )

    state = {"sched": sched, "data": batches}  # anything with state_dict()/load_state_dict()
    for step in session.steps(args.steps, model=model, optimizer=opt, state=state):  # nonstop
        with step:  # nonstop: a failure in here is recovered; the loop goes on at the committed step
            xb, yb = next(batches)
            loss = loss_fn(step.model(xb), yb)  # step.model: this generation's DDP-wrapped model
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step.loss = loss.item()

    if session.rank == 0:
        digest = weights_hash(model)
        print(f"final weights {digest} after {args.steps} steps", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(digest)
    session.close()


if __name__ == "__main__":
    main()
