"""torchrun + DCP contender of ``bench_node_loss_peers.py``: plain DDP, ``torch.distributed.checkpoint``.

The demo model, data, batch, sequence length, optimizer (AdamW) and learning rate of
``nonstop.demo.train`` under DDP (gloo). Every ``--ckpt-every`` steps every rank takes part in
``torch.distributed.checkpoint.async_save`` of the model and optimizer state
(``get_state_dict``; DCP's collectives on a process group of their own, apart from DDP's) into
``--run-dir``/dcp/step_NNNNNN (``--sync-save``: ``dcp.save``); before the next save (and before
exiting) the previous one is waited for (the stall a slow save causes is part of the workload). A
checkpoint is complete once its ``.metadata`` exists (DCP's coordinator writes it last); a save in
flight when a node dies is lost with it. On start, every rank loads the newest complete checkpoint
(rank 0 picks it and broadcasts the choice) with ``dcp.load`` + ``set_state_dict``, then wraps the
model in DDP.

A worker that fails (a collective with a dead peer) prints the error and leaves with
``os._exit(1)``: left to the interpreter it hangs ~1.5 s in torch.distributed's native teardown
before torchrun's agent sees it exit (the baseline's best case, not what a plain script does).

Sharded (``--mesh``, as ``nonstop.demo.train_sharded``): the model is laid out by the demo's
``shard_model`` (FSDP2 / HSDP / TP) once the group exists, instead of DDP; DCP saves and loads its
sharded state (``get_state_dict`` / ``set_state_dict``).

Fault: with ``--fault-rank R``, rank R SIGKILLs itself when it starts step S (``--fault-step``).
Without, with ``--fault-step S`` (given to one node's agent only), the first of that node's workers to
start step S (marker file, once per run) writes a ``fault`` event and SIGKILLs every process of its
node, torchrun's agent included: each process launched for a node carries ``BENCH_NODE_TAG`` in its
environment (:func:`kill_node`).

Events (JSON lines, one ``os.write`` each, ``O_APPEND``; ``rank`` is torchrun's ``RANK``)::

    {"event": "start", "ts": <process start, from /proc>, "rank", "attempt", "pid", "node"}
    {"event": "imported"} {"event": "built"} {"event": "pg_ready"}
    {"event": "ckpt_loaded", "step", "load_s"}   step 0: nothing to load
    {"event": "ddp_ready"}
    {"event": "step", "step", "step_s"}          optimizer step ``step`` (0-based) completed
    {"event": "ckpt_saved", "step", "block_s"}   async_save returned (the training loop's stall)
    {"event": "ckpt_done", "step", "error"}      that save completed (from DCP's thread, as it does)
    {"event": "fault", "step"}
    {"event": "done", "step"}

``attempt`` is torchrun's ``TORCHELASTIC_RESTART_COUNT`` (per agent). Run it as the benchmark
does (two agents on one machine, the second started once the first listens)::

    BENCH_NODE_TAG=n0 GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --rdzv-id job --local-addr 127.0.0.1 --max-restarts 3 --monitor-interval 0.1 \\
        benchmarks/baseline_torchrun_dcp_train.py --model small --steps 24 --ckpt-every 10 \\
        --run-dir /tmp/run --events /tmp/run/events.jsonl
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's nonstop.demo

from baseline_torchrun_train import (
    EventWriter,
    add_workload_args,
    build_workload,
    claim_fault,
    process_start_time,
)

NODE_TAG_ENV = "BENCH_NODE_TAG"
CKPT_PREFIX = "step_"


def kill_node(tag: str) -> None:
    """SIGKILL every process of this user whose environment holds ``BENCH_NODE_TAG=tag``; self last."""
    needle = f"{NODE_TAG_ENV}={tag}\0".encode()
    me = os.getpid()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if needle in env:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    os.kill(me, signal.SIGKILL)


def latest_complete(root: Path) -> tuple[int, Path | None]:
    """(steps held, directory) of the newest checkpoint with its ``.metadata``; (0, None) if none."""
    best: tuple[int, Path | None] = (0, None)
    for d in root.glob(f"{CKPT_PREFIX}*"):
        if (d / ".metadata").exists():
            n = int(d.name.removeprefix(CKPT_PREFIX))
            if n > best[0]:
                best = (n, d)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (as the demo)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--sync-save", action="store_true", help="dcp.save instead of dcp.async_save")
    ap.add_argument("--fault-step", type=int, default=-1, help="-1: no fault")
    ap.add_argument(
        "--fault-rank",
        type=int,
        default=-1,
        help="kill only this rank at --fault-step (SIGKILL itself); -1: its whole node (BENCH_NODE_TAG)",
    )
    ap.add_argument(
        "--mesh",
        default=None,
        help="sharded, as the nonstop demo (replicate=R,shard=S,tp=T): FSDP2 / HSDP / TP instead of DDP",
    )
    ap.add_argument("--run-dir", type=Path, required=True, help="checkpoints and the fault marker live here")
    ap.add_argument("--events", type=Path, required=True)
    args = ap.parse_args(argv)

    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ev = EventWriter(args.events, rank=rank, attempt=attempt)
    ev.base["node"] = os.environ.get(NODE_TAG_ENV, "")
    ev.emit("start", ts=process_start_time())
    import torch.distributed.checkpoint as dcp  # (~0.8 s: part of this contender's start-up)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ev.emit("imported")

    cfg, model, opt, corpus = build_workload(args)
    ev.emit("built")

    dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
    ckpt_pg = dist.new_group(backend="gloo")  # DCP's collectives, apart from DDP's
    data_rank = rank
    if args.mesh is not None:  # the sharded demo's layout, built the same way (collective-free)
        from torch.distributed.device_mesh import init_device_mesh

        from nonstop.demo.train_sharded import shard_model
        from nonstop.mesh import MeshSpec

        spec = MeshSpec.parse(args.mesh)
        mesh = init_device_mesh("cpu", spec.shape, mesh_dim_names=spec.names)
        shard_model(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # over the sharded parameters
        data_rank = spec.dp_rank(rank)
    ev.emit("pg_ready")

    root = args.run_dir / "dcp"
    t1 = time.monotonic()
    choice: list[object] = [latest_complete(root) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    start, path = choice[0]  # type: ignore[misc]
    if path is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path, process_group=ckpt_pg)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        del state, msd, osd
    ev.emit("ckpt_loaded", step=start, load_s=time.monotonic() - t1)
    ddp = DistributedDataParallel(model) if args.mesh is None else model
    ev.emit("ddp_ready")  # (sharded: the model is ready; the name is kept for the analysis)

    pending: Future[Any] | None = None  # the save in flight

    def on_done(n: int) -> Callable[[Future[Any]], None]:
        def done(fut: Future[Any]) -> None:  # (on DCP's thread, as the save completes)
            err = fut.exception()
            ev.emit("ckpt_done", step=n, error=None if err is None else repr(err))

        return done

    def wait_pending() -> None:
        nonlocal pending
        if pending is not None:
            pending.result()
            pending = None

    for step in range(start, args.steps):
        faulty = args.fault_step >= 0 and step == args.fault_step and args.fault_rank in (-1, rank)
        if faulty and claim_fault(args.run_dir / "fault-marker"):
            ev.emit("fault", step=step)
            if args.fault_rank < 0:
                kill_node(os.environ[NODE_TAG_ENV])
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        x, y = corpus.batch(step=step, rank=data_rank, batch=args.batch, seq=cfg.seq)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.step_delay:
            time.sleep(args.step_delay)
        opt.step()
        loss.item()
        ev.emit("step", step=step, step_s=time.monotonic() - t0)
        if (step + 1) % args.ckpt_every == 0:
            t1 = time.monotonic()
            wait_pending()
            msd, osd = get_state_dict(model, opt)
            ckpt_id = root / f"{CKPT_PREFIX}{step + 1:06d}"
            if args.sync_save:
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_id, process_group=ckpt_pg)
                ev.emit("ckpt_saved", step=step + 1, block_s=time.monotonic() - t1)
                ev.emit("ckpt_done", step=step + 1, error=None)
            else:
                pending = dcp.async_save(
                    {"model": msd, "optim": osd}, checkpoint_id=ckpt_id, process_group=ckpt_pg
                )
                ev.emit("ckpt_saved", step=step + 1, block_s=time.monotonic() - t1)
                assert isinstance(pending, Future)
                pending.add_done_callback(on_done(step + 1))
    wait_pending()
    ev.emit("done", step=args.steps)
    # Rank 0 hosts the store: let every rank finish with its group first.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        # The baseline's best case: a worker whose collective failed (a peer died) exits at once.
        # Left to the interpreter, it hangs ~1.5 s in torch.distributed's native teardown before
        # torchrun's agent can see it exit and restart the group.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
