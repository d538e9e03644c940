"""A small decoder-only transformer (GPT-style), sized by :class:`GPTConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PRESETS", "GPT", "GPTConfig"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4

    def num_params(self) -> int:
        return sum(p.numel() for p in GPT(self).parameters())


PRESETS: dict[str, GPTConfig] = {
    # ~0.12M params: tests and the quick demo (tens of ms per step)
    "tiny": GPTConfig(vocab=128, seq=32, d_model=64, n_layers=2, n_heads=4),
    # ~1.9M params: the default demo
    "small": GPTConfig(vocab=256, seq=64, d_model=192, n_layers=4, n_heads=6),
    # ~26M params: W-train for benchmarks (hundreds of ms per step on 2 cores)
    "medium": GPTConfig(vocab=1024, seq=128, d_model=512, n_layers=8, n_heads=8),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.n_heads = cfg.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits
