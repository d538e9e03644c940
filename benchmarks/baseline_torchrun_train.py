"""Baseline for ``bench_mttr.py``: plain DDP with ``torch.save`` checkpoints, restarted by torchrun.

This is what most users run today: every ``--ckpt-every`` steps rank 0 writes the model and
optimizer state and the step count to disk (``torch.save`` to a temporary file, then an atomic
rename); when a worker dies, torchrun's elastic agent stops every worker, starts them all again,
and each new process loads the newest checkpoint. The model, data, batch size, sequence length,
optimizer and learning rate are those of ``nonstop.demo.train``, so both contenders do the same
work per step.

Fault: rank ``--fault-rank`` SIGKILLs itself when it starts step ``--fault-step``, once per
run (a marker file created with ``O_EXCL`` in ``--run-dir`` makes the restarted rank carry on).

Each rank appends JSON lines to ``--events`` (one ``os.write`` of one line per event, with
``O_APPEND``)::

    {"event": "start", "ts": <process start, from /proc>, "rank", "attempt", "pid"}
    {"event": "imported"}                 main() reached, torch imported
    {"event": "built"}                    model, optimizer and data built
    {"event": "pg_ready"}                 init_process_group returned
    {"event": "ckpt_loaded", "step"}      checkpoint loaded (step = steps it holds; 0: none)
    {"event": "ddp_ready"}                model wrapped in DDP, about to train
    {"event": "step", "step", "step_s"}   optimizer step ``step`` (0-based) completed
    {"event": "ckpt_saved", "step", "save_s"}     rank 0 only
    {"event": "fault", "step"}            written just before the SIGKILL
    {"event": "done", "step"}

``attempt`` is torchrun's ``TORCHELASTIC_RESTART_COUNT``. Run it as ``bench_mttr.py`` does::

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo python -m torch.distributed.run --standalone \\
        --nproc-per-node 3 --max-restarts 1 --monitor-interval 0.1 \\
        benchmarks/baseline_torchrun_train.py --model medium --steps 25 --ckpt-every 10 \\
        --fault-step 15 --run-dir /tmp/run --events /tmp/run/events.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from nonstop.demo.data import MarkovCorpus
from nonstop.demo.model import GPT, PRESETS

CKPT_NAME = "checkpoint.pt"


def process_start_time() -> float:
    """Wall-clock time this process was started (``/proc/self/stat`` field 22, in clock ticks)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    btime = next(
        int(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


class EventWriter:
    """Appends one JSON line per event to a file shared by every rank and attempt."""

    def __init__(self, path: Path, *, rank: int, attempt: int) -> None:
        self.fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
        self.base = {"rank": rank, "attempt": attempt, "pid": os.getpid()}

    def emit(self, event: str, ts: float | None = None, **fields: Any) -> None:
        rec = {"event": event, "ts": time.time() if ts is None else ts, **self.base, **fields}
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def claim_fault(marker: Path) -> bool:
    """True exactly once per run (the first caller creates the marker)."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The demo workload's flags, the same for every contender."""
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--model", choices=sorted(PRESETS), default="small")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step (as the demo)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)


def build_workload(args: argparse.Namespace) -> tuple[Any, GPT, torch.optim.Optimizer, MarkovCorpus]:
    """(model config, model, AdamW, data) exactly as ``nonstop.demo.train`` builds them."""
    cfg = PRESETS[args.model]
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return cfg, model, opt, MarkovCorpus(vocab=cfg.vocab, seed=1234 + args.seed)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--model", choices=sorted(PRESETS), default="medium")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step (as the demo)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--fault-rank", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=-1, help="-1: no fault")
    ap.add_argument("--run-dir", type=Path, required=True, help="checkpoint and fault marker live here")
    ap.add_argument("--events", type=Path, required=True)
    args = ap.parse_args(argv)

    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ev = EventWriter(args.events, rank=rank, attempt=attempt)
    ev.emit("start", ts=process_start_time())
    ev.emit("imported")

    cfg, model, opt, corpus = build_workload(args)
    ev.emit("built")

    dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
    ev.emit("pg_ready")

    ckpt = args.run_dir / CKPT_NAME
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        del state
    ev.emit("ckpt_loaded", step=start)
    ddp = DistributedDataParallel(model)
    ev.emit("ddp_ready")

    for step in range(start, args.steps):
        if rank == args.fault_rank and step == args.fault_step and claim_fault(args.run_dir / "fault-marker"):
            ev.emit("fault", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        x, y = corpus.batch(step=step, rank=rank, batch=args.batch, seq=cfg.seq)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        opt.step()
        loss.item()
        ev.emit("step", step=step, step_s=time.monotonic() - t0)
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            t1 = time.monotonic()
            save_checkpoint(ckpt, model, opt, step + 1)
            ev.emit("ckpt_saved", step=step + 1, save_s=time.monotonic() - t1)
    ev.emit("done", step=args.steps)
    # Without this barrier rank 0, which hosts the store (see bench_mttr.py), may exit while
    # another rank is still tearing its group down, and that rank then hangs.
    dist.barrier()
    # Then leave without torch.distributed's native teardown: a rank still tearing its group down
    # when rank 0 (the store's host) is gone hung for minutes in a fresh-clone test run. The
    # benchmark measures recovery, not teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
