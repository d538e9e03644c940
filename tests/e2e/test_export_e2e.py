"""``nonstop export`` of real jobs' durable tiers: a 3-rank data-parallel job and a 2-rank FSDP2 job,
exported in every format by the real command line and loaded by each format's own reader into a
plain (unsharded) model, bitwise equal to the job's final weights."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nonstop.coordinator.loop import JobState
from nonstop.demo.model import GPT, PRESETS
from nonstop.demo.train import weights_hash
from nonstop.snapshot.durable import DurableStore, rank_file, step_dir
from nonstop.snapshot.sharded import shard_layout
from tests.conftest import STEPS, run_demo_job

pytestmark = pytest.mark.slow


def _export(url: Path, out: Path, fmt: str, *more: str) -> str:
    cmd = [sys.executable, "-m", "nonstop.cli", "export", str(url), "--format", fmt, "--out", str(out), *more]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _load(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The exported model as its format's own reader gives it, loaded into a fresh plain GPT."""
    model = GPT(PRESETS["tiny"])
    if fmt == "safetensors":
        from safetensors.torch import load_file

        sd = load_file(path)
    elif fmt == "torch":
        sd = torch.load(path, weights_only=True)
    else:
        import torch.distributed.checkpoint as dcp

        sd = model.state_dict()
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(sd, checkpoint_id=str(path))
    model.load_state_dict(sd)  # strict: every key, no "module." prefix
    return dict(model.state_dict())


def test_a_data_parallel_job_exports_its_final_weights_once_in_every_format(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = run_demo_job(tmp_path / "job", nproc=3, spares=0, persist_url=str(ckpt), persist_every=4)
    assert run.result.state is JobState.DONE and run.out is not None, run.result.error
    assert DurableStore(ckpt).latest_step() == STEPS  # the final step is persisted at the end
    sizes = [(ckpt / step_dir(STEPS) / rank_file(r)).stat().st_size for r in range(3)]
    assert sizes[1] < sizes[0] / 10 and sizes[2] < sizes[0] / 10, sizes  # replicated state once
    for fmt, name in (("safetensors", "w.safetensors"), ("dcp", "w.dcp"), ("torch", "w.pt")):
        said = _export(ckpt, tmp_path / name, fmt)
        assert f"of step {STEPS} (3 ranks, data-parallel, once)" in said
        model = GPT(PRESETS["tiny"])
        model.load_state_dict(_load(tmp_path / name, fmt))
        assert weights_hash(model) == run.out["final_hash"], fmt


def _local_hash(full: dict[str, torch.Tensor], params: set[str], rank: int, world: int) -> str:
    """What the sharded demo's rank ``rank`` hashes (its local shards, FSDP2 ``Shard(dim=0)`` on a
    mesh of ``world``), cut from the full tensors as DTensor places them."""
    h = hashlib.sha256()
    for name, t in full.items():
        if name in params:
            shape, offset = shard_layout(tuple(t.shape), ("Shard(dim=0)",), (world,), (rank,))
            t = t[offset[0] : offset[0] + shape[0]]
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_an_fsdp2_job_exports_its_shards_gathered_into_full_weights(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run = run_demo_job(
        tmp_path / "job", nproc=2, spares=0, mesh="shard=2", persist_url=str(ckpt), persist_every=4
    )
    assert run.result.state is JobState.DONE and run.out is not None, run.result.error
    params = {n for n, _ in GPT(PRESETS["tiny"]).named_parameters()}
    for fmt, name in (("safetensors", "w.safetensors"), ("dcp", "w.dcp"), ("torch", "w.pt")):
        said = _export(ckpt, tmp_path / name, fmt)
        assert f"of step {STEPS} (2 ranks, gathered from shards)" in said
        full = _load(tmp_path / name, fmt)
        for rank in range(2):
            mine = json.loads((run.job_dir / f"result.rank{rank}.json").read_text())
            assert _local_hash(full, params, rank, 2) == mine["local_hash"], (fmt, rank)
    _export(ckpt, tmp_path / "all.pt", "torch", "--what", "all")
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert everything["step"] == STEPS and len(everything["extras"]) == 2
    exp_avg = everything["optimizer"]["state"][0]["exp_avg"]  # AdamW's state, gathered too
    assert exp_avg.shape == next(iter(GPT(PRESETS["tiny"]).parameters())).shape
