"""Is nonstop's liveness frame test (nonstop/train/collectives.py: in_collective) right for a
pipeline on gloo?  2 ranks, 1F1B, a sampler thread calls in_collective(main thread) every 5 ms
and records the innermost frame.

    python hang_frames.py          (the launcher; prints a table per rank and phase)

Phases (by step):  normal (steps 0-2, 6-7) | stall: rank 1 sleeps 3 s in its stage's forward at
step 3 (a stage stuck in its own code) | heavy: at steps 4-5 rank 1's stage runs a big matmul whose
backward is heavy C++ work (a stage slow in its own backward).
Wanted: rank 0 (waiting in P2P) in_collective True; rank 1 (stalled or computing) False.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
import threading
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def rank_main(rank: int, store_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    import pp_common as C
    from nonstop.train.collectives import in_collective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mod = C.build_stage(rank, 2, 4, 0)
    big = torch.nn.Parameter(torch.randn(500, 500) * 0.01)
    phase = {"p": "normal", "step": 0}

    def pre(m, inp):
        if rank == 1 and phase["step"] == 3 and not phase.get("stalled"):
            phase["stalled"] = True
            time.sleep(3.0)  # stuck in its own code (a Python frame of the script)

    mod.register_forward_pre_hook(pre)
    orig = mod.forward

    def fwd(h):
        out = orig(h)
        if rank == 1 and phase["p"] == "heavy":
            w = big
            for _ in range(3):
                w = w @ big
            out = out + 0.0 * w.sum()  # heavy backward (C++), launched from pipelining's _backward.py
        return out

    mod.forward = fwd
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
    sched = Schedule1F1B(stage, 4, loss_fn=C.loss_fn)
    main = threading.get_ident()
    samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            f = sys._current_frames().get(main)
            where = f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}" if f else "-"
            samples[phase["p"]][(in_collective(main), where)] += 1
            time.sleep(0.005)

    threading.Thread(target=sampler, daemon=True).start()
    for step in range(8):
        phase["step"] = step
        phase["p"] = "stall" if step == 3 else "heavy" if step in (4, 5) else "normal"
        x, y = C.batch(step)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
    stop.set()
    out = {p: [[k[0], k[1], n] for k, n in c.most_common(6)] for p, c in samples.items()}
    print(json.dumps({"rank": rank, "samples": out}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(int(sys.argv[1]), sys.argv[2])
        sys.exit(0)
    import tempfile

    store = tempfile.mktemp(prefix="hfstore")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), store], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        out = p.communicate(timeout=300)[0]
        for line in out.splitlines():
            if line.startswith("{"):
                j = json.loads(line)
                for ph, rows in j["samples"].items():
                    tot = sum(r[2] for r in rows)
                    print(f"rank {j['rank']} {ph:7s}: " + "; ".join(f"coll={r[0]} {r[1]} {100 * r[2] // max(tot, 1)}%" for r in rows))
