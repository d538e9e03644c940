"""(c) What a gloo P2P send/recv does when its peer dies or hangs, and whether nonstop's sever
(SocketWatch.shut_reads on the group's sockets, nonstop/train/abort.py) wakes it.

    python p2p_dead.py CASE         CASE in: recv-kill recv-stop recv-stop-sever send-stop
                                             send-stop-sever seq lazy-recv-stop-sever

Two processes. Rank 1 is the 'peer' that dies (SIGKILL) or hangs (SIGSTOP, sent by the parent).
Rank 0 issues the P2P op on a pp group created with new_group under a SocketWatch and reports
what happened and after how long. pg timeout is TIMEOUT_S.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path
import threading
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root

import torch
import torch.distributed as dist

from nonstop.train.abort import SocketWatch

TIMEOUT_S = 8.0
SEVER_AFTER_S = 2.0


def worker(rank: int, case: str, store_path: str) -> None:
    lazy = case.startswith("lazy")
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    watch = SocketWatch()
    pp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S), use_local_synchronization=True)
    watch.stop()
    # one round trip so the pair is connected (and, lazily, created)
    t = torch.zeros(4)
    if rank == 0:
        dist.send(t, 1, group=pp)
    else:
        dist.recv(t, 0, group=pp)
    if case == "seq":
        out = {"seq_after_1_p2p": pp._get_sequence_number_for_group()}
        for _ in range(3):
            if rank == 0:
                dist.send(t, 1, group=pp)
            else:
                dist.recv(t, 0, group=pp)
        out["seq_after_4_p2p"] = pp._get_sequence_number_for_group()
        w = dist.batch_isend_irecv([dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank, pp)])
        for x in w:
            x.wait()
        out["seq_after_batch"] = pp._get_sequence_number_for_group()
        dist.all_reduce(t, group=pp)
        out["seq_after_allreduce"] = pp._get_sequence_number_for_group()
        print(json.dumps({"rank": rank, **out}), flush=True)
        dist.barrier()
        return
    print(f"READY {rank} sockets={len(watch.created)}", flush=True)
    if rank == 1:
        time.sleep(3600)  # the parent kills or stops us
        return
    time.sleep(1.0)  # let the parent kill/stop rank 1
    if "sever" in case:
        def sever() -> None:
            time.sleep(SEVER_AFTER_S)
            n = watch.shut_reads()
            print(f"SEVERED {n} sockets at {time.monotonic() - t0:.2f}s", flush=True)
        threading.Thread(target=sever, daemon=True).start()
    big = torch.ones(32 * 1024 * 1024 // 4)  # 32 MiB: more than the socket buffers hold
    t0 = time.monotonic()
    try:
        if case.startswith("send") :
            dist.send(big, 1, group=pp)
        else:
            dist.recv(big, 1, group=pp)
        res = "returned"
    except Exception as e:
        res = f"raised {type(e).__name__}: {str(e)[:160]}"
    print(json.dumps({"case": case, "result": res, "after_s": round(time.monotonic() - t0, 2)}), flush=True)
    os._exit(0)


def main() -> None:
    import subprocess
    import tempfile

    if len(sys.argv) > 2:
        worker(int(sys.argv[2]), sys.argv[1], sys.argv[3])
        return
    case = sys.argv[1]
    store = tempfile.mktemp(prefix="p2pstore")
    procs = [
        subprocess.Popen([sys.executable, __file__, case, str(r), store], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    if case == "seq":
        for p in procs:
            print(p.communicate(timeout=120)[0].strip())
        return
    for p in procs:  # wait for both READY
        line = p.stdout.readline()
        print(line.strip())
    if "kill" in case:
        procs[1].send_signal(signal.SIGKILL)
    else:
        procs[1].send_signal(signal.SIGSTOP)
    try:
        out = procs[0].communicate(timeout=TIMEOUT_S * 4 + 10)[0]
        print(out.strip())
    except subprocess.TimeoutExpired:
        print(json.dumps({"case": case, "result": f"still blocked after {TIMEOUT_S * 4 + 10}s (hang)"}))
        procs[0].kill()
    procs[1].kill()
    procs[1].wait()


if __name__ == "__main__":
    main()
