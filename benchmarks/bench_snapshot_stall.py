"""How long one snapshot blocks the training loop, for a GPT-like model with AdamW state.

What is measured
----------------
The wall-clock time the caller is blocked by one snapshot of a "W-state": the
``state_dict`` of a GPT-like ``nn.Module`` (token + position embeddings,
transformer blocks made of ``nn.Linear`` and ``nn.LayerNorm``) plus the state of a
real ``torch.optim.AdamW`` after one ``step()`` (``exp_avg``, ``exp_avg_sq`` and
``step`` for every parameter), i.e. about 3x the parameter bytes. Contenders, run
on the same state in the same process, in the order below once per run (the first
run is a warm-up and is not counted):

* ``floor``: ``dst.copy_(src)`` of every tensor into one preallocated
  shared-memory buffer (a ``/dev/shm`` file, mmap'd, per-tensor destination views
  made once up front). The memory-bandwidth floor of any in-memory snapshot.
* ``nonstop``: ``RankSnapshotStore.write(step, StateCapture.state(step))`` with two
  slots alternating as in training (both slots are written once before timing).
* ``nonstop_overlapped``: ``RankSnapshotStore.begin`` as training uses it; the bulk
  copy runs during a simulated forward/backward of twice the run's floor time, then
  the optimizer-step fence. Stall = time in ``begin`` + time blocked in the fence.
* ``torch_save``: ``torch.save({"model": ..., "optim": ...}, path)`` on a local disk,
  until it returns; ``torch_save_fsync`` is the same run including ``os.fsync``.
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` with one reused
  ``DefaultStager`` (shared-memory staging), until ``async_save`` returns; the
  background write is then waited for, untimed, before the next contender runs.

Stall is a memory copy, so it does not depend on tensor values: weights are left
at their random init. Sizes are total state bytes (so a bf16 case has twice the
parameters of the fp32 case of the same size).

How to run
----------
::

    .venv/bin/python benchmarks/bench_snapshot_stall.py                  # 500MB,2GB x float32,bfloat16
    .venv/bin/python benchmarks/bench_snapshot_stall.py --quick          # ~50 MB smoke run
    .venv/bin/python benchmarks/bench_snapshot_stall.py --sizes 500MB --dtypes float32 --runs 3

Results go to ``benchmarks/results/snapshot_stall.json`` (``--out``); a table of
median milliseconds and ratio to the floor is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import platform
import shutil
import socket
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.stallworkload import (  # noqa: E402
    DTYPES,
    Workload,
    build_workload,
    parse_size,
    plan_model,
)
from nonstop.snapshot import RankSnapshotStore, StateCapture  # noqa: E402

SHM_DIR = Path("/dev/shm")
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "snapshot_stall.json"
DEFAULT_DISK_TMP = REPO_ROOT / ".nonstop" / "bench-tmp"
ALIGN = 64
QUICK_SIZE = "50MB"
CONTENDERS = ("floor", "nonstop", "nonstop_overlapped", "torch_save", "dcp_async")
COMPUTE_PER_FLOOR = 2.0  # overlapped case: simulated forward+backward lasts this many floor copies


# --------------------------------------------------------------------------- contenders


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Contender:
    """One way of taking a snapshot. ``run()`` returns {figure name: seconds}."""

    name = ""

    def __init__(self, work: Workload, tag: str) -> None:
        self.work = work
        self.tag = tag
        self.error: str | None = None

    def setup(self) -> None:
        pass

    def run(self) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class FloorCopy(Contender):
    """Bare ``copy_`` of every tensor into one preallocated /dev/shm buffer."""

    name = "floor"

    def setup(self) -> None:
        self.path = SHM_DIR / f"nonstop-bench-floor-{self.tag}"
        self.srcs = self.work.tensors()
        offsets, off = [], 0
        for t in self.srcs:
            offsets.append(off)
            off = _align(off + t.numel() * t.element_size())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, max(off, ALIGN))
            self.mm: mmap.mmap | None = mmap.mmap(fd, max(off, ALIGN), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.dsts = [
            buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for o, t in zip(offsets, self.srcs, strict=True)
        ]
        self.nbytes = off

    def run(self) -> dict[str, float]:
        t0 = time.perf_counter()
        for dst, src in zip(self.dsts, self.srcs, strict=True):
            dst.copy_(src)
        self.last = time.perf_counter() - t0
        return {self.name: self.last}

    def close(self) -> None:
        self.dsts, self.srcs = [], []
        if getattr(self, "mm", None) is not None:
            assert self.mm is not None
            self.mm.close()
            self.mm = None
        if hasattr(self, "path"):
            self.path.unlink(missing_ok=True)


class NonstopWrite(Contender):
    """``RankSnapshotStore.write(step, StateCapture.state(step))``, slots alternating."""

    name = "nonstop"

    def setup(self) -> None:
        self.job_id = f"bench{self.tag}"
        self.store = RankSnapshotStore(shm_dir=SHM_DIR, job_id=self.job_id, rank=0, num_slots=2)
        self.capture = StateCapture(model=self.work.model, optimizer=self.work.optimizer)
        self.step = 0
        # The first write to each slot allocates it; the harness's warm-up run is the 2nd.
        self.store.write(self.step, self.capture.state(self.step))

    def run(self) -> dict[str, float]:
        self.step += 1
        t0 = time.perf_counter()
        self.store.write(self.step, self.capture.state(self.step))
        return {self.name: time.perf_counter() - t0}

    def close(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
            for p in SHM_DIR.glob(f"nonstop-{self.job_id}-*"):
                p.unlink(missing_ok=True)


class NonstopOverlapped(NonstopWrite):
    """``RankSnapshotStore.begin`` as ``Session.run`` uses it: the volatile part is copied at
    once, parameters and optimizer state in the background while a simulated forward and
    backward pass runs (matmuls for COMPUTE_PER_FLOOR x this run's floor time), then the
    optimizer-step fence. Stall = time in ``begin`` + time blocked in the fence."""

    name = "nonstop_overlapped"

    def __init__(self, work: Workload, tag: str, floor: FloorCopy) -> None:
        super().__init__(work, tag + "o")
        self.floor = floor
        self.a = torch.randn(384, 384)

    def run(self) -> dict[str, float]:
        self.step += 1
        compute_s = COMPUTE_PER_FLOOR * getattr(self.floor, "last", 0.05)
        t0 = time.perf_counter()
        pending = self.store.begin(
            self.step, self.capture.state(self.step), deferred=self.capture.deferrable()
        )
        t_begin = time.perf_counter() - t0
        end = time.perf_counter() + compute_s
        while time.perf_counter() < end:  # the next step's forward and backward
            self.a = torch.tanh(self.a @ self.a)
        t1 = time.perf_counter()
        pending.fence()  # what the optimizer-step pre-hook does
        t_wait = time.perf_counter() - t1
        return {self.name: t_begin + t_wait}


class TorchSave(Contender):
    """``torch.save`` to a local disk file; also the time including ``os.fsync``."""

    name = "torch_save"

    def __init__(self, work: Workload, tag: str, disk_dir: Path) -> None:
        super().__init__(work, tag)
        self.disk_dir = disk_dir

    def setup(self) -> None:
        self.path = self.disk_dir / f"torch-save-{self.tag}.pt"

    def run(self) -> dict[str, float]:
        obj = {"model": self.work.model.state_dict(), "optim": self.work.optimizer.state_dict()}
        try:
            t0 = time.perf_counter()
            torch.save(obj, self.path)
            t1 = time.perf_counter()
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            t2 = time.perf_counter()
        finally:
            self.path.unlink(missing_ok=True)
        return {self.name: t1 - t0, "torch_save_fsync": t2 - t0}

    def close(self) -> None:
        if hasattr(self, "path"):
            self.path.unlink(missing_ok=True)


class DcpAsyncSave(Contender):
    """``dcp.async_save`` with one reused shared-memory ``DefaultStager``."""

    name = "dcp_async"

    def __init__(self, work: Workload, tag: str, disk_dir: Path) -> None:
        super().__init__(work, tag)
        self.disk_dir = disk_dir
        self.stager: Any = None
        self.runs = 0

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        # On CPU: pinned memory is ignored (with a warning), and non-blocking copies / a
        # staging stream need an accelerator (DefaultStager raises), so only shared
        # memory stays on. Staging is synchronous: async_save returns once the state is
        # copied, i.e. when training may mutate it again. The stager caches its staged
        # storages (keyed by source storage), so reusing it avoids re-allocation.
        self.options = StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
        self.stager = DefaultStager(self.options)

    def run(self) -> dict[str, float]:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        ckpt = self.disk_dir / f"dcp-{self.tag}-{self.runs}"
        self.runs += 1
        state = {"model": self.work.model.state_dict(), "optim": self.work.optimizer.state_dict()}
        try:
            t0 = time.perf_counter()
            res = async_save(state, checkpoint_id=str(ckpt), async_stager=self.stager, no_dist=True)
            t1 = time.perf_counter()
            # Not timed: the background write must end before the next contender runs.
            if isinstance(res, AsyncSaveResponse):  # only with use_async_staging=True
                res.staging_completion.result()
                res.upload_completion.result()
            else:
                res.result()
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        return {self.name: t1 - t0}

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


# --------------------------------------------------------------------------- harness


def machine_info() -> dict[str, Any]:
    mem_total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    except OSError:
        pass
    shm = os.statvfs(SHM_DIR) if SHM_DIR.exists() else None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_bytes": mem_total,
        "shm_total_bytes": shm.f_blocks * shm.f_frsize if shm else None,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
    }


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(state_bytes: int, disk_dir: Path) -> str | None:
    """None if a case of ``state_bytes`` fits, else why not.

    Besides the state itself: floor buffer (1x), two nonstop slots (2x) and DCP's
    shared-memory staging copy (1x) live in RAM / tmpfs at once; the disk holds one
    checkpoint at a time.
    """
    need_shm = int(4.1 * state_bytes)
    need_ram = int(5.5 * state_bytes)  # the state (+ grads while building) + the 4x above
    shm = os.statvfs(SHM_DIR)
    free_shm = shm.f_bavail * shm.f_frsize
    if free_shm < need_shm:
        return f"/dev/shm has {free_shm / 1e9:.1f} GB free, case needs ~{need_shm / 1e9:.1f} GB"
    avail = _mem_available()
    if avail is not None and avail < need_ram:
        return f"MemAvailable {avail / 1e9:.1f} GB, case needs ~{need_ram / 1e9:.1f} GB"
    disk = os.statvfs(disk_dir)
    if disk.f_bavail * disk.f_frsize < 1.3 * state_bytes:
        return f"{disk_dir} has too little free disk for one checkpoint"
    return None


def summarize(runs: dict[str, list[float]], errors: dict[str, str], state_bytes: int) -> dict[str, Any]:
    floor = runs.get("floor", [])
    out: dict[str, Any] = {}
    names = [*CONTENDERS[:4], "torch_save_fsync", *CONTENDERS[4:]]
    for name in names:
        vals = runs.get(name, [])
        entry: dict[str, Any] = {"runs_s": vals}
        if name in errors:
            entry["error"] = errors[name]
        if vals:
            entry.update(median_s=statistics.median(vals), min_s=min(vals), max_s=max(vals))
            if floor and len(floor) == len(vals):
                ratios = [v / f for v, f in zip(vals, floor, strict=True) if f > 0]
                entry["ratio_to_floor"] = {
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "how": "per-run ratio to the floor of the same run, then median/min/max",
                }
        out[name] = entry
    if floor:
        out["floor"]["gb_per_s_at_median"] = state_bytes / statistics.median(floor) / 1e9
        out["floor"]["gb_per_s_best"] = state_bytes / min(floor) / 1e9
    return out


def run_case(
    size_label: str, dtype_name: str, runs: int, disk_dir: Path, *, sharded: bool = False
) -> dict[str, Any]:
    case: dict[str, Any] = {"case": f"{size_label}/{dtype_name}" + ("/fsdp2" if sharded else "")}
    dtype = DTYPES[dtype_name]
    planned_bytes = 3 * plan_model(parse_size(size_label), dtype).param_count() * dtype.itemsize
    why_not = check_fits(planned_bytes, disk_dir)
    if why_not is not None:
        case["skipped"] = why_not
        return case
    t_build = time.perf_counter()
    work = build_workload(size_label, dtype_name, sharded=sharded)
    desc = work.describe()
    desc["build_s"] = time.perf_counter() - t_build
    case["workload"] = desc

    tag = uuid.uuid4().hex[:12]
    floor = FloorCopy(work, tag)
    contenders: list[Contender] = [floor, NonstopWrite(work, tag), NonstopOverlapped(work, tag, floor)]
    if not sharded:  # (the disk savers of a sharded state need a real process group: bench_mttr --mesh)
        contenders += [TorchSave(work, tag, disk_dir), DcpAsyncSave(work, tag, disk_dir)]
    results: dict[str, list[float]] = {}
    errors: dict[str, str] = {}
    t_case = time.perf_counter()
    try:
        for c in contenders:
            try:
                c.setup()
            except Exception as e:
                c.error = f"setup: {type(e).__name__}: {e}"
        for run_idx in range(runs + 1):  # run 0 is the warm-up
            for c in contenders:
                if c.error is not None:
                    continue
                gc.collect()
                try:
                    figures = c.run()
                except Exception as e:
                    c.error = f"run {run_idx}: {type(e).__name__}: {e}"
                    continue
                if run_idx > 0:
                    for k, v in figures.items():
                        results.setdefault(k, []).append(v)
        for c in contenders:
            if c.error is not None:
                errors[c.name] = c.error
                # A contender that failed part-way has fewer runs than the floor: drop them.
                for k in [k for k in results if k == c.name or k.startswith(c.name + "_")]:
                    del results[k]
    finally:
        for c in contenders:
            try:
                c.close()
            except Exception as e:
                errors.setdefault(c.name, f"close: {type(e).__name__}: {e}")
    case["measure_s"] = time.perf_counter() - t_case
    case["counted_runs"] = runs
    case["contenders"] = summarize(results, errors, desc["total_state_bytes"])
    del contenders, work
    gc.collect()
    return case


def print_table(cases: Sequence[dict[str, Any]], write: Callable[[str], None] = print) -> None:
    write(f"{'case':<18} {'contender':<17} {'median ms':>11} {'x floor':>9}")
    for case in cases:
        if "skipped" in case:
            write(f"{case['case']:<18} skipped: {case['skipped']}")
            continue
        for name, entry in case["contenders"].items():
            if "median_s" in entry:
                ratio = entry.get("ratio_to_floor", {}).get("median", math.nan)
                write(f"{case['case']:<18} {name:<17} {entry['median_s'] * 1e3:>11.1f} {ratio:>9.2f}")
            elif "error" in entry:
                write(f"{case['case']:<18} {name:<17} {'error':>11}  {entry['error'][:80]}")
        floor = case["contenders"].get("floor", {})
        if "gb_per_s_at_median" in floor:
            write(f"{case['case']:<18} {'(floor GB/s)':<17} {floor['gb_per_s_at_median']:>11.2f}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="500MB,2GB", help="total state bytes per case, comma-separated")
    ap.add_argument(
        "--dtypes", default=None, help="comma-separated: float32,bfloat16 (default both; --quick: float32)"
    )
    ap.add_argument("--runs", type=int, default=None, help="counted runs after 1 warm-up (default 5)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--disk-dir", type=Path, default=DEFAULT_DISK_TMP, help="where on-disk saves go")
    ap.add_argument("--quick", action="store_true", help=f"one ~{QUICK_SIZE} state, 2 runs (smoke test)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument(
        "--sharded",
        action="store_true",
        help="FSDP2-shard the state over a fake 2-rank world first: one rank's local shards (DTensor "
        "state) against the bare copy of those shards (floor, nonstop, nonstop_overlapped only)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = QUICK_SIZE
        args.runs = 2 if args.runs is None else args.runs
        args.dtypes = "float32" if args.dtypes is None else args.dtypes
    elif args.runs is None:
        args.runs = 5
    if args.dtypes is None:
        args.dtypes = ",".join(DTYPES)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    args.size_list = [s.strip() for s in args.sizes.split(",") if s.strip()]
    args.dtype_list = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtype_list:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {', '.join(DTYPES)}")
    for s in args.size_list:
        try:
            parse_size(s)
        except ValueError:
            ap.error(f"bad size {s!r}; use e.g. 500MB or 2GB")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Single-process DCP save warns on every call that no process group exists; that is intended.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    disk_dir: Path = args.disk_dir
    disk_dir.mkdir(parents=True, exist_ok=True)
    if disk_dir.resolve().is_relative_to(SHM_DIR):
        raise SystemExit("--disk-dir must be on a disk, not /dev/shm")
    t0 = time.perf_counter()
    cases: list[dict[str, Any]] = []
    try:
        for size in args.size_list:
            for dtype in args.dtype_list:
                print(f"[bench] {size}/{dtype}: building state ...", flush=True)
                case = run_case(size, dtype, args.runs, disk_dir, sharded=args.sharded)
                cases.append(case)
                print_table([case])
                gc.collect()
    finally:
        try:
            disk_dir.rmdir()  # only if empty: every contender removes its own files
        except OSError:
            pass
    report = {
        "benchmark": "snapshot_stall",
        "what": "seconds the caller is blocked by one snapshot of model + AdamW state (W-state)",
        "notes": [
            "Stall is a memory copy (or serialisation), independent of tensor values: weights are random.",
            "Sizes are total state bytes (params + exp_avg + exp_avg_sq); bf16 cases have 2x the params.",
            "Contenders alternate floor, nonstop, torch_save, dcp_async within each run; run 0 is a "
            "warm-up and is not counted.",
            "floor: dst.copy_(src) into one preallocated mmap'd /dev/shm buffer.",
            "nonstop: RankSnapshotStore.write(step, StateCapture.state(step)), 2 slots alternating, "
            "both allocated before timing; includes building the state dict, RNG state and JSON meta.",
            "nonstop_overlapped: RankSnapshotStore.begin(...) + the optimizer-step fence after a simulated "
            f"forward/backward of {COMPUTE_PER_FLOOR}x the same run's floor time (tanh(A@A) matmuls); "
            "stall = time in begin + time blocked in the fence.",
            "torch_save: torch.save to local disk until return; torch_save_fsync adds os.fsync.",
            "dcp_async: dcp.async_save(no_dist=True) with one reused DefaultStager(StagingOptions("
            "use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, "
            "use_non_blocking_copy=False)); time until async_save returns (staging done); the "
            "background write is waited for, untimed. StagingOptions has no cache_staged_state_dict "
            "in this torch; the stager caches staged storages itself.",
        ],
        "machine": machine_info(),
        "config": {
            "sizes": args.size_list,
            "dtypes": args.dtype_list,
            "runs": args.runs,
            "quick": args.quick,
            "disk_dir": str(disk_dir),
        },
        "total_s": time.perf_counter() - t0,
        "cases": cases,
    }
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n[bench] total {report['total_s']:.1f} s; wrote {out}")
    print_table(cases)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
