"""The sharded demo training script: the demo GPT on the job's mesh. Run it under the launcher::

    nonstop run --nproc-per-node 2 --mesh shard=2 -m nonstop.demo.train_sharded --steps 30
    nonstop run --nproc-per-node 4 --mesh replicate=2,shard=2 -m nonstop.demo.train_sharded   # HSDP
    nonstop run --nproc-per-node 4 --mesh shard=2,tp=2 -m nonstop.demo.train_sharded          # DP x TP

``build(mesh)`` is collective-free, as ``Session.run(build=...)`` requires: tensor parallel (the
MLP of every block, column- then row-wise, ``src_data_rank=None``) on the ``tp`` dim, then FSDP2
``fully_shard`` on the data-parallel dims (``shard``, or ``replicate`` x ``shard``: HSDP). Ranks
of one TP group read the same batch; the batches come through ``Session.shard_steps`` (an
elastic HSDP job that lost a replica group plays its batches too).

Every rank writes ``<result>.rank<R>.json`` (its loss and the SHA-256 of its own local shards);
rank 0 also writes ``--result``. Two runs on the same mesh are equal when every rank's shards are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import nonstop
from nonstop.demo.data import MarkovCorpus
from nonstop.demo.device import deterministic_on, where
from nonstop.demo.model import GPT, PRESETS
from nonstop.demo.pace import add_pace_args, pace
from nonstop.demo.samples import SamplesLog


def local_hash(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's own part of the weights (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def shard_model(model: GPT, mesh: Any) -> None:
    """Tensor parallel on ``tp``, then FSDP2 on the data-parallel dims (collective-free)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = tuple(mesh.mesh_dim_names)
    if "tp" in names:
        for blk in model.blocks:
            plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
            parallelize_module(blk, mesh["tp"], plan, src_data_rank=None)
    dp = tuple(d for d in ("replicate", "shard") if d in names)
    if dp:
        dp_mesh = mesh[dp]
        for blk in model.blocks:
            fully_shard(blk, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result", type=Path, default=None)
    ap.add_argument(
        "--no-prewarm", action="store_true", help="spares wait cold: no nonstop.init(build=...) (benchmarks)"
    )
    add_pace_args(ap)
    ap.add_argument(
        "--samples-log", type=Path, default=None, help="directory: a line per micro-batch (see demo.train)"
    )
    args = ap.parse_args(argv)

    cfg = PRESETS[args.model]
    corpus = MarkovCorpus(vocab=cfg.vocab, seed=1234 + args.seed)
    built: dict[str, Any] = {}
    # the other RNGs alike on every rank too: a rank replaced between two snapshots may then take
    # the rescued state of a rank holding its shards (nonstop/train/rescue.py)
    random.seed(args.seed)
    np.random.seed(args.seed)

    def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(args.seed)  # every generation builds the same initial weights
        # built on the CPU (the same weights on every kind of node); fully_shard moves the
        # parameters to the mesh's device, the rank's own (Session.device: its GPU on a GPU node)
        model = GPT(cfg)
        shard_model(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        built.update(model=model, opt=opt)
        return model, opt

    # a hot spare waits here, and warms DTensor's caches with build meanwhile (nonstop.train.prewarm)
    session = nonstop.init(build=None if args.no_prewarm else build)
    deterministic_on(session.device)  # bitwise-comparable GPU runs (nonstop.demo.device)
    data: dict[str, Any] = {"samples_seen": 0}
    samples_log = SamplesLog(args.samples_log, batch=args.batch) if args.samples_log is not None else None

    def train_step(model: torch.nn.Module, step: int) -> float:
        opt = built["opt"]
        opt.zero_grad(set_to_none=True)
        losses = []
        # the data shards this rank plays: its dp_rank's at full size; after an elastic shrink
        # also those of the replica groups that were dropped (accumulated, reduced once)
        for shard in session.shard_steps(model):
            if samples_log is not None:  # before: a kill may follow the backward's collective
                samples_log.record(session, step, shard)
            x, y = corpus.batch(step=step, rank=shard, batch=args.batch, seq=cfg.seq)  # on the CPU
            x, y = x.to(session.device), y.to(session.device)  # no copy on a CPU node
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            losses.append(float(loss.item()))
        pace(args, session)
        opt.step()
        data["samples_seen"] += args.batch * session.shards_played
        return sum(losses) / len(losses)

    t0 = time.time()
    result = session.run(
        train_step,
        build=build,
        num_steps=args.steps,
        extras=lambda: dict(data),
        load_extras=data.update,
    )
    if args.result is not None:
        mine = {
            "rank": session.rank,
            "final_loss": result.last_loss,
            "local_hash": local_hash(built["model"]),
            "prewarm_s": session.prewarm_s,  # a spare that took this rank warmed up (train/prewarm.py)
            "step": result.step,
            **where(session.device),
        }
        args.result.with_suffix(f".rank{session.rank}.json").write_text(json.dumps(mine))
        if session.rank == 0:
            args.result.write_text(
                json.dumps(
                    {
                        **mine,
                        "generation": result.generation,
                        "samples_seen": data["samples_seen"],
                        "world_size": session.world_size,
                        "mesh": session.env.mesh,
                        "seconds": time.time() - t0,
                    }
                )
            )
    session.close()


if __name__ == "__main__":
    main()
