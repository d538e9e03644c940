"""Effect of lossy durable checkpoints on the demo's final loss, and their size.

What is measured. The demo (``nonstop.demo.train``, ``--model``, ``--nproc`` ranks) trains
``--steps`` steps three times, each with lazy persistence every ``--persist-every`` steps:

* ``reference``: no failure;
* ``lossless``: rank 1 is lost with its snapshot memory at step ``--fault-step`` (a ``wipe``
  fault), so every rank restores the newest *durable* checkpoint (lossless codec);
* ``lossy8`` / ``lossy4``: the same with ``--lossy --lossy-bits 8|4``: delta checkpoints
  quantise weight deltas and Adam moments (full bases stay exact), so the restore loads
  approximate state.

Figures: the final training loss of each run (rank 0's last step, same batch in every run),
the relative difference lossy vs reference (goal: within 1%), whether the lossless run is
bitwise equal to the reference, the step restored, and the stored/raw ratio of the lossy
checkpoint that was restored (read from its manifest).

Run it::

    .venv/bin/python benchmarks/bench_lossy.py            # -> benchmarks/results/lossy.json
    .venv/bin/python benchmarks/bench_lossy.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from nonstop.demo.runner import demo_job_config  # noqa: E402
from nonstop.events.log import read_events  # noqa: E402
from nonstop.launch.launcher import run_job  # noqa: E402
from nonstop.snapshot.durable import DurableStore  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "lossy.json"


def one_run(
    name: str, args: argparse.Namespace, work: Path, *, fault: bool, lossy_bits: int | None
) -> dict[str, Any]:
    job_dir = work / name
    result_file = job_dir / "result.json"
    ckpt = job_dir / "ckpt"
    cfg = demo_job_config(
        snapshot_budget=0.0,  # a fixed interval, as its BENCHMARKS.md figures were measured
        result=result_file,
        steps=args.steps,
        model=args.model,
        batch=args.batch,
        script_extra=("--step-delay", str(args.step_delay)),
        nproc_per_node=args.nproc,
        spares=1,
        job_dir=job_dir,
        persist_url=str(ckpt),
        persist_every=args.persist_every,
        keep=100,  # keep the restored checkpoint for the size figure
        lossy=lossy_bits is not None,
        lossy_bits=lossy_bits or 8,
        faults=(f"wipe:rank=1,step={args.fault_step}",) if fault else (),
    )
    res = run_job(cfg, redirect_output=True)
    if not result_file.exists():
        raise RuntimeError(f"{name}: job failed: {res.error}")
    out = json.loads(result_file.read_text())
    row: dict[str, Any] = {"final_loss": out["final_loss"], "final_hash": out["final_hash"]}
    restored = [e for e in read_events(job_dir / "events.jsonl") if e["event"] == "restore_from_durable"]
    if fault:
        if not restored:
            raise RuntimeError(f"{name}: the failure was not recovered from the durable tier")
        step = int(restored[0]["step"])
        row["restored_step"] = step
        report = DurableStore(ckpt).describe(verify=False)
        entry = next(s for s in report["checkpoints"] if s["step"] == step)
        row["restored_checkpoint"] = {
            k: entry.get(k) for k in ("data_bytes", "stored_bytes", "ratio", "base_step", "codec")
        }
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--persist-every", type=int, default=10)
    ap.add_argument("--fault-step", type=int, default=55)
    ap.add_argument("--step-delay", type=float, default=0.05, help="lets the lazy persister keep up")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.persist_every, args.fault_step = "tiny", 30, 4, 14
    (REPO_ROOT / ".nonstop").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-lossy-", dir=REPO_ROOT / ".nonstop") as tmp:
        work = Path(tmp)
        runs = {
            "reference": one_run("reference", args, work, fault=False, lossy_bits=None),
            "lossless": one_run("lossless", args, work, fault=True, lossy_bits=None),
            "lossy8": one_run("lossy8", args, work, fault=True, lossy_bits=8),
            "lossy4": one_run("lossy4", args, work, fault=True, lossy_bits=4),
        }
    ref = runs["reference"]["final_loss"]
    summary = {
        "lossless_bitwise_equal": runs["lossless"]["final_hash"] == runs["reference"]["final_hash"],
        **{
            f"{name}_{fig}": value
            for name in ("lossy8", "lossy4")
            for fig, value in (
                ("final_loss_rel_diff", abs(runs[name]["final_loss"] - ref) / abs(ref)),
                ("restored_ratio", runs[name]["restored_checkpoint"]["ratio"]),
            )
        },
        "lossless_restored_ratio": runs["lossless"]["restored_checkpoint"]["ratio"],
    }
    report = {
        "benchmark": "lossy",
        "workload": {
            k: getattr(args, k) for k in ("nproc", "model", "batch", "steps", "persist_every", "fault_step")
        },
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "runs": runs,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for name, row in runs.items():
        extra = row.get("restored_checkpoint", {})
        restored = row.get("restored_step", "-")
        print(f"{name:<10} final loss {row['final_loss']:.5f}  restored {restored}  {extra}")
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
