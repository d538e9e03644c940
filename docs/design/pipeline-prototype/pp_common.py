"""The prototype's model, split into pipeline stages torchtitan's way, and its full-name state.

* A torchtitan-like model: ``tok_embeddings``, ``layers`` (a ModuleDict keyed "0".."L-1"),
  ``norm``, ``output``; every piece optional so a stage is the full model with the other pieces
  deleted -- its ``named_parameters()`` keep the full names (``layers.5.fc.weight``).
* Built on ``meta`` and materialised with ``to_empty``; weights initialised per full name from a
  seed (a generator seeded by crc32(name)), so a parameter's initial value does not depend on the
  split: pp=2 and pp=4 start from the same weights.
* :func:`snapshot` / :func:`restore`: this rank's stage(s) params and AdamW state keyed by full
  parameter names (the optimizer's integer keys replaced by FQNs), cloned.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, SEQ, BATCH = 64, 32, 8, 8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.out(F.gelu(self.fc(self.norm(h))))


class Model(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block(DIM) for i in range(n_layers)})
        self.norm: nn.Module | None = nn.LayerNorm(DIM)
        self.output: nn.Module | None = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def init_weights(module: nn.Module, seed: int) -> None:
    """Every parameter from its full name and the seed alone (independent of the split)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ".norm." in f".{name}" and leaf == "weight":
                p.fill_(1.0)
            elif leaf == "bias":
                p.zero_()
            else:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def stage_ids(rank: int, pp: int, per_rank: int, style: str = "loop") -> list[int]:
    """The stage indices rank ``rank`` plays: loop style (rank, rank + pp, ...), as torchtitan."""
    if style == "v":
        assert per_rank == 2
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(per_rank)]


def build_stage(stage: int, num_stages: int, n_layers: int, seed: int) -> nn.Module:
    """Stage ``stage`` of ``num_stages``: the full model built on meta, the other stages' pieces
    deleted, materialised and initialised by full name."""
    assert n_layers % num_stages == 0, "pp x stages-per-rank must divide the layers"
    per = n_layers // num_stages
    with torch.device("meta"):
        m = Model(n_layers)
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(m.layers.keys()):
        if name not in keep:
            del m.layers[name]
    if stage != 0:
        m.tok_embeddings = None
    if stage != num_stages - 1:
        m.norm = None
        m.output = None
    m.to_empty(device="cpu")
    init_weights(m, seed)
    return m


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def batch(step: int, dp: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + 104729 * dp + 1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def names_of(modules: list[nn.Module]) -> dict[int, str]:
    out: dict[int, str] = {}
    for m in modules:
        for n, p in m.named_parameters():
            assert id(p) not in out
            out[id(p)] = n
    return out


def snapshot(modules: list[nn.Module], opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """This rank's state keyed by full names: {"model": {fqn: t}, "optim": {fqn: {k: t}}}."""
    model: dict[str, torch.Tensor] = {}
    for m in modules:
        for k, v in m.state_dict().items():
            assert k not in model, f"two stages of one rank hold {k}"
            model[k] = v.detach().clone()
    names = names_of(modules)
    optim = {
        names[id(p)]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
        for g in opt.param_groups for p in g["params"] if p in opt.state
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"step": step, "model": model, "optim": optim, "groups": groups}


def restore(modules: list[nn.Module], opt: torch.optim.Optimizer, snap: dict[str, Any]) -> None:
    """Load a full-name snapshot (possibly the union of several old ranks' snapshots: a resume on
    another pp) into this rank's stage(s) and optimizer: each takes the names it holds."""
    with torch.no_grad():
        for m in modules:
            for k, v in m.state_dict().items():
                v.copy_(snap["model"][k])
    names = names_of(modules)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = None
            saved = snap["optim"].get(names[id(p)])
            if saved is not None:
                opt.state[p] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
    for g, sg in zip(opt.param_groups, snap["groups"], strict=True):
        g.update(sg)


def digest(snap: dict[str, Any]) -> dict[str, str]:
    """sha256 per full name of params and optimizer state (bitwise comparison across runs)."""
    import hashlib

    out = {}
    for k, v in snap["model"].items():
        out[f"model/{k}"] = hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    for k, st in snap["optim"].items():
        for sk, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            out[f"optim/{k}/{sk}"] = hashlib.sha256(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return out
