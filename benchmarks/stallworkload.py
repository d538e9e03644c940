"""The workload ``bench_snapshot_stall.py`` snapshots (and ``bench_persist.py`` persists): a
GPT-like model planned to a target state size (parameters plus AdamW moments), optionally sharded
by FSDP2 over torch's fake process group of 2 ranks, its optimizer state made real by one step."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(label: str) -> int:
    """``"500MB"`` -> 500_000_000 (decimal units; KiB/MiB/GiB are binary)."""
    text = label.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * UNITS[unit])
    return int(text)


@dataclass(frozen=True)
class ModelSpec:
    d_model: int
    n_layers: int
    vocab: int
    n_ctx: int

    def param_count(self) -> int:
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # qkv, proj, fc, fc_out (+ biases), 2 LayerNorms
        return (self.vocab + self.n_ctx) * d + self.n_layers * per_block + 2 * d


def plan_model(target_state_bytes: int, dtype: torch.dtype) -> ModelSpec:
    """A GPT-like shape whose params + 2 AdamW moments come to about ``target_state_bytes``."""
    target_params = target_state_bytes / (3 * dtype.itemsize)
    if target_params < 10e6:
        d, vocab, n_ctx = 256, 8192, 256
    elif target_params < 60e6:
        d, vocab, n_ctx = 512, 50304, 1024
    elif target_params < 200e6:
        d, vocab, n_ctx = 768, 50304, 1024
    else:
        d, vocab, n_ctx = 1024, 50304, 1024
    fixed = (vocab + n_ctx) * d + 2 * d
    per_block = 12 * d * d + 13 * d
    n_layers = max(1, round((target_params - fixed) / per_block))
    return ModelSpec(d_model=d, n_layers=n_layers, vocab=vocab, n_ctx=n_ctx)


class Block(nn.Module):
    """The parameters of one pre-LN transformer block (no forward needed here)."""

    def __init__(self, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d, dtype=dtype)
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)
        self.proj = nn.Linear(d, d, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc = nn.Linear(d, 4 * d, dtype=dtype)
        self.fc_out = nn.Linear(4 * d, d, dtype=dtype)


class GPTLike(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.d_model, dtype=dtype)
        self.wpe = nn.Embedding(spec.n_ctx, spec.d_model, dtype=dtype)
        self.blocks = nn.ModuleList(Block(spec.d_model, dtype) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.d_model, dtype=dtype)


@dataclass
class Workload:
    size_label: str
    dtype: str
    spec: ModelSpec
    model: nn.Module
    optimizer: torch.optim.AdamW

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the W-state: model state_dict, then optimizer state (a sharded
        state's local shards: what this rank owns and copies)."""
        out = [_local(t).detach() for t in self.model.state_dict().values()]
        for st in self.optimizer.state.values():
            out.extend(_local(v) for v in st.values() if isinstance(v, torch.Tensor))
        return out

    def describe(self) -> dict[str, Any]:
        ts = self.tensors()
        return {
            "size_label": self.size_label,
            "dtype": self.dtype,
            "model": asdict(self.spec),
            "param_count": sum(p.numel() for p in self.model.parameters()),
            "total_state_bytes": sum(t.numel() * t.element_size() for t in ts),
            "num_tensors": len(ts),
            "optimizer": "torch.optim.AdamW after one step() (exp_avg, exp_avg_sq, step per param)",
        }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def shard_on_fake_world(model: nn.Module, world: int = 2) -> None:
    """FSDP2 ``fully_shard`` of every block and the root over a fake process group of ``world``
    ranks (torch's test backend, this process playing rank 0): the state becomes DTensors whose
    local shards are 1/world of it, as on a real sharded rank; no collective is needed here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for blk in model.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_workload(size_label: str, dtype_name: str, *, sharded: bool = False) -> Workload:
    dtype = DTYPES[dtype_name]
    spec = plan_model(parse_size(size_label), dtype)
    torch.manual_seed(0)
    model = GPTLike(spec, dtype)
    if sharded:
        shard_on_fake_world(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()  # creates exp_avg / exp_avg_sq / step
    opt.zero_grad(set_to_none=True)  # grads are not part of the snapshot
    return Workload(size_label=size_label, dtype=dtype_name, spec=spec, model=model, optimizer=opt)
