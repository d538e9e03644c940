"""Resharding an FSDP2 state from 2 to 3 ranks: nonstop's in-memory snapshots versus
``torch.distributed.checkpoint`` (DCP) read back from disk, timed and checked bitwise.

What is measured. Phase A: 2 processes (gloo, CPU, mesh ``shard=2``) build the demo transformer
(``--model``, ``small`` = ~1.9M parameters by default; ``torch.manual_seed(0)``), shard it with the
sharded demo's ``shard_model`` (FSDP2 per block, then the root), train 3 AdamW steps on the demo's
data (so the Adam moments exist), then each rank writes (a) its nonstop snapshot as the runtime
encodes it (``RankSnapshotStore.write`` of ``StateCapture.state``, copied out: the meta JSON and the
data bytes, left in its memory slots) and (b) a DCP checkpoint (``get_state_dict`` + ``dcp.save``) to
the work dir on disk. Phase B: 3 processes (mesh ``shard=3``), as the ranks of one node that
reshards in memory. Per run, each path restores into a freshly built model + AdamW whose model
tensors are zeroed first (so equality proves the restore wrote everything), timed on every rank
from a barrier; the figure of a run (and of each of its parts) is the slowest rank's:

* ``nonstop``: the runtime's own path -- ``train.restore.read_to_reshard`` of the 2 old ranks from
  the node's slots (views: nothing is copied until each new rank cuts its own slices out) +
  ``restore_resharded`` (the optimizer starts without state, as a fresh rank's does in the
  runtime) + closing the stores;
* ``nonstop_copy``: the same, reading each old rank's whole state out of its slots first
  (``copy=True``: what the runtime did before the views);
* ``dcp``: ``get_state_dict`` (which initialises the optimizer state: a zero-lr step) +
  ``dcp.load`` + ``set_state_dict``; ``dcp_load_set_s`` leaves ``get_state_dict`` out.

Memory: ``read_anon_bytes`` is how much the rank's private memory (``RssAnon``) grew while it read
the old ranks (the largest rank's); the views leave it near zero, the copies make it the old ranks'
whole state.

The paths take turns going first; ``--warmup`` rounds are not counted. The DCP files were just
written: they are read from a warm page cache (which favours DCP). After each path every rank hashes
its local shards of the model and optimizer state (and the optimizer's hyper-parameters):
``bitwise_equal`` says nonstop's equal DCP's on every rank and both paths' global tensors
(``full_tensor``) equal the 2-rank state's (hashed in phase A). Exit code 0 only if every run is
bitwise equal. Each process uses 1 thread (5 processes on the 2-core VM). Results (medians
[min, max] over ``--runs``) go to ``benchmarks/results/reshard.json`` (``--out``)::

    .venv/bin/python benchmarks/bench_reshard.py              # small model, 5 runs
    .venv/bin/python benchmarks/bench_reshard.py --quick      # tiny model, 2 runs (smoke, ~20 s)
    .venv/bin/python benchmarks/bench_reshard.py --model medium --runs 3
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from benchcommon import fmt, machine_info, run_stamp, summarize  # noqa: E402  (a sibling script)

from nonstop.demo.model import GPT, PRESETS  # noqa: E402
from nonstop.snapshot.sharded import is_dtensor, local_of  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "reshard.json"
QUICK_OUT = REPO / "benchmarks" / "results" / "reshard-quick.json"
OLD_WORLD, NEW_WORLD, TRAIN_STEPS, BATCH = 2, 3, 3, 8
JOB, NUM_SLOTS = "bench-reshard", 2
PATHS = ("nonstop", "nonstop_copy", "dcp")


def _init(rank: int, world: int, work: Path, tag: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{work / f'rdzv-{tag}'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def _build(model_name: str, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from nonstop.demo.train_sharded import shard_model

    torch.manual_seed(0)
    model = GPT(PRESETS[model_name])
    shard_model(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of the training state by name (DTensors as they are)."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, entries in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{n}": v for n, v in entries.items() if isinstance(v, torch.Tensor)})
    return out


def local_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's local shards of the model and optimizer state, and its hyper-parameters."""
    h = hashlib.sha256()
    for name, t in sorted(_tensors(model, opt).items()):
        local = local_of(t) if is_dtensor(t) else t
        h.update(f"{name}:{local.dtype}:{tuple(local.shape)}".encode())
        h.update(_tensor_bytes(local))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    h.update(json.dumps(groups, sort_keys=True, default=str).encode())
    return h.hexdigest()


def global_digests(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of every whole tensor (``full_tensor``: collective, every rank calls it)."""
    out = {}
    for name, t in sorted(_tensors(model, opt).items()):
        whole = t.full_tensor() if is_dtensor(t) else t
        out[name] = hashlib.sha256(_tensor_bytes(whole)).hexdigest()
    return out


def _slowest(parts: dict[str, float]) -> dict[str, float]:
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, parts)
    return {k: max(p[k] for p in every) for k in parts}


def phase_a(rank: int, work: Path, model_name: str) -> None:
    """2 ranks train a few steps, then write their nonstop snapshot bytes and a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from nonstop.demo.data import MarkovCorpus
    from nonstop.snapshot.capture import StateCapture
    from nonstop.snapshot.store import RankSnapshotStore

    mesh = _init(rank, OLD_WORLD, work, "a")
    model, opt = _build(model_name, mesh)
    cfg = PRESETS[model_name]
    corpus = MarkovCorpus(vocab=cfg.vocab, seed=1234)
    for step in range(TRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = corpus.batch(step=step, rank=rank, batch=BATCH, seq=cfg.seq)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    (work / "shm").mkdir(exist_ok=True)
    store = RankSnapshotStore(shm_dir=work / "shm", job_id=JOB, rank=rank, num_slots=NUM_SLOTS)
    try:
        store.write(TRAIN_STEPS, StateCapture(model=model, optimizer=opt).state(TRAIN_STEPS))
        raw = store.copy_out(TRAIN_STEPS)
    finally:
        store.close()
    (work / "snap").mkdir(exist_ok=True)
    (work / "snap" / f"rank{rank}.meta").write_bytes(raw.meta)
    (work / "snap" / f"rank{rank}.data").write_bytes(raw.data.tobytes())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "dcp"))
    ref = global_digests(model, opt)
    if rank == 0:
        (work / "reference.json").write_text(json.dumps(ref))
    dist.barrier()
    dist.destroy_process_group()


def _anon_bytes() -> int:
    """This process's private resident memory (``RssAnon``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _restore_nonstop(model: Any, opt: Any, work: Path, rank: int, *, copy: bool) -> dict[str, Any]:
    """The runtime's resharding restore from this node's slots (``train.restore``)."""
    from types import SimpleNamespace

    from nonstop.snapshot.capture import StateCapture
    from nonstop.train.restore import InGroup, read_to_reshard

    env: Any = SimpleNamespace(shm_dir=work / "shm", job_id=JOB, num_slots=NUM_SLOTS)
    info = {"step": TRAIN_STEPS, "world": OLD_WORLD, "memory": {str(r): "local" for r in range(OLD_WORLD)}}
    anon = _anon_bytes()
    t0 = time.perf_counter()
    pending = InGroup(old_ranks=read_to_reshard(info, env, copy=copy))
    t1 = time.perf_counter()
    grown = _anon_bytes() - anon
    pending.apply(StateCapture(model=model, optimizer=opt), rank)
    pending.close()
    t2 = time.perf_counter()
    return {"total_s": t2 - t0, "read_s": t1 - t0, "restore_s": t2 - t1, "read_anon_bytes": grown}


def _restore_dcp(model: Any, opt: Any, path: Path) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    t1 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(path))
    t2 = time.perf_counter()
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    t3 = time.perf_counter()
    return {
        "total_s": t3 - t0,
        "get_state_dict_s": t1 - t0,
        "load_s": t2 - t1,
        "set_state_dict_s": t3 - t2,
        "load_set_s": t3 - t1,
    }


def phase_b(rank: int, work: Path, model_name: str, rounds: int) -> None:
    """3 ranks restore the 2-rank state by both paths, ``rounds`` times; rank 0 writes the figures."""
    mesh = _init(rank, NEW_WORLD, work, "b")
    ref = json.loads((work / "reference.json").read_text())
    runs, new_bytes = [], 0
    for i in range(rounds):
        order = PATHS[i % 3 :] + PATHS[: i % 3]
        run: dict[str, Any] = {"first": order[0]}
        digests: dict[str, str] = {}
        for path in order:
            model, opt = _build(model_name, mesh)
            with torch.no_grad():
                for t in model.state_dict().values():
                    (local_of(t) if is_dtensor(t) else t).zero_()
            dist.barrier()
            if path.startswith("nonstop"):
                parts = _restore_nonstop(model, opt, work, rank, copy=path == "nonstop_copy")
            else:
                parts = _restore_dcp(model, opt, work / "dcp")
            run[path] = _slowest(parts)
            digests[path] = local_digest(model, opt)
            run[f"{path}_matches_reference"] = global_digests(model, opt) == ref
            tensors = _tensors(model, opt).values()
            new_bytes = sum(local_of(t).nbytes if is_dtensor(t) else t.nbytes for t in tensors)
        every: list[Any] = [None] * NEW_WORLD
        dist.all_gather_object(every, (digests, new_bytes))
        run["equal_per_rank"] = [d["nonstop"] == d["dcp"] == d["nonstop_copy"] for d, _ in every]
        matches = all(run[f"{p}_matches_reference"] for p in PATHS)
        run["bitwise_equal"] = all(run["equal_per_rank"]) and matches
        runs.append(run)
    if rank == 0:
        out = {"runs": runs, "state_bytes_per_new_rank": [b for _, b in every]}
        (work / "phase_b.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    machine = machine_info()  # (the load average at the start)
    work = Path(tempfile.mkdtemp(prefix="bench-reshard-", dir=args.work_dir))
    try:
        t0 = time.monotonic()
        mp.spawn(phase_a, args=(work, args.model), nprocs=OLD_WORLD, join=True)
        t1 = time.monotonic()
        mp.spawn(phase_b, args=(work, args.model, args.warmup + args.runs), nprocs=NEW_WORLD, join=True)
        t2 = time.monotonic()
        b = json.loads((work / "phase_b.json").read_text())
        snap_bytes = [(work / "snap" / f"rank{r}.data").stat().st_size for r in range(OLD_WORLD)]
        dcp_files = [p.stat().st_size for p in (work / "dcp").rglob("*") if p.is_file()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    counted = b["runs"][args.warmup :]

    def of(path: str, part: str) -> list[float]:
        return [r[path][part] for r in counted]

    def ratio(part: str, over: str = "dcp") -> dict[str, float] | None:
        return summarize([d / n for d, n in zip(of(over, part), of("nonstop", "total_s"), strict=True)])

    return {
        "benchmark": "reshard",
        **run_stamp(),
        "machine": {**machine, "loadavg_at_end": list(os.getloadavg())},
        "settings": {
            "model": args.model,
            "runs": args.runs,
            "warmup": args.warmup,
            "quick": args.quick,
            "old_world": OLD_WORLD,
            "new_world": NEW_WORLD,
            "train_steps": TRAIN_STEPS,
            "threads_per_process": 1,
            "dcp_page_cache": "warm (the checkpoint was just written)",
        },
        "workload": {
            "params": PRESETS[args.model].num_params(),
            "snapshot_bytes_per_old_rank": snap_bytes,
            "dcp_checkpoint_bytes": sum(dcp_files),
            "dcp_files": len(dcp_files),
            "state_bytes_per_new_rank": b["state_bytes_per_new_rank"],
        },
        "phase_s": {"old_mesh_train_and_save": t1 - t0, "new_mesh_all_rounds": t2 - t1},
        "runs": b["runs"],  # the first --warmup are not counted
        "nonstop_s": summarize(of("nonstop", "total_s")),
        "nonstop_read_s": summarize(of("nonstop", "read_s")),
        "nonstop_restore_s": summarize(of("nonstop", "restore_s")),
        "nonstop_read_anon_bytes": summarize(of("nonstop", "read_anon_bytes")),
        "nonstop_copy_s": summarize(of("nonstop_copy", "total_s")),
        "nonstop_copy_read_s": summarize(of("nonstop_copy", "read_s")),
        "nonstop_copy_read_anon_bytes": summarize(of("nonstop_copy", "read_anon_bytes")),
        "ratio_copy_over_views": ratio("total_s", "nonstop_copy"),
        "dcp_s": summarize(of("dcp", "total_s")),
        "dcp_get_state_dict_s": summarize(of("dcp", "get_state_dict_s")),
        "dcp_load_s": summarize(of("dcp", "load_s")),
        "dcp_set_state_dict_s": summarize(of("dcp", "set_state_dict_s")),
        "dcp_load_set_s": summarize(of("dcp", "load_set_s")),
        "ratio_dcp_over_nonstop": ratio("total_s"),  # per run, then median [min, max]
        "ratio_dcp_load_set_over_nonstop": ratio("load_set_s"),
        "bitwise_equal": all(r["bitwise_equal"] for r in b["runs"]),
    }


def print_summary(r: dict[str, Any]) -> None:
    w, ms = r["workload"], 1e3

    def msf(s: dict[str, float] | None) -> str:
        return fmt({k: v * ms for k, v in s.items()} if s else None, digits=1)

    print(
        f"reshard {OLD_WORLD} -> {NEW_WORLD} ranks, model {r['settings']['model']} ({w['params'] / 1e6:.2f}M "
        f"params): snapshot {statistics.mean(w['snapshot_bytes_per_old_rank']) / 1e6:.2f} MB per old rank, "
        f"DCP {w['dcp_checkpoint_bytes'] / 1e6:.2f} MB in {w['dcp_files']} files"
    )

    def mbf(s: dict[str, float] | None) -> str:
        return fmt({k: v / 1e6 for k, v in s.items()} if s else None)

    print(f"  nonstop (views of the slots + restore_resharded), ms: {msf(r['nonstop_s'])}")
    print(f"    private memory grown by the read, MB:              {mbf(r['nonstop_read_anon_bytes'])}")
    print(f"  nonstop, each old rank copied out first, ms:         {msf(r['nonstop_copy_s'])}")
    print(f"    private memory grown by the read, MB:              {mbf(r['nonstop_copy_read_anon_bytes'])}")
    print(f"  DCP (get_state_dict + load + set_state_dict), ms:    {msf(r['dcp_s'])}")
    print(f"  DCP (load + set_state_dict only), ms:                {msf(r['dcp_load_set_s'])}")
    print(f"  ratio DCP / nonstop:                                 {fmt(r['ratio_dcp_over_nonstop'])}")
    print(f"  bitwise equal (nonstop == DCP on every rank, == old state): {r['bitwise_equal']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), default=None, help="default small (--quick: tiny)")
    ap.add_argument("--runs", type=int, default=None, help="counted runs (default 5; --quick: 2)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted")
    ap.add_argument("--out", type=Path, default=None, help=f"default {DEFAULT_OUT.relative_to(REPO)}")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the checkpoints go (default: TMPDIR)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 runs (smoke test)")
    args = ap.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "small")
    args.runs = args.runs or (2 if args.quick else 5)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    report = run_benchmark(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report)
    print(f"-> {out}")
    return 0 if report["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
