"""What the first step after rebuilding a PipelineStage + schedule costs (the P2P warm-up vote and,
without input_args/output_args, the dynamic shape inference), on 2 gloo ranks, 1F1B, 4 micro-batches.

    python bench_first_step.py [REPS]

For each variant, REPS rounds of {rebuild; 1 step} against steady steps, medians reported:
  steady        no rebuild
  sched         new PipelineStage + schedule on the same pp group (dynamic shapes)
  sched-static  the same with input_args/output_args (static: vote only, no metadata inference)
  group         a new pp group (new_group) + new stage + schedule (dynamic): a survivor's generation
Also counts the P2P ops the first step issues (gloo's sequence number on the pp group).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rank_main(rank: int, store_path: str, reps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import pp_common as C

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    mod = C.build_stage(rank, 2, 8, 0)
    opt = torch.optim.AdamW(mod.parameters(), lr=3e-3)
    pg = dist.new_group([0, 1], use_local_synchronization=True)
    mb = C.BATCH // 4

    def make(group, static):
        kw = {}
        if static:
            inp = torch.zeros(mb, C.SEQ, dtype=torch.long) if rank == 0 else torch.zeros(mb, C.SEQ, C.DIM)
            out = torch.zeros(mb, C.SEQ, C.DIM if rank == 0 else C.VOCAB)
            inp.requires_grad_(rank != 0)  # static mode reads requires_grad off the examples
            out.requires_grad_(True)
            kw = {"input_args": (inp,), "output_args": (out,)}
            if os.environ.get("GRADS") == "1":
                kw.update(output_grads=(torch.zeros_like(out),), input_grads=(None if rank == 0 else torch.zeros_like(inp),))
        st = PipelineStage(mod, rank, 2, torch.device("cpu"), group=group, **kw)
        return Schedule1F1B(st, 4, loss_fn=C.loss_fn)

    def step(sched, i):
        opt.zero_grad(set_to_none=True)
        x, y = C.batch(i)
        sched.step(x) if rank == 0 else sched.step(target=y, losses=[])
        opt.step()

    sched = make(pg, os.environ.get("INIT_STATIC") == "1")
    variants = os.environ.get("VARIANTS", "steady,sched,sched-static,group").split(",")
    res: dict[str, list[float]] = {v: [] for v in variants}
    seqs: dict[str, int] = {}
    i = 0
    for _ in range(3):
        step(sched, i); i += 1
    for _ in range(reps):
        for v in res:
            dist.barrier(group=pg)
            t0 = time.perf_counter()
            grp = pg
            if v == "group":
                grp = dist.new_group([0, 1], use_local_synchronization=True)
            if v != "steady":
                sched = make(grp, v == "sched-static")
            s0 = grp._get_sequence_number_for_group()
            step(sched, i); i += 1
            res[v].append(time.perf_counter() - t0)
            seqs[v] = grp._get_sequence_number_for_group() - s0
            if v == "steady" and "steady-seq" not in seqs:
                seqs["steady-seq"] = seqs[v]
            if v == "group":
                pg_old, pg = pg, grp
                pass  # (destroying it and making a same-ranks group again clashes on the name in torch 2.13)
    print(json.dumps({"rank": rank, "median_ms": {k: round(1000 * statistics.median(v), 2) for k, v in res.items()},
                      "p2p_ops_in_step": seqs}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
        sys.exit(0)
    import tempfile

    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    store = tempfile.mktemp(prefix="bfstore")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), store, str(reps)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        for line in p.communicate(timeout=600)[0].splitlines():
            if line.startswith("{"):
                print(line)
