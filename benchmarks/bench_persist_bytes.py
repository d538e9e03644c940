"""Bytes a data-parallel job writes to its durable tier: shared chunks (the replicated model and
optimizer once per checkpoint) against every rank writing its own copy, on a real job.

What is measured. The same W-train job -- ``nonstop run --nproc-per-node N --spares 0 --persist DIR
--persist-every K -m nonstop.demo.train --model M`` -- run by two trees, alternating (A B A B ...):

* ``shared``: this tree (format version 2: a chunk whose payload a lower rank already stored is
  referenced, not written again);
* ``per_rank``: the tree at ``--baseline-rev`` (default: the commit before shared chunks), checked
  out in a temporary git worktree and run with the same interpreter: every rank writes its own
  copy, as nonstop did before.

Figures per run, from the job's event log (each ``persist`` event's ``stored_bytes``, the rank
files' bytes; manifests and ``latest`` are left out, a few KB): the bytes written over the whole
run, per checkpoint, and the ratio per_rank ÷ shared. For the shared run also the bytes its final
checkpoint's manifest says every rank's chunks take (own + shared): what the same checkpoint costs
when every rank stores its own; over what it stored, ``last_checkpoint_sharing`` (about the number
of ranks), a figure of that run alone.

Both jobs train the same steps on the same data, but the persister is lazy: it persists the
committed step it finds when it wakes (every ``--persist-every`` steps or later), so on a loaded
machine one job may persist step 6 where the other persisted step 4, or only the last step; its
last checkpoint is then a delta against another base, or full. The summary says whether the two
runs persisted the same steps with the same bases (``same_steps``); only then do their bytes
compare (the ratio of bytes written included), and then the shared run's every-rank-own bytes equal
the per_rank run's last checkpoint, but for what the newer layout added to each rank's data
(``data_bytes``: since c7542ea Python's RNG state is a tensor of the data, 2.5 KB a rank, where the
old tree kept it in the metadata). The final weights of the two runs are checked equal (the demo's
weights hash): the measure is of the same training. Each run's last checkpoint is verified by this
tree's reader: the old tree's (format version 1) included.

Run it::

    .venv/bin/python benchmarks/bench_persist_bytes.py       # -> benchmarks/results/persist-bytes.json
    .venv/bin/python benchmarks/bench_persist_bytes.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from nonstop.snapshot.durable import MANIFEST, DurableStore, step_dir  # noqa: E402
from nonstop.snapshot.durable.format import decode_manifest  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "persist-bytes.json"
# The last commit before shared chunks (they came with 20a221c): every DDP rank persists its own copy.
DEFAULT_BASELINE = "bf3d8f8"


def run_job(tree: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One job of ``tree``'s nonstop; the bytes it persisted and its final weights hash."""
    job_dir, ckpt = work / "job", work / "ckpt"
    cmd = [
        sys.executable, "-m", "nonstop.cli", "run", "--nproc-per-node", str(args.nproc), "--spares", "0",
        "--job-dir", str(job_dir), "--persist", str(ckpt), "--persist-every", str(args.persist_every),
        "--keep", "100", "-m", "nonstop.demo.train", "--steps", str(args.steps), "--model", args.model,
        "--batch", "4", "--result", str(work / "result.json"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"job of {tree} failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    events = [json.loads(x) for x in (job_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    persists = [e for e in events if e["event"] == "persist"]
    result = json.loads((work / "result.json").read_text())
    out: dict[str, Any] = {
        "checkpoints": [
            {
                "step": e["step"],
                "raw_bytes": e["raw_bytes"],
                "stored_bytes": e["stored_bytes"],
                "full": e["full"],
            }
            for e in persists
        ],
        "bytes_written": sum(e["stored_bytes"] for e in persists),
        "raw_bytes": sum(e["raw_bytes"] for e in persists),
        "final_hash": result["final_hash"],
    }
    last = max(e["step"] for e in persists)
    man = decode_manifest((ckpt / step_dir(last) / MANIFEST).read_bytes(), "bench")
    out["last_checkpoint"] = {
        "step": last,
        "version": man.version,
        "stored_bytes": sum(r.file_len for r in man.ranks),
        "every_rank_own_bytes": sum(info.enc_len for r in man.ranks for info, _ in r.chunks),
        "data_bytes": sum(r.data_len for r in man.ranks),
        "base_steps": sorted({-1 if r.base_step is None else r.base_step for r in man.ranks}),
        "rank_file_bytes": [r.file_len for r in man.ranks],
    }
    assert DurableStore(ckpt).verify(last) == [], "the last checkpoint does not verify"
    return out


def _persisted(run: dict[str, Any]) -> list[int]:
    return [c["step"] for c in run["checkpoints"]]


def _bases(run: dict[str, Any]) -> list[int]:
    return list(run["last_checkpoint"]["base_steps"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--model", default="medium", help="demo model preset (medium: ~26M params, W-train)")
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--persist-every", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="runs of each tree")
    ap.add_argument("--baseline-rev", default=DEFAULT_BASELINE, help="git revision of the per-rank tree")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.persist_every, args.runs = "tiny", 8, 4, 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nonstop-bench-bytes-") as tmp:
        base_tree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(base_tree), args.baseline_rev],
            check=True,
            capture_output=True,
        )
        try:
            for i in range(args.runs):
                row: dict[str, Any] = {}
                for name, tree in (("shared", REPO_ROOT), ("per_rank", base_tree)):
                    work = Path(tmp) / f"{name}-{i}"
                    work.mkdir()
                    row[name] = run_job(tree, work, args)
                    shutil.rmtree(work)
                    print(
                        f"[bench] run {i} {name}: {row[name]['bytes_written'] / 1e6:.1f} MB written",
                        flush=True,
                    )
                if row["shared"]["final_hash"] != row["per_rank"]["final_hash"]:
                    raise RuntimeError("the two trees trained different weights: not the same job")
                row["ratio"] = row["per_rank"]["bytes_written"] / row["shared"]["bytes_written"]
                rows.append(row)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(base_tree)],
                check=False,
                capture_output=True,
            )
    ratios = [r["ratio"] for r in rows]
    last = rows[-1]
    summary = {
        "shared_bytes_written": statistics.median(r["shared"]["bytes_written"] for r in rows),
        "per_rank_bytes_written": statistics.median(r["per_rank"]["bytes_written"] for r in rows),
        "ratio_per_rank_to_shared": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        # What the shared run's last checkpoint would take with every rank storing its own,
        # over what it stored: one run's own figure, whatever steps the other run persisted.
        "last_checkpoint_sharing": statistics.median(
            r["shared"]["last_checkpoint"]["every_rank_own_bytes"]
            / r["shared"]["last_checkpoint"]["stored_bytes"]
            for r in rows
        ),
        "last_checkpoint_shared": last["shared"]["last_checkpoint"],
        "last_checkpoint_per_rank": last["per_rank"]["last_checkpoint"],
        # Both persisted the same steps, so the last checkpoints are deltas over the same bases
        # (-1: full) and their bytes compare exactly; False when laziness moved a persist.
        "same_steps": _persisted(last["shared"]) == _persisted(last["per_rank"])
        and _bases(last["shared"]) == _bases(last["per_rank"]),
    }
    report = {
        "benchmark": "persist-bytes",
        "config": {"quick": args.quick, "baseline_rev": args.baseline_rev},
        "workload": {
            "model": args.model,
            "nproc": args.nproc,
            "steps": args.steps,
            "persist_every": args.persist_every,
            "runs": args.runs,
        },
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "runs": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
