"""A migration's catch-up: fetching the next step whole vs as a delta, over links of several speeds.

What is measured. The demo transformer (``--preset``, ``small`` by default) is trained with AdamW
(lr 3e-3, the demo's) on the demo's Markov corpus for ``--warmup`` steps; the states after the
next ``--pairs + 1`` steps are captured into a node's snapshot slots the way a rank captures them
(``RankSnapshotStore.write`` of ``{"model": ..., "optimizer": ...}``). A second node fetches
them over nonstop's data plane (``nonstop.replica.peer``: authenticated channel, CRC-32C per
chunk, installed into its own slots with ``write_raw``, as the node agent does), both nodes in
this process on loopback. Per link speed, ``--reps`` passes over the consecutive pairs
``(s-1, s)``; each pass fetches step ``s-1`` **whole** and then step ``s`` as a **delta** against
``s-1`` (the job's codec, zstd-1 + byte shuffle + ``sub`` delta), both tracked fetches, so both
go through the same path and the same link.

Link speeds (``--links``, MB/s; ``0`` = loopback, unlimited): the holder's bandwidth cap
(``DataPlane(bandwidth_bytes_s=...)``), a token bucket on the bytes it sends, emulates a slower
link. It does not emulate latency; the CPU cost (encode on the holder, decode on the target) is
real and runs on this machine's cores.

Figures per link: seconds per fetch (request to installed) for whole and delta, median [min,
max]; bytes on the wire; the ratio raw / wire of the delta; and ``delta_speedup`` = whole seconds
/ delta seconds (> 1: the delta catches up faster). The crossover link speed predicted from the
loopback figures, ``B* = R / (t_delta - t_whole) * (1 - 1/ratio)`` (below it a delta wins), is
printed next to the measured ones.

    .venv/bin/python benchmarks/bench_catchup.py            # small preset, 4 links, ~2 min
    .venv/bin/python benchmarks/bench_catchup.py --quick    # tiny preset, 2 links, 1 rep (smoke)

Results go to ``benchmarks/results/catchup.json`` (``--out`` overrides).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.control.channel import new_secret  # noqa: E402
from nonstop.demo.data import MarkovCorpus  # noqa: E402
from nonstop.demo.model import GPT, PRESETS  # noqa: E402
from nonstop.replica.dataplane import DataPlane, shm_stores  # noqa: E402
from nonstop.replica.peer import Fetched, fetch  # noqa: E402
from nonstop.snapshot.store import RankSnapshotStore  # noqa: E402


def capture_states(shm: Path, store_id: str, preset: str, warmup: int, n: int, batch: int) -> list[int]:
    """Train, then write the states after ``n`` consecutive steps into ``store_id``'s rank 0 slots."""
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    corpus = MarkovCorpus(vocab=cfg.vocab, seed=1234)
    store = RankSnapshotStore(shm_dir=shm, job_id=store_id, rank=0, num_slots=n)
    steps = []
    for step in range(warmup + n):
        x, y = corpus.batch(step=step, rank=0, batch=batch, seq=cfg.seq)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= warmup:
            store.write(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
            steps.append(step)
    store.close()
    return steps


def _timed_fetch(
    addr: str, secret: bytes, step: int, base: tuple[int, Any] | None, target: RankSnapshotStore
) -> tuple[Fetched, float]:
    t0 = time.perf_counter()
    got = fetch(addr, secret, node="target", rank=0, step=step, kind="local", base=base, track=True)
    target.write_raw(step, got.meta, got.data)
    return got, time.perf_counter() - t0


def measure_link(shm: Path, store_id: str, steps: list[int], link_mb_s: float, reps: int) -> dict[str, Any]:
    secret = new_secret()
    holder = DataPlane(
        host="127.0.0.1",
        port=0,
        secret=secret,
        local=shm_stores(shm, store_id, len(steps)),
        replica=shm_stores(shm, f"{store_id}.rep", 2),
        bandwidth_bytes_s=link_mb_s * 1e6 if link_mb_s else None,
    )
    target = RankSnapshotStore(shm_dir=shm, job_id=f"target-{uuid.uuid4().hex[:6]}", rank=0, num_slots=2)
    whole_s: list[float] = []
    delta_s: list[float] = []
    whole_wire: list[int] = []
    delta_wire: list[int] = []
    raw = 0
    try:
        _timed_fetch(holder.addr, secret, steps[0], None, target)  # warm-up: connections, pages
        for _ in range(reps):
            for prev, cur in itertools.pairwise(steps):
                got_w, t_w = _timed_fetch(holder.addr, secret, prev, None, target)
                assert got_w.base is None
                got_d, t_d = _timed_fetch(holder.addr, secret, cur, (prev, got_w.data), target)
                if got_d.base != prev:
                    raise RuntimeError(f"step {cur} came whole, not as a delta against {prev}")
                whole_s.append(t_w)
                delta_s.append(t_d)
                whole_wire.append(got_w.wire_bytes)
                delta_wire.append(got_d.wire_bytes)
                raw = len(got_d.data)
    finally:
        target.close()
        holder.close()
    tw, td = statistics.median(whole_s), statistics.median(delta_s)
    return {
        "link_mb_s": link_mb_s or None,
        "raw_bytes": raw,
        "whole_s": summarize(whole_s),
        "delta_s": summarize(delta_s),
        "whole_wire_bytes": statistics.median(whole_wire),
        "delta_wire_bytes": statistics.median(delta_wire),
        "delta_ratio": raw / statistics.median(delta_wire),
        "delta_speedup": tw / td,
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--warmup", type=int, default=20, help="training steps before the captured ones")
    ap.add_argument("--pairs", type=int, default=4, help="consecutive (s-1, s) pairs per pass")
    ap.add_argument("--reps", type=int, default=3, help="passes over the pairs per link")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--links", default="0,1250,125,25", help="link speeds in MB/s, 0 = loopback (default %(default)s)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny preset, 2 links, 1 rep (smoke test)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "catchup.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.warmup, args.pairs, args.reps, args.links = "tiny", 3, 2, 1, "0,25"
    links = [float(x) for x in args.links.split(",")]
    store_id = f"bench-catchup-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="nonstop-catchup-", dir="/dev/shm") as d:
        shm = Path(d)
        t0 = time.perf_counter()
        steps = capture_states(shm, store_id, args.preset, args.warmup, args.pairs + 1, args.batch)
        train_s = time.perf_counter() - t0
        results = [measure_link(shm, store_id, steps, mb, args.reps) for mb in links]
    loop = next((r for r in results if r["link_mb_s"] is None), None)
    crossover = None
    if loop is not None:
        extra = loop["delta_s"]["median"] - loop["whole_s"]["median"]  # the delta's CPU cost
        saved = loop["raw_bytes"] * (1 - 1 / loop["delta_ratio"])  # bytes it keeps off the link
        crossover = saved / extra / 1e6 if extra > 0 else None
    report = {
        "benchmark": "catchup",
        **run_stamp(),
        "machine": machine_info(),
        "params": {**vars(args), "out": str(args.out), "steps": steps, "train_s": train_s},
        "links": results,
        "predicted_crossover_mb_s": crossover,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{args.preset}: {results[0]['raw_bytes'] / 1e6:.1f} MB per step, delta ratio "
        f"{statistics.median(r['delta_ratio'] for r in results):.2f}x"
    )
    print(f"{'link MB/s':>10}  {'whole s':>22}  {'delta s':>22}  {'speedup':>8}")
    for r in results:
        name = "loopback" if r["link_mb_s"] is None else f"{r['link_mb_s']:g}"
        print(
            f"{name:>10}  {fmt(r['whole_s'], digits=3):>22}  {fmt(r['delta_s'], digits=3):>22}  "
            f"{r['delta_speedup']:>7.2f}x"
        )
    if crossover is not None:
        print(f"predicted from loopback: a delta wins below ~{crossover:.0f} MB/s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
