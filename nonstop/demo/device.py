"""What the demo scripts do on a GPU: deterministic kernels, so that ``nonstop demo --verify`` can
compare a recovered run's weights bitwise with an uninterrupted one's, and the run's device and
process-group backend for its result file. On the CPU nothing changes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["deterministic_on", "where"]


def deterministic_on(device: torch.device) -> None:
    """On a CUDA ``device``: deterministic kernels (a kernel torch has none of only warns) and a
    fixed cuBLAS workspace; call before the first matrix product (cuBLAS reads the variable when
    it makes its handle). Nothing elsewhere."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def where(device: torch.device) -> dict[str, str | None]:
    """``{"device", "backend"}`` of this process for a result file."""
    return {"device": str(device), "backend": dist.get_backend() if dist.is_initialized() else None}
