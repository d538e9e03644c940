"""Deterministic generated text: a random sparse Markov chain over a small vocabulary.

The chain (each token has a few likely successors) is fixed by a seed, so a
model can learn it and the loss falls. Batch ``(step, rank)`` is drawn from a
generator seeded by ``(seed, step, rank)``: any rank can redo any step and get
the same samples, and no two (step, rank) pairs share a batch.
"""

from __future__ import annotations

import torch

__all__ = ["MarkovCorpus"]


class MarkovCorpus:
    def __init__(self, *, vocab: int, seed: int = 1234, branching: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.seed = seed
        succ = torch.randint(0, vocab, (vocab, branching), generator=g)
        weights = torch.rand(vocab, branching, generator=g) + 0.1
        self.trans = torch.zeros(vocab, vocab)
        self.trans.scatter_add_(1, succ, weights)
        self.trans /= self.trans.sum(dim=1, keepdim=True)

    def batch(self, *, step: int, rank: int, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``(batch, seq)`` for this step and rank."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=g)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(self.trans[tokens[:, t]], 1, generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]
