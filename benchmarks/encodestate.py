"""The states ``bench_encode.py`` encodes: two consecutive steps of the demo GPT trained on the
demo's data (cached on disk), each tensor's kind (weights, moments, ...), their snapshot layout
and its bf16 variant (the weights and moments cast)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nonstop.demo.data import MarkovCorpus
from nonstop.demo.model import GPT, PRESETS
from nonstop.snapshot.api import ALIGN, TensorEntry
from nonstop.snapshot.flatten import flatten_state


def _kinds(tree: Any, n: int) -> list[str]:
    """Kind of each flattened tensor: the dict key it sits under (model params get "param")."""
    kinds = ["?"] * n

    def walk(obj: Any, key: str, top: str) -> None:
        if isinstance(obj, dict):
            if "__t__" in obj:
                kinds[obj["__t__"]] = "param" if top == "model" else key
                return
            if "__dict__" in obj:
                for k, v in obj["__dict__"]:
                    walk(v, str(k), top)
                return
            for k, v in obj.items():
                walk(v, k, top or k)
        elif isinstance(obj, list):
            for v in obj:
                walk(v, key, top)

    walk(tree, "", "")
    return kinds


def trained_pair(
    preset: str, steps: int, batch: int, lr: float, cache_dir: Path | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str], dict[str, Any]]:
    """Flattened tensors of the state after steps k and k+1, their kinds, and training facts."""
    key = f"encode-state-{preset}-s{steps}-b{batch}-lr{lr:g}-seed0.pt"
    path = cache_dir / key if cache_dir is not None else None
    if path is not None and path.exists():
        blob = torch.load(path, weights_only=True)
        return blob["prev"], blob["cur"], blob["kinds"], {**blob["facts"], "cached": True}
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    corpus = MarkovCorpus(vocab=cfg.vocab, seed=1234)
    t0 = time.perf_counter()
    snaps: dict[int, list[torch.Tensor]] = {}
    kinds: list[str] = []
    losses = []
    for step in range(steps + 1):
        x, y = corpus.batch(step=step, rank=0, batch=batch, seq=cfg.seq)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        if step >= steps - 1:
            tree, tensors = flatten_state({"model": model.state_dict(), "optimizer": opt.state_dict()})
            snaps[step] = [t.detach().clone() for t in tensors]
            kinds = _kinds(tree, len(tensors))
    facts = {
        "preset": preset,
        "num_params": sum(p.numel() for p in model.parameters()),
        "steps": [steps - 1, steps],
        "batch": batch,
        "lr": lr,
        "optimizer": "torch.optim.AdamW (default betas, weight_decay 0.01)",
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "train_s": time.perf_counter() - t0,
    }
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"prev": snaps[steps - 1], "cur": snaps[steps], "kinds": kinds, "facts": facts}, path)
    return snaps[steps - 1], snaps[steps], kinds, {**facts, "cached": False}


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[TensorEntry], np.ndarray[Any, Any]]:
    """Entries and data buffer as RankSnapshotStore lays them out (64-byte aligned offsets)."""
    entries, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        entries.append(
            TensorEntry(dtype=str(t.dtype).removeprefix("torch."), shape=tuple(t.shape), offset=off, nbytes=n)
        )
        off = (off + n + ALIGN - 1) // ALIGN * ALIGN
    data_len = entries[-1].offset + entries[-1].nbytes if entries else 0
    buf = np.zeros(data_len, np.uint8)
    for e, t in zip(entries, tensors, strict=True):
        buf[e.offset : e.offset + e.nbytes] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return entries, buf


def variant_tensors(tensors: list[torch.Tensor], kinds: list[str], variant: str) -> list[torch.Tensor]:
    if variant == "fp32":
        return tensors
    return [
        t.to(torch.bfloat16) if k in ("param", "exp_avg", "exp_avg_sq") and t.is_floating_point() else t
        for t, k in zip(tensors, kinds, strict=True)
    ]
