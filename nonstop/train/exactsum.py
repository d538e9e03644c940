"""A gradient mean that is bitwise the same at every world size of an elastic job.

Why: an allreduce adds the ranks' values in an order set by the algorithm and the world size
(gloo's ring: by an element's offset and the number of ranks), and gradient accumulation adds a
rank's micro-batches locally first. A job that shrinks -- two shards played by one rank -- then
sums the same shard gradients in another order than at full size, and its weights drift from an
uninterrupted run's in the last bits. After a grow back the job can no longer be compared bit for
bit with one that never lost a rank.

How: every shard's gradient is kept apart (a row of ``parts``; a rank playing ``m`` shards has
``m`` rows, in shard order) and the sum of element ``e`` is always
``((g_0[e] + g_1[e]) + g_2[e]) + ... + g_{N-1}[e]``, then divided by ``N`` -- whatever the world
size. The flat gradient is cut into one chunk per rank; an all-to-all gives rank ``j`` every
shard's rows of chunk ``j`` (ranks play contiguous shards in rank order, so the rows arrive in
shard order), rank ``j`` adds them row by row, and an all-gather returns the chunks. The bytes a
rank sends and receives are about those of a ring allreduce (``~2G`` at full size); gloo's
all-to-all is slower per byte than its ring, which ``benchmarks/bench_step_overhead.py`` measures.

Only elastic jobs (``--min-world-size`` below the world size) use it; a job whose world size never
changes keeps the allreduce of :mod:`nonstop.train.ddp`, already exact across generations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from nonstop.policy.elastic import assign_shards

__all__ = ["exact_mean"]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns from 2.14 on)
_all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def exact_mean(
    parts: torch.Tensor,
    *,
    shards: tuple[int, ...],
    num_shards: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The mean over all ``num_shards`` shards of the job, from this rank's ``parts``.

    ``parts``: shape ``(len(shards), G)``, row ``i`` the flat gradient of ``shards[i]``;
    ``shards`` must be this rank's contiguous block of :func:`assign_shards` (every rank calls
    this with its own, collectively). Returns a new ``(G,)`` tensor, identical on every rank and
    bitwise independent of the world size."""
    world, rank = group.size(), group.rank()
    blocks = assign_shards(num_shards, world)
    if tuple(shards) != blocks[rank]:
        raise RuntimeError(
            f"nonstop: rank {rank} of {world} plays shards {list(shards)}, expected "
            f"{list(blocks[rank])} of {num_shards}: the exact gradient mean needs every rank's shards"
        )
    if parts.dim() != 2 or parts.shape[0] != len(shards):
        raise ValueError(f"parts must have one row per shard ({len(shards)}), got shape {tuple(parts.shape)}")
    total = parts.shape[1]
    chunk = math.ceil(total / world) if total else 0
    padded = chunk * world
    if padded != total:
        parts = torch.nn.functional.pad(parts, (0, padded - total))
    # destination-major: the rows of chunk j of every local shard, for rank j
    send = parts.reshape(len(shards), world, chunk).transpose(0, 1).contiguous()
    recv = torch.empty(num_shards * chunk, dtype=parts.dtype, device=parts.device)
    dist.all_to_all_single(  # split sizes count elements of the flat tensors
        recv,
        send.reshape(-1),
        output_split_sizes=[len(b) * chunk for b in blocks],
        input_split_sizes=[len(shards) * chunk] * world,
        group=group,
    )
    rows = recv.view(num_shards, chunk)
    acc = rows[0].clone()
    for row in rows[1:]:  # the one summation order: shard 0, 1, ... N-1
        acc.add_(row)
    acc.div_(num_shards)
    out = torch.empty(padded, dtype=parts.dtype, device=parts.device)
    _all_gather_single(out, acc, group=group)
    return out[:total]
