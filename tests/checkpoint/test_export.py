"""``nonstop export`` and ``nonstop.load_checkpoint`` on checkpoints written by the real persist
path: each format loads with its own reader (safetensors, torch.distributed.checkpoint,
``torch.load(weights_only=True)``) into a plain model, bitwise; a corrupt newest step is skipped;
sharded state is gathered; bad input fails in one line with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import nonstop
from nonstop.checkpoint import export_checkpoint
from nonstop.checkpoint.reader import _gather
from nonstop.cli import main
from nonstop.errors import SnapshotMissingError
from nonstop.snapshot.durable import rank_file, step_dir
from nonstop.snapshot.sharded import LocalShard, shard_layout
from tests.persisting import Persisting, make_model, state_of, trained

WORLD = 2


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """A 2-rank data-parallel checkpoint of steps 3 and 6: the (model, optimizer) of each step."""
    tmp = tmp_path_factory.mktemp("export")
    job = Persisting(tmp, tmp / "ckpt", WORLD)
    trained_at: dict[int, Any] = {}
    try:
        for step in (3, 6):
            model, opt = trained(steps=step)
            trained_at[step] = (model, opt)
            job.persist(step, [state_of(model, opt, step, {"pos": step * 10 + r}) for r in range(WORLD)])
    finally:
        job.close()
    return tmp / "ckpt", trained_at


def _fresh() -> torch.nn.Module:
    return make_model(seed=99)  # other weights than any checkpoint's


def test_load_checkpoint_gives_plain_state_dicts(ckpt: tuple[Path, dict[int, Any]]) -> None:
    root, trained_at = ckpt
    model, opt = trained_at[6]
    got = nonstop.load_checkpoint(root)
    assert (got.step, got.world_size, got.sharded) == (6, WORLD, False)
    assert _same(got.model, model.state_dict())  # the model's own keys: no DDP "module." prefix
    assert got.extras == [{"pos": 60}, {"pos": 61}] and len(got.rng) == WORLD
    want = opt.state_dict()
    assert got.optimizer is not None and got.optimizer["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        assert all(torch.equal(got.optimizer["state"][i][k], v) for k, v in st.items())
    fresh = _fresh()
    fresh.load_state_dict(got.model)  # strict
    assert _same(fresh.state_dict(), model.state_dict())
    assert nonstop.load_checkpoint(root, step=3).step == 3
    with pytest.raises(SnapshotMissingError, match="no committed checkpoint step 4"):
        nonstop.load_checkpoint(root, step=4)


def test_every_format_loads_with_its_own_reader_bitwise(
    ckpt: tuple[Path, dict[int, Any]], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    root, trained_at = ckpt
    want = trained_at[6][0].state_dict()
    for fmt, name in (("safetensors", "m.safetensors"), ("dcp", "m.dcp"), ("torch", "m.pt")):
        res = export_checkpoint(root, tmp_path / name, fmt=fmt)
        assert res.step == 6 and res.tensors == len(want)
    assert _same(dict(sorted(load_file(tmp_path / "m.safetensors").items())), dict(sorted(want.items())))
    assert _same(torch.load(tmp_path / "m.pt", weights_only=True), want)
    fresh = _fresh()
    sd = fresh.state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(sd, checkpoint_id=str(tmp_path / "m.dcp"))
    fresh.load_state_dict(sd)
    assert _same(fresh.state_dict(), want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.dcp", "m.pt", "m.safetensors"]  # no temp left


def test_optimizer_and_all(ckpt: tuple[Path, dict[int, Any]], tmp_path: Path) -> None:
    from safetensors import safe_open

    root, trained_at = ckpt
    model, opt = trained_at[3]
    export_checkpoint(root, tmp_path / "all.pt", fmt="torch", what="all", step=3)
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert everything["step"] == 3 and everything["extras"] == [{"pos": 30}, {"pos": 31}]
    assert _same(everything["model"], model.state_dict())
    fresh = _fresh()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(everything["model"])
    fresh_opt.load_state_dict(everything["optimizer"])  # a real optimizer takes it as it is
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]

    export_checkpoint(root, tmp_path / "opt.safetensors", fmt="safetensors", what="optimizer", step=3)
    with safe_open(tmp_path / "opt.safetensors", "pt") as f:
        meta = f.metadata()
        assert meta["nonstop_step"] == "3"
        assert json.loads(meta["param_groups"])[0]["lr"] == 1e-2
        for i, st in opt.state_dict()["state"].items():
            assert torch.equal(f.get_tensor(f"state.{i}.exp_avg_sq"), st["exp_avg_sq"])


def test_a_corrupt_newest_step_is_skipped_for_the_older_good_one(
    ckpt: tuple[Path, dict[int, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from safetensors.torch import load_file

    root = tmp_path / "ckpt"
    shutil.copytree(ckpt[0], root)
    victim = root / step_dir(6) / rank_file(0)  # rank 1 shares its chunks: both ranks are hit
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    victim.write_bytes(bytes(raw))
    out = tmp_path / "m.safetensors"
    assert main(["export", str(root), "--format", "safetensors", "--out", str(out)]) == 0
    assert _same(dict(sorted(load_file(out).items())), dict(sorted(ckpt[1][3][0].state_dict().items())))
    err = capsys.readouterr()
    assert "step 3" in err.out and "step 6" in err.err  # exported 3; 6 named as unusable
    # the corrupt step asked for by name: one line, exit 2
    assert main(["export", str(root), "--format", "torch", "--out", str(out), "--step", "6"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "step 6" in lines[0] and "crc" in lines[0].lower(), lines


@pytest.mark.parametrize(
    "args, says",
    [
        (["--format", "onnx"], "unknown export format 'onnx'"),
        (["--format", "safetensors", "--what", "all"], "safetensors holds tensors only"),
        (["--format", "torch", "--what", "weights"], "unknown --what 'weights'"),
        (["--format", "torch", "--step", "4"], "no committed checkpoint step 4"),
    ],
)
def test_bad_input_fails_in_one_line_with_status_2(
    ckpt: tuple[Path, dict[int, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    says: str,
) -> None:
    assert main(["export", str(ckpt[0]), "--out", str(tmp_path / "x"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_a_location_without_a_checkpoint_fails_in_one_line_with_status_2(tmp_path: Path) -> None:
    """The real command line, as a user types it: a missing directory, an empty one."""
    (tmp_path / "empty").mkdir()
    for where in (tmp_path / "missing", tmp_path / "empty"):
        cmd = [
            sys.executable,
            "-m",
            "nonstop.cli",
            "export",
            str(where),
            "--format",
            "torch",
            "--out",
            "m.pt",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, run.stderr
        assert "no committed checkpoint" in lines[0]
    assert not (tmp_path / "missing").exists() and not (tmp_path / "m.pt").exists()


def test_sharded_state_is_gathered_into_full_tensors() -> None:
    """FSDP2 on 2 ranks replicated twice (HSDP), as snapshots hold it: each rank's LocalShard; the
    gathered tensor is the whole, replicas must agree, and plain values are rank 0's."""
    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    step = torch.tensor(7.0)
    states = []
    for rank in range(4):
        coord = (rank // 2, rank % 2)  # (replicate, shard)
        placements = ("Replicate()", "Shard(dim=0)")
        shape, offset = shard_layout((5, 3), placements, (2, 2), coord)
        piece = full[offset[0] : offset[0] + shape[0]].clone()
        shard = LocalShard(
            tensor=piece,
            global_shape=(5, 3),
            global_stride=(3, 1),
            offset=offset,
            placements=placements,
            mesh_shape=(2, 2),
            mesh_dims=("replicate", "shard"),
        )
        states.append(
            {"w": shard, "b": torch.ones(2), "opt": {"state": {0: {"exp_avg": shard, "step": step}}}}
        )
    got = _gather(states, "test")
    assert torch.equal(got["w"], full) and torch.equal(got["opt"]["state"][0]["exp_avg"], full)
    assert got["opt"]["state"][0]["step"] is step and got["b"] is states[0]["b"]
    states[3]["w"].tensor.add_(1)  # a replica that disagrees
    with pytest.raises(nonstop.NonstopError, match="replicas are not equal"):
        _gather(states, "test")
