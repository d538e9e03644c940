"""What an every-step snapshot costs a training loop on an accelerator (issue 20), and how fast the
device-to-host copy into nonstop's page-locked slots runs against the PCIe floor.

What is measured
----------------
1. **Device-to-host bandwidth** of one ``--bw-gb`` state (float32 tensors of 64 MiB), best of 3:
   ``pinned``: ``copy_`` into one page-locked buffer (``pin_memory=True``): the floor of any copy
   out of the device; ``pageable``: into ordinary memory (the driver stages it); ``nonstop``:
   ``RankSnapshotStore.write`` into slot memory page-locked by ``prefault`` (``cudaHostRegister``
   in chunks), header and all.
2. **Every-step cost in a real training loop**: a GPT-like model (``nonstop.demo.model``) with
   AdamW on the device, random tokens; per step forward, backward, optimizer step, ``loss.item()``
   (so each step's time includes its GPU work). Contenders, alternated in rounds (round 0 is a
   warm-up and is not counted), the same model and optimizer throughout:

   * ``none``: no snapshot;
   * ``nonstop``: as ``Session`` trains: after the optimizer step ``begin(step, state,
     deferred=capture.deferrable())`` (parameters and optimizer state copied on a side stream,
     overlapped with the next forward and backward), ``fence()`` before the next optimizer step
     (a device-side wait for the copies); its deferred copies are issued 64 MiB at a time
     (``nonstop.snapshot.device``, "Paced copies");
   * ``nonstop_deep``: the same with 8 batches queued per device instead of 2
     (``RankSnapshotStore(device_depth=8)``: 512 MiB, ~10 ms of PCIe, twice CPython's GIL switch
     interval): whether the steps that wait for a whole copy are a copier thread starved of the
     GIL while the loop holds it (the copy engine idles between its batches). Every write's
     copier timeline (``PendingWrite.timeline``) is kept per step for both paced contenders: a
     late pick-up, an issue far longer than its waits for landing (GIL), or landing waits that
     fill it (a busy copy engine). What nonstop did before the pacing (every copy issued by
     ``begin``: 1.36x the step) is no longer run;
   * ``nonstop_sync``: ``RankSnapshotStore.write`` of the whole state after each step;
   * ``dcp_stage``: torch's own async-checkpoint staging, ``DefaultStager(StagingOptions(
     use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
     use_non_blocking_copy=True)).stage(state_dict)`` of the model's state dict and the
     optimizer's per-parameter state (tensors only) after each step, its future waited for
     before the next optimizer step (what a loop must do for an untorn copy); the write to
     storage that ``async_save`` would add is not included.

   Reported per contender: median step time and its ratio to ``none``'s (the share of a step the
   snapshot adds), and the host time the caller spent in the snapshot calls.

On a CPU (``--device cpu``, the smoke run of ``make test-bench``) the same code runs with CPU
tensors and pageable slots; the figures then mean nothing for a GPU.

How to run
----------
::

    python benchmarks/bench_gpu_capture.py                       # on a CUDA machine
    python benchmarks/bench_gpu_capture.py --device cpu --quick  # smoke run anywhere

Results go to ``benchmarks/results/gpu_capture.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO_ROOT))

from nonstop.demo.model import GPT, GPTConfig  # noqa: E402
from nonstop.snapshot import RankSnapshotStore, StateCapture  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu_capture.json"
CONTENDERS = ("none", "nonstop", "nonstop_deep", "nonstop_sync", "dcp_stage")
PHASES = ("enqueue", "fence", "opt", "snapshot", "item")
"""A step's host time: forward and backward enqueued, the fence (or DCP's staging future), the
optimizer step enqueued, the snapshot call, ``loss.item()`` (the wait for the step's GPU work)."""
COPIER = ("picked_up_s", "batches", "issue_s", "landing_s")
"""The copier's timeline of the write a step fenced (``PendingWrite.timeline``), where it has one."""
TENSOR_BYTES = 64 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slot_dir(need_bytes: int) -> Path:
    """/dev/shm when it has room for ``need_bytes`` (a container's may be 64 MiB), else a temp dir."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > need_bytes else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="nonstop-gpu-bench-", dir=base))


# -- 1. bandwidth ----------------------------------------------------------------------------------
def bandwidth(device: torch.device, gb: float) -> dict[str, Any]:
    n = max(1, int(gb * (1 << 30)) // TENSOR_BYTES)
    srcs = [torch.randn(TENSOR_BYTES // 4, device=device) for _ in range(n)]
    nbytes = n * TENSOR_BYTES
    pin = device.type == "cuda"
    pinned = [torch.empty(TENSOR_BYTES // 4, pin_memory=pin) for _ in range(n)]
    pageable = [torch.empty(TENSOR_BYTES // 4) for _ in range(n)]

    def best_gbps(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    def copy_all(dsts: list[torch.Tensor]) -> None:
        for d, s in zip(dsts, srcs, strict=True):
            d.copy_(s, non_blocking=pin)

    state = {f"t{i}": s for i, s in enumerate(srcs)}
    shm = slot_dir(3 * nbytes)
    store = RankSnapshotStore(shm_dir=shm, job_id="bw", rank=0, num_slots=2)
    try:
        t0 = time.perf_counter()
        store.prefault(state)
        prefault_s = time.perf_counter() - t0
        step = iter(range(1, 1000))
        out = {
            "bytes": nbytes,
            "pinned_gbps": best_gbps(lambda: copy_all(pinned)),
            "pageable_gbps": best_gbps(lambda: copy_all(pageable)),
            "nonstop_gbps": best_gbps(lambda: store.write(next(step), state)),
            "prefault_s": prefault_s,
            "slot_dir": str(shm.parent),
        }
    finally:
        store.close()
        shutil.rmtree(shm, ignore_errors=True)
    out["nonstop_over_pinned"] = out["nonstop_gbps"] / out["pinned_gbps"]
    return out


# -- 2. the training loop --------------------------------------------------------------------------
class Loop:
    """One model and optimizer on ``device``, stepped under each contender in turn."""

    def __init__(self, cfg: GPTConfig, batch: int, device: torch.device, shm: Path) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device)
        self.y = torch.randint(0, cfg.vocab, (batch, cfg.seq), device=device)
        self.capture = StateCapture(model=self.model, optimizer=self.opt)
        self.step_no = 0
        self._fwd_bwd()
        self.opt.step()  # AdamW's state exists from here on: every snapshot has one layout
        self.stores = {
            "nonstop": RankSnapshotStore(shm_dir=shm, job_id="loop", rank=0, num_slots=2),
            "nonstop_deep": RankSnapshotStore(shm_dir=shm, job_id="deep", rank=0, device_depth=8),
        }
        for store in self.stores.values():
            store.prefault(self.capture.state(0))  # sized and page-locked ahead, as a rank's slots
        self.stager: Any = None
        self.stage_error: str | None = None

    def _fwd_bwd(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(self.x)
        loss = F.cross_entropy(logits.flatten(0, 1), self.y.flatten())
        loss.backward()
        return loss

    def run(self, contender: str, steps: int) -> tuple[list[float], list[float], dict[str, list[float]]]:
        """``steps`` steps under ``contender``: each step's seconds, the host seconds in snapshot
        calls, and where each step's host time went (``PHASES``: to find a slow step's cause);
        a paced contender's steps also say where the write they fenced spent its time
        (``COPIER``, NaN where a step fenced none)."""
        times, host = [], []
        phases: dict[str, list[float]] = {k: [] for k in (*PHASES, *COPIER)}
        pending = None
        future = None
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = self._fwd_bwd()
            t1 = time.perf_counter()
            line = None
            if pending is not None:  # nonstop: before the optimizer changes the state
                pending.fence()
                line = pending.timeline()  # (the fence waited until every batch was issued)
            if future is not None:  # dcp_stage: the staged copy must be done with the state
                future.result()
                future = None
            t2 = time.perf_counter()
            self.opt.step()
            self.step_no += 1
            t3 = time.perf_counter()
            if contender in self.stores:
                pending = self.stores[contender].begin(
                    self.step_no, self.capture.state(self.step_no), deferred=self.capture.deferrable()
                )
            elif contender == "nonstop_sync":
                self.stores["nonstop"].write(self.step_no, self.capture.state(self.step_no))
            elif contender == "dcp_stage":
                future = self._stage()
            t4 = time.perf_counter()
            float(loss.item())  # the step's GPU work is done
            t5 = time.perf_counter()
            times.append(t5 - t0)
            host.append((t2 - t1) + (t4 - t3))
            for name, a, b in (
                ("enqueue", t0, t1),
                ("fence", t1, t2),
                ("opt", t2, t3),
                ("snapshot", t3, t4),
                ("item", t4, t5),
            ):
                phases[name].append(b - a)
            for name in COPIER:
                phases[name].append(line[name] if line is not None else math.nan)
        if pending is not None:
            pending.wait()
        if future is not None:
            future.result()
        return times, host, phases

    def _stage(self) -> Any:
        from concurrent.futures import Future

        if self.stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            gpu = self.device.type == "cuda"
            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=gpu,
                    use_shared_memory=False,
                    use_async_staging=gpu,
                    use_non_blocking_copy=gpu,
                )
            )
        # plain dicts of tensors: torch 2.11's stager failed on the model's state dict (an
        # OrderedDict with _metadata) with KeyError: <class 'type'>; whether this avoids it is
        # untested on a GPU so far
        optim = {int(k): dict(v) for k, v in self.opt.state_dict()["state"].items()}
        sd = {"model": dict(self.model.state_dict()), "optim": optim}
        out = self.stager.stage(sd)
        if isinstance(out, Future):
            return out
        done: Future[Any] = Future()
        done.set_result(out)
        return done

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        if self.stager is not None:
            self.stager.close()


def loop_case(
    name: str, cfg: GPTConfig, batch: int, device: torch.device, rounds: int, steps: int
) -> dict[str, Any]:
    nparams = cfg.num_params()
    shm = slot_dir(4 * 3 * 4 * nparams + (1 << 30))  # two stores of two slots
    loop = Loop(cfg, batch, device, shm)
    per: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    host: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    phases: dict[str, dict[str, list[float]]] = {c: {k: [] for k in PHASES} for c in CONTENDERS}
    copier: dict[str, dict[str, list[float]]] = {c: {k: [] for k in COPIER} for c in CONTENDERS}
    errors: dict[str, str] = {}
    try:
        for r in range(rounds + 1):
            for c in CONTENDERS:
                if c in errors:
                    continue
                try:
                    t, h, ph = loop.run(c, steps)
                except Exception as e:  # a peer's API this torch lacks: recorded, the rest goes on
                    errors[c] = f"{type(e).__name__}: {e}"
                    continue
                if r > 0:  # round 0 warms up
                    per[c] += t[1:]  # each run's first step follows the previous contender's
                    host[c] += h[1:]
                    for k in PHASES:
                        phases[c][k] += ph[k][1:]
                    for k in COPIER:  # (NaN but for a paced contender's steps: kept only then)
                        copier[c][k] += ph[k][1:]
    finally:
        loop.close()
        shutil.rmtree(shm, ignore_errors=True)
    base = statistics.median(per["none"])
    res: dict[str, Any] = {
        "case": name,
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "seq": cfg.seq, "vocab": cfg.vocab},
        "batch": batch,
        "params": nparams,
        "state_bytes": 12 * nparams,  # fp32 weights + AdamW's exp_avg and exp_avg_sq
        "steps_per_contender": len(per["none"]),
        "errors": errors,
    }
    for c in CONTENDERS:
        if not per[c]:
            continue
        med = statistics.median(per[c])
        res[c] = {
            "median_step_s": med,
            "step_ratio": med / base,
            "median_host_s": statistics.median(host[c]),
            "min_step_s": min(per[c]),
            "max_step_s": max(per[c]),
            "mean_step_s": statistics.fmean(per[c]),
            "steps_s": per[c],  # every counted step (nonstop.sim.calibrate reads their mean)
            "phases_s": phases[c],  # each counted step's host time by PHASES
        }
        if any(not math.isnan(v) for v in copier[c]["issue_s"]):  # paced device copies (a GPU)
            res[c]["copier"] = copier[c]  # per counted step: COPIER of the write it fenced
    return res


def machine() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = p.name
        out["gpu_mem_gib"] = round(p.total_memory / (1 << 30), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--bw-gb", type=float, default=4.0, help="bytes of the bandwidth test, GiB")
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds of every contender")
    ap.add_argument("--steps", type=int, default=6, help="steps per contender per round")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_capture: no CUDA device here; run it on a GPU machine or with --device cpu")
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # how GPT training runs fp32 on a GPU
        torch.backends.cudnn.allow_tf32 = True
    if args.quick:
        cases = [("quick", GPTConfig(vocab=256, seq=32, d_model=64, n_layers=2, n_heads=4), 4)]
        bw_gb, rounds, steps = 0.0625, 1, 3
    else:
        # a ~0.4B-parameter model (4.8 GB of state) whose step outlasts its copy, and the same
        # width with a small batch whose step is shorter than the copy
        wide = GPTConfig(vocab=32000, seq=1024, d_model=2048, n_layers=8, n_heads=16)
        cases = [("long-step", wide, 16), ("short-step", wide, 2)]
        bw_gb, rounds, steps = args.bw_gb, args.rounds, args.steps
    report: dict[str, Any] = {"machine": machine(), "device": str(device)}
    report["bandwidth"] = bandwidth(device, bw_gb)
    bw = report["bandwidth"]
    print(
        f"D2H GB/s over {bw['bytes'] / 1e9:.2f} GB: pinned {bw['pinned_gbps']:.1f}, "
        f"pageable {bw['pageable_gbps']:.1f}, nonstop snapshot {bw['nonstop_gbps']:.1f} "
        f"({bw['nonstop_over_pinned']:.2f}x pinned); prefault {bw['prefault_s']:.2f} s",
        flush=True,
    )
    report["loops"] = []

    def save() -> None:  # after every part: a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    for name, cfg, batch in cases:
        res = loop_case(name, cfg, batch, device, rounds, steps)
        report["loops"].append(res)
        save()
        print(
            f"{name}: {res['params'] / 1e6:.0f}M params, batch {batch}, "
            f"state {res['state_bytes'] / 1e9:.2f} GB"
        )
        for c in CONTENDERS:
            if c in res:
                r = res[c]
                print(
                    f"  {c:13s} step {r['median_step_s'] * 1e3:8.1f} ms  x{r['step_ratio']:.3f}  "
                    f"host in snapshot calls {r['median_host_s'] * 1e3:7.1f} ms",
                    flush=True,
                )
                if "copier" in r:  # the slowest step's write: where its copies' time went
                    cp, slow = r["copier"], max(range(len(r["steps_s"])), key=r["steps_s"].__getitem__)
                    print(
                        f"  {'':13s} slowest step {r['steps_s'][slow] * 1e3:.1f} ms: its write picked up "
                        f"{cp['picked_up_s'][slow] * 1e3:.1f} ms after begin, issued in "
                        f"{cp['issue_s'][slow] * 1e3:.1f} ms ({cp['landing_s'][slow] * 1e3:.1f} waiting "
                        f"for batches to land, {cp['batches'][slow]:.0f} batches)",
                        flush=True,
                    )
        for c, e in res["errors"].items():
            print(f"  {c:13s} failed: {e}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
