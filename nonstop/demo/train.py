"""The demo training script. Run it under the launcher::

    nonstop run --nproc-per-node 3 --spares 1 -m nonstop.demo.train --steps 60

Rank 0 writes ``--result`` (JSON: final loss, SHA-256 of the final weights).

Device-generic: the model is built on the CPU (the same initial weights on every kind of node),
moved to the process's own device after ``nonstop.init()`` (``session.device``: ``cuda:LOCAL_RANK``
on a GPU node, the CPU elsewhere), batches are generated on the CPU and moved, and hashes are
computed from CPU copies. On a CPU node every tensor stays where it was: bitwise today's run.
On a CUDA device the script asks torch for deterministic kernels (and cuBLAS for a fixed
workspace) so that ``nonstop demo --verify`` can compare a recovered run's weights bitwise with
an uninterrupted one's; a kernel torch has no deterministic version of only warns.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
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
from nonstop.errors import ControlError


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())  # cpu(): no copy on a CPU
    return h.hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seed-per-rank",
        action="store_true",
        help="reseed the torch RNG with seed + rank once the rank is known (as scripts that want "
        "different dropout per rank do): ranks are then not alike, and a stall budget may not widen "
        "the snapshot interval (nonstop/policy/cadence.py)",
    )
    ap.add_argument("--result", type=Path, default=None)
    ap.add_argument(
        "--samples-log",
        type=Path,
        default=None,
        help="directory: each process appends (generation, step, shard, first sample, count) of every "
        "micro-batch it trains on, as JSON lines (the proof that an elastic run reads the same samples)",
    )
    add_pace_args(ap)
    ap.add_argument(
        "--kv-probe-step",
        type=int,
        default=None,
        help="at this step rank 0 misuses the process group's store (add on a key holding text) and "
        "records the error it gets (the coordinator must refuse the request and go on)",
    )
    args = ap.parse_args(argv)

    cfg = PRESETS[args.model]
    # every RNG seeded alike on every rank ("seed everything"): a rank replaced after a failure
    # between two snapshots may then take a survivor's state of the step (nonstop/train/rescue.py)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    # Everything that does not depend on the rank is built before joining, so a
    # hot spare has it ready when it is given a rank (on the CPU: the same weights everywhere).
    model = GPT(cfg)
    corpus = MarkovCorpus(vocab=cfg.vocab, seed=1234 + args.seed)
    session = nonstop.init()  # a hot spare waits here
    if args.seed_per_rank:
        torch.manual_seed(args.seed + session.rank)
    device = session.device  # this process's own device (the CPU on a CPU node: nothing moves)
    deterministic_on(device)  # bitwise-comparable GPU runs (the module docstring)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # over the parameters where they live
    data: dict[str, Any] = {"samples_seen": 0}  # by the whole job (the same on every rank)
    samples_log = SamplesLog(args.samples_log, batch=args.batch) if args.samples_log is not None else None

    starts: list[float] = []  # when each train_step began: the loop's pace, snapshots included
    starts_unix: list[float] = []  # the same, wall clock (to line steps up with the event log)

    def train_step(ddp: torch.nn.Module, step: int) -> float:
        if not session.warming_up:  # a joiner's sandboxed step is not a step of the run
            starts.append(time.perf_counter())
            starts_unix.append(time.time())
        opt.zero_grad(set_to_none=True)
        losses = []
        # One micro-batch per data shard this rank plays (one, unless the job has shrunk).
        # Shard k of step s holds samples (s * num_shards + k) * batch ... + batch - 1.
        for shard in session.shard_steps(ddp):
            if samples_log is not None and not session.warming_up:  # before: a kill may follow the
                samples_log.record(session, step, shard)  # backward's collective (the step counts)
            x, y = corpus.batch(step=step, rank=shard, batch=args.batch, seq=cfg.seq)  # on the CPU
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            losses.append(float(loss.item()))
        pace(args, session)
        if step == args.kv_probe_step and session.rank == 0 and not session.warming_up:
            session.store.set("kv-probe", "text")
            try:
                session.store.add("kv-probe", 1)
                data["kv_probe"] = "accepted"
            except ControlError as e:
                data["kv_probe"] = f"refused: {e}"
        opt.step()
        if not session.warming_up:
            data["samples_seen"] += args.batch * session.shards_played
        return sum(losses) / len(losses)

    def load_extras(extras: dict[str, Any]) -> None:
        data.update(extras)

    t0 = time.time()
    result = session.run(
        train_step,
        model=model,
        optimizer=opt,
        num_steps=args.steps,
        extras=lambda: dict(data),
        load_extras=load_extras,
    )
    if session.rank == 0 and args.result is not None:
        args.result.write_text(
            json.dumps(
                {
                    "final_loss": result.last_loss,
                    "final_hash": weights_hash(model),
                    "step": result.step,
                    "generation": result.generation,
                    "samples_seen": data["samples_seen"],
                    "kv_probe": data.get("kv_probe"),
                    "world_size": session.world_size,
                    **where(device),
                    "num_params": sum(p.numel() for p in model.parameters()),
                    "seconds": time.time() - t0,
                    "step_intervals_s": [b - a for a, b in itertools.pairwise(starts)],
                    "step_starts_unix": starts_unix,
                }
            )
        )
    session.close()


if __name__ == "__main__":
    main()
