"""torchft contender of ``bench_node_loss_peers.py``: the demo model trained by replica groups.

One process per rank; the ranks of one "node" form one torchft replica group (``--replica-group``
G of ``--num-groups``, group rank and size from ``RANK`` / ``WORLD_SIZE``, the group's TCPStore at
``MASTER_ADDR:MASTER_PORT``, hosted by group rank 0). Each step:

1. ``Manager.start_quorum()`` (torchft's quorum with the Lighthouse at ``TORCHFT_LIGHTHOUSE``);
2. forward and backward on the demo's batch for (step, global rank), global rank = G x group
   size + group rank, so the same (step, rank) pairs as the other contenders;
3. inside the group (when it has more than one rank) every gradient is averaged over the group
   with plain ``torch.distributed`` (gloo); across groups every gradient goes through
   ``Manager.allreduce`` (torchft's fault-tolerant average over the participating groups). The
   torchft DDP wrapper is not used: it crashed surviving replicas when a peer died mid-allreduce;
4. ``Manager.should_commit()``; the optimizer steps only when it says so.

The loop ends after ``--steps`` committed steps, or later with ``--min-full-steps N``: until the
last N committed steps all had every group taking part (every group counts the same steps, so
they stop together), so that a replacement slower to join than the job is long is still seen.

The model, optimizer (AdamW), learning rate, batch and sequence length are those of
``nonstop.demo.train``. A replica that joins late (the replacement of a lost node) heals from a
peer over torchft's HTTP checkpoint transport (model and optimizer state).

Fault: with ``--fault-step S`` (given to the last node's ranks only), the first of them to start
step S (the Manager's committed-step counter) writes a ``fault`` event and SIGKILLs every process
of its node (each process launched for a node carries ``BENCH_NODE_TAG`` in its environment).

Each rank appends JSON lines to ``--events`` (one ``os.write`` per line, ``O_APPEND``)::

    {"event": "start", "ts": <process start, from /proc>, "rank", "attempt", "pid", "group", ...}
    {"event": "imported"}        torch and torchft imported
    {"event": "built"}           model, optimizer and data built
    {"event": "manager_ready"}   group store, intra-group process group and Manager up
    {"event": "step", "step", "began_as", "committed", "participating", "participants", "quorum_id", "step_s"}
    {"event": "fault", "step"}   written just before the SIGKILL of the node
    {"event": "done", "step"}

``participating``: this group's gradients counted in the step (a healing replica's are zeroed);
``participants``: how many groups' gradients the step averaged.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchft
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's nonstop.demo

from baseline_torchrun_dcp_train import NODE_TAG_ENV, kill_node
from baseline_torchrun_train import (
    EventWriter,
    add_workload_args,
    build_workload,
    claim_fault,
    process_start_time,
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (as the demo)")
    ap.add_argument("--replica-group", type=int, required=True)
    ap.add_argument("--num-groups", type=int, required=True)
    ap.add_argument("--fault-step", type=int, default=-1, help="-1: no fault")
    ap.add_argument("--run-dir", type=Path, required=True, help="the fault marker lives here")
    ap.add_argument("--events", type=Path, required=True)
    ap.add_argument(
        "--min-full-steps",
        type=int,
        default=0,
        help="train past --steps until the last N committed steps had every group participating (a "
        "replacement that is slow to join still gets measured; every group stops at the same step)",
    )
    ap.add_argument(
        "--max-steps", type=int, default=100_000, help="hard stop, whatever --min-full-steps says"
    )
    ap.add_argument("--timeout", type=float, default=30.0, help="Manager timeout (collectives, healing)")
    ap.add_argument(
        "--wrappers",
        action="store_true",
        help="train through torchft's own DistributedDataParallel and OptimizerWrapper (its documented "
        "way: the quorum starts in zero_grad, bucketed gradients go through Manager.allreduce in DDP's "
        "comm hook, the commit vote runs in step); bench_step_cost_peers.py uses it without faults. "
        "Off (the node-loss benchmark): Manager.allreduce per gradient after backward, since torchft's "
        "DDP hook crashed survivors when a peer died mid-allreduce",
    )
    ap.add_argument(
        "--sync-quorum",
        action="store_true",
        help="use_async_quorum=False: a healing replica loads the state before its first step's forward",
    )
    args = ap.parse_args(argv)

    group = args.replica_group
    group_rank = int(os.environ["RANK"])
    group_size = int(os.environ["WORLD_SIZE"])
    global_rank = group * group_size + group_rank
    ev = EventWriter(args.events, rank=global_rank, attempt=0)
    ev.base.update(group=group, group_rank=group_rank, node=os.environ.get(NODE_TAG_ENV, ""))
    ev.emit("start", ts=process_start_time())
    ev.emit("imported")

    cfg, model, opt, corpus = build_workload(args)
    params = [p for p in model.parameters() if p.requires_grad]
    ev.emit("built")

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # The group's store: torchft's Manager expects it to exist (torchrun would host it).
    store = TCPStore(
        host, port, group_size, is_master=group_rank == 0, wait_for_workers=False, timeout=timedelta(60)
    )
    if group_size > 1:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("intra", store), rank=group_rank, world_size=group_size
        )

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=not args.sync_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        rank=group_rank,
        world_size=group_size,
        store_addr=host,
        store_port=port,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
        replica_id=f"node{group}",
        hostname="127.0.0.1",
        init_sync=False,  # every replica starts from the same seeded weights
    )
    ev.emit("manager_ready")

    wrapped = None
    if args.wrappers:  # torchft's documented way of training DDP (no intra-group ranks here)
        if group_size != 1:
            ap.error("--wrappers runs one process per replica group")
        wrapped = (torchft.DistributedDataParallel(manager, model), torchft.Optimizer(manager, opt))

    def wrapped_step(step: int) -> tuple[bool, float]:
        """One step through torchft's wrappers: (committed, loss)."""
        assert wrapped is not None
        ddp, ft_opt = wrapped
        ft_opt.zero_grad()  # starts the quorum
        x, y = corpus.batch(step=step, rank=global_rank, batch=args.batch, seq=cfg.seq)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        loss.backward()  # the comm hook averages each bucket over the participating groups
        before = manager.current_step()
        ft_opt.step()  # the commit vote; the optimizer steps only on a commit
        return manager.current_step() > before, float(loss.item())

    full_streak = 0  # committed steps in a row that every group took part in (the same in every group)
    while (step := manager.current_step()) < args.max_steps:
        if step >= args.steps and full_streak >= args.min_full_steps:
            break
        if args.fault_step >= 0 and step == args.fault_step and claim_fault(args.run_dir / "fault-marker"):
            ev.emit("fault", step=step)
            kill_node(os.environ[NODE_TAG_ENV])
        t0 = time.monotonic()
        began = step
        if wrapped is not None:
            committed, loss = wrapped_step(step)
            full = committed and manager.num_participants() == args.num_groups
            full_streak = full_streak + 1 if full else 0
            ev.emit(
                "step",
                step=manager.current_step() - (1 if committed else 0),
                began_as=began,
                committed=committed,
                participants=manager.num_participants(),
                loss=loss,
                step_s=time.monotonic() - t0,
            )
            continue
        manager.start_quorum()
        if args.sync_quorum:  # a healing replica has loaded the state: it is at the others' step
            step = manager.current_step()
        opt.zero_grad(set_to_none=True)
        x, y = corpus.batch(step=step, rank=global_rank, batch=args.batch, seq=cfg.seq)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if args.step_delay:
            time.sleep(args.step_delay)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if group_size > 1:
            for w in [dist.all_reduce(g, async_op=True) for g in grads]:
                assert w is not None
                w.wait()
            for g in grads:
                g.div_(group_size)
        for w in [manager.allreduce(g) for g in grads]:
            w.wait()
        participating = manager.is_participating()
        participants = manager.num_participants()
        committed = manager.should_commit()
        if committed:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
        full_streak = full_streak + 1 if committed and participants == args.num_groups else 0
        ev.emit(
            "step",
            # the step's index once committed: a healing replica began at its old counter (0 for a
            # new one), and commits the step the others are at
            step=manager.current_step() - (1 if committed else 0),
            began_as=began,
            committed=committed,
            participating=participating,
            participants=participants,
            quorum_id=manager._quorum_id,  # (no public accessor)
            loss=float(loss.item()),
            step_s=time.monotonic() - t0,
        )
    ev.emit("done", step=manager.current_step())
    if group_size > 1:
        dist.barrier()  # group rank 0 hosts the group's store: let every rank finish first
    manager.shutdown(wait=False)
    if group_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
