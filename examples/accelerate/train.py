"""A Hugging Face Accelerate training script, hosted by nonstop.

    nonstop run --nproc-per-node 3 --spares 1 examples/accelerate/train.py
    nonstop run --nproc-per-node 3 --spares 1 --fail kill:rank=1,step=5 examples/accelerate/train.py

Accelerate owns the loop and the model's DDP wrapper; nonstop owns the processes, the process group
and recovery. The lines marked ``# nonstop`` are all it adds to a plain Accelerate script: the
loop iterates ``session.steps(..., wrap=False)``, each step runs inside ``with step:``, and the
first step of every generation (the start, a recovery, a resize) makes a new ``Accelerator`` and
prepares the same raw model, optimizer and scheduler again -- the previous wrappers hold the
destroyed process group. A killed rank's place is taken by the hot spare; every rank resumes from
the committed step and the final weights are bitwise those of a run without the fault.

Batches derive from the step and the rank (``accelerator.process_index``), so a redone step reads
the same data. ``--save PATH``: rank 0 writes the final weights there (``torch.save``).
"""

from __future__ import annotations

import argparse

import torch

import nonstop  # nonstop
from nonstop.integrations.accelerate import Accelerator  # nonstop: accelerate.Accelerator, one per generation

TRUE_W = torch.randn(8, 1, generator=torch.Generator().manual_seed(42))


def batch(step: int, rank: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of step ``step``: the same every time the step is run."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, 8, generator=g)
    return x, torch.tanh(x @ TRUE_W) + 0.05 * torch.randn(size, 1, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps * 3)

    session = nonstop.init()  # nonstop: a hot spare waits here until it takes a rank
    state = {"scheduler": scheduler}  # nonstop: restored with the model and optimizer
    # nonstop: the loop, one step per optimizer step; Accelerate wraps the model (wrap=False)
    for step in session.steps(args.steps, model=model, optimizer=optimizer, state=state, wrap=False):
        with step:  # nonstop
            if step.new_generation:  # nonstop: a new process group: wrap again
                accelerator = Accelerator()
                ddp_model, ddp_opt, ddp_sched = accelerator.prepare(model, optimizer, scheduler)
            x, y = batch(step, accelerator.process_index)
            loss = torch.nn.functional.mse_loss(ddp_model(x), y)
            accelerator.backward(loss)
            ddp_opt.step()
            ddp_sched.step()
            ddp_opt.zero_grad()
            step.loss = loss.item()  # nonstop: reported with the step
            if step % 5 == 0:
                accelerator.print(f"step {int(step)} loss {loss.item():.5f} (generation {step.generation})")

    if args.save and session.rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)
    session.close()  # nonstop


if __name__ == "__main__":
    main()
