"""Persist throughput of the durable tier ÷ the disk's sequential write speed, in one run.

What is measured. ``--ranks`` snapshot slots in /dev/shm hold a W-state each (GPT-like
fp32 model + AdamW state after one step, ``--size`` per rank). Alternating, ``--runs``
times after a warm-up:

* ``dd``: ``dd if=/dev/zero of=FILE bs=16M count=N oflag=direct conv=fsync`` of the same
  total bytes on the same disk: the sequential write speed;
* ``persist_<codec>``: ``Persister.flush()`` end to end on one thread (one long-lived
  persister per contender, a new committed step each round, full checkpoints), exactly what
  the agent does at a persist: copy every rank's slot out under a pin, encode (full
  checkpoint: shuffle + codec, CRC-32C per chunk), write each rank's ``.bin`` (O_DIRECT,
  fsync), the manifest, ``latest``; retention. Codecs: ``none`` (raw bytes) and ``zstd``
  (zstd-1 + shuffle) with ``--threads`` encode threads.

Figures: seconds per run; raw GB/s (state bytes / seconds) and stored GB/s (bytes written
/ seconds); ratio persist raw GB/s ÷ dd GB/s per round, then median/min/max.

Run it::

    .venv/bin/python benchmarks/bench_persist.py             # -> benchmarks/results/persist.json
    .venv/bin/python benchmarks/bench_persist.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from benchmarks.stallworkload import build_workload  # noqa: E402
from nonstop.agent.processes import remove_segments  # noqa: E402
from nonstop.snapshot import RankSnapshotStore, StateCapture  # noqa: E402
from nonstop.snapshot.codec import CodecConfig  # noqa: E402
from nonstop.snapshot.durable import DurableStore  # noqa: E402
from nonstop.snapshot.persist import Persister  # noqa: E402

SHM = Path("/dev/shm")
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "persist.json"


def dd_write(path: Path, total: int) -> float:
    count = max(1, total // (16 << 20))
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    path.unlink()
    return count * (16 << 20) / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--size", default="500MB", help="W-state bytes per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="encode threads for the zstd contender")
    ap.add_argument("--disk-dir", type=Path, default=REPO_ROOT / ".nonstop")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.runs = "50MB", 1
    job_id = f"benchpersist{uuid.uuid4().hex[:8]}"
    work = build_workload(args.size, "float32")
    cap = StateCapture(model=work.model, optimizer=work.optimizer)
    total = 0
    for rank in range(args.ranks):
        store = RankSnapshotStore(shm_dir=SHM, job_id=job_id, rank=rank)
        total += store.write(1, cap.state(1))
        store.close()
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    contenders = {  # full checkpoints every time (full_every=1): the throughput case
        "persist_none": CodecConfig(codec="none", full_every=1),
        "persist_zstd": CodecConfig(threads=args.threads, full_every=1),
    }
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="nonstop-bench-persist-", dir=args.disk_dir) as tmp:
            # One long-lived persister per contender, as in a job: its copy-out buffers are reused.
            persisters = {
                name: Persister(
                    durable=DurableStore(str(Path(tmp) / name), keep=1),
                    shm_dir=SHM,
                    job_id=job_id,
                    world_size=args.ranks,
                    codec=codec,
                )
                for name, codec in contenders.items()
            }
            for i in range(args.runs + 1):
                step = i + 2
                for rank in range(args.ranks):  # a new committed step to persist (untimed)
                    store = RankSnapshotStore(shm_dir=SHM, job_id=job_id, rank=rank)
                    store.write(step, cap.state(step))
                    store.close()
                row: dict[str, Any] = {"dd_gb_per_s": dd_write(Path(tmp) / "dd.bin", total)}
                for name, persister in persisters.items():
                    t0 = time.perf_counter()
                    result = persister.flush(600)
                    seconds = time.perf_counter() - t0
                    if result is None or result.step != step:
                        raise RuntimeError(f"{name}: persist failed: {persister.last_error}")
                    row[name] = {
                        "seconds": seconds,
                        "raw_gb_per_s": result.raw_bytes / seconds / 1e9,
                        "stored_gb_per_s": result.stored_bytes / seconds / 1e9,
                        "ratio_to_dd": result.raw_bytes / seconds / 1e9 / row["dd_gb_per_s"],
                        "compression": result.raw_bytes / result.stored_bytes,
                    }
                print(
                    f"[bench] round {i}: dd {row['dd_gb_per_s']:.2f} GB/s  "
                    + "  ".join(f"{n} {row[n]['raw_gb_per_s']:.2f} GB/s raw" for n in contenders),
                    flush=True,
                )
                if i > 0:
                    rows.append(row)
            for persister in persisters.values():
                persister.stop()
    finally:
        remove_segments(SHM, job_id)
    summary: dict[str, Any] = {"dd_gb_per_s": statistics.median(r["dd_gb_per_s"] for r in rows)}
    for name in contenders:
        ratios = [r[name]["ratio_to_dd"] for r in rows]
        summary[name] = {
            "raw_gb_per_s": statistics.median(r[name]["raw_gb_per_s"] for r in rows),
            "stored_gb_per_s": statistics.median(r[name]["stored_gb_per_s"] for r in rows),
            "compression": statistics.median(r[name]["compression"] for r in rows),
            "ratio_to_dd": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        }
    report = {
        "benchmark": "persist",
        "workload": {
            "size_per_rank": args.size,
            "ranks": args.ranks,
            "total_bytes": total,
            "runs": args.runs,
        },
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "disk_dir": str(args.disk_dir),
            "dd": re.sub(r"\s+", " ", "dd bs=16M oflag=direct conv=fsync"),
        },
        "rounds": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
