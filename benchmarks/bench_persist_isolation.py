"""How long a process's own loop stalls while a persist runs beside it, on a saturated CPU: the
persist on a nice-19 thread of that process (nonstop before this benchmark) against the same thread
at the process's own priority (nonstop now).

Why: a node agent's loop renews its lease, and the coordinator's loop acknowledges renewals and
judges hangs. A nice-19 *thread* takes its process's GIL and then waits for the kernel, which on
a saturated CPU seldom runs it, so every other thread of the process waits too; a node fenced
itself in a loaded test job that way.

What is measured, alternating per round (``--runs``, after a warm-up):

* ``--busy`` CPU burners, placed two ways (each round runs both): ``own`` -- in sessions of
  their own, as a node's training processes are (with the kernel's autogroups, the default on
  many distributions, a nice value then counts only within the measuring process's group);
  ``shared`` -- in the measuring process's session (the same group: as without autogroups, or
  with other CPU work in the agent's session);
* the measuring process's main thread ticks ``time.sleep(0.01)`` for ``--seconds`` and records
  each gap between ticks, while a helper thread persists ``--size`` of a W-state (fp32 model +
  AdamW state, ``--ranks`` ranks in snapshot slots) again and again into a durable root: full
  checkpoints, zstd-1, as a persist round writes its ranks
  (:class:`~nonstop.snapshot.persist.RankEncoder`, what the agent's persist thread does):

  * ``nice19``: the helper thread renices itself to 19 first (before);
  * ``nice0``: it runs at the process's own priority (now).

Figures: per mode and placement, the 99th percentile and the largest gap of each round
(seconds), and how many persists completed; median over rounds; ratio nice0/nice19 per round
and placement. JSON to ``benchmarks/results/persist_isolation.json``.

Run it::

    .venv/bin/python benchmarks/bench_persist_isolation.py
    .venv/bin/python benchmarks/bench_persist_isolation.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchcommon import machine_info, run_stamp, summarize
from stallworkload import build_workload

from nonstop.snapshot.capture import StateCapture
from nonstop.snapshot.codec import CodecConfig
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.persist import RankEncoder
from nonstop.snapshot.store import RankSnapshotStore

SHM = Path("/dev/shm")
TICK_S = 0.01
MODES = ("nice19", "nice0")
PLACES = ("shared", "own")  # where the burners run: the measuring process's session, or their own


def _burners(n: int, *, own_session: bool) -> list[subprocess.Popen[bytes]]:
    cmd = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(cmd, start_new_session=own_session) for _ in range(n)]


class Persisting:
    """``ranks`` slots holding one step of a W-state, and the persist a round runs on them."""

    def __init__(self, size: str, ranks: int, root: Path) -> None:
        self.job = f"iso{secrets.token_hex(4)}"
        work = build_workload(size, "float32")
        cap = StateCapture(model=work.model, optimizer=work.optimizer)
        self.stores = [RankSnapshotStore(shm_dir=SHM, job_id=self.job, rank=r) for r in range(ranks)]
        for s in self.stores:
            s.write(1, cap.state(1))
        self.ranks = list(range(ranks))
        self.root = root
        self.codec = CodecConfig(full_every=1)
        self.encoder = RankEncoder(self.codec)
        self.n = 0  # persists so far (each into a root of its own)

    def _open(self) -> tuple[DurableStore, Any]:
        """A fresh root for checkpoint 1 (what the slots hold), the previous one removed."""
        shutil.rmtree(self.root / f"p{self.n}", ignore_errors=True)
        self.n += 1
        durable = DurableStore(self.root / f"p{self.n}", keep=1)
        return durable, durable.begin(1, len(self.ranks), self.codec.describe())

    def by_thread(self) -> None:
        durable, writer = self._open()
        snaps = [s.copy_out(1, out=self.encoder.scratch(s.rank)) for s in self.stores]
        contrib = durable.contribute(1, len(self.ranks), self.codec.describe())
        self.encoder.write(contrib, snaps)
        for r in self.ranks:
            writer.adopt(contrib.record(r))
        writer.commit()

    def close(self) -> None:
        self.encoder.close()
        for s in self.stores:
            s.close()
        for seg in SHM.glob(f"nonstop-{self.job}-*"):  # the slots' segments (close keeps them)
            seg.unlink(missing_ok=True)


def measure(p: Persisting, mode: str, seconds: float) -> dict[str, float]:
    stop = threading.Event()
    done = [0]

    def persist() -> None:
        if mode == "nice19":
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # as the old persist thread
        while not stop.is_set():
            p.by_thread()
            done[0] += 1

    helper = threading.Thread(target=persist, daemon=True)
    gaps: list[float] = []
    helper.start()
    last = time.monotonic()
    end = last + seconds
    while last < end or (done[0] == 0 and last < end + 120):  # at least one persist measured
        time.sleep(TICK_S)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
    stop.set()
    helper.join()
    gaps.sort()
    return {"p99_gap_s": gaps[int(0.99 * (len(gaps) - 1))], "max_gap_s": gaps[-1], "persists": float(done[0])}


def _pairs(rounds: dict[str, list[dict[str, float]]], where: str) -> list[tuple[dict[str, float], ...]]:
    return list(zip(rounds[f"nice0/{where}"], rounds[f"nice19/{where}"], strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100MB", help="W-state per rank (stallworkload sizes)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--busy", type=int, default=os.cpu_count() or 2, help="CPU burners (default: one per CPU)"
    )
    ap.add_argument("--seconds", type=float, default=20.0, help="per mode and round")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="10 MB per rank, 4 s, 1 round")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results/persist_isolation.json"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.seconds, args.runs = "10MB", 4.0, 1
    root = Path(tempfile.mkdtemp(prefix="nonstop-iso-"))
    p = Persisting(args.size, args.ranks, root)
    cases = [f"{m}/{where}" for where in PLACES for m in MODES]
    rounds: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
    try:
        for m in MODES:  # warm-up: first-write allocations
            measure(p, m, min(2.0, args.seconds))
        for _ in range(args.runs):
            for where in PLACES:
                burners = _burners(args.busy, own_session=where == "own")
                try:
                    for m in MODES:
                        rounds[f"{m}/{where}"].append(measure(p, m, args.seconds))
                        print(f"{m}/{where}", rounds[f"{m}/{where}"][-1], flush=True)
                finally:
                    for b in burners:
                        b.kill()
                        b.wait()
    finally:
        p.close()
        shutil.rmtree(root, ignore_errors=True)
    report: dict[str, Any] = {
        **run_stamp(),
        "machine": machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": rounds,
        "summary": {
            c: {k: summarize([r[k] for r in rounds[c]]) for k in ("p99_gap_s", "max_gap_s", "persists")}
            for c in cases
        },
        "nice0_over_nice19": {
            where: {
                k: summarize([c[k] / t[k] for c, t in _pairs(rounds, where)])
                for k in ("p99_gap_s", "max_gap_s")
            }
            for where in PLACES
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for m in cases:
        s = report["summary"][m]
        print(f"{m:13s} p99 gap {s['p99_gap_s']['median']:.3f}s  max gap {s['max_gap_s']['median']:.3f}s  "
              f"persists {s['persists']['median']:.0f}")  # fmt: skip
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
