"""Reading a job's durable checkpoint back as plain state dicts: :func:`load_checkpoint`.

A checkpoint holds one snapshot per rank (:mod:`nonstop.snapshot.durable`). What a user wants of
it is the job's state once, as their own code would hold it:

* a **data-parallel** job (DDP; no DTensor anywhere): every rank holds the same model and
  optimizer, so they are taken from rank 0 -- the keys are those of the model's own
  ``state_dict()`` (nonstop snapshots the module it was given, never DDP's wrapper: no
  ``module.`` prefix). Every rank is still read and verified (a checkpoint is good only when
  all its ranks are, as for ``--resume``), and a rank whose model differs from rank 0's is
  reported (a warning line);
* a **sharded** job (``--mesh``: FSDP2, HSDP, tensor parallel): each DTensor is stored as every
  rank's local shard; it is gathered into the full tensor (:func:`~nonstop.snapshot.sharded.stitch`:
  HSDP's replicas must agree, the shards must cover every element). Plain tensors and other
  values are rank 0's.

Contract: nothing is unpickled (the snapshot files are raw bytes and JSON, decoded by
:func:`~nonstop.snapshot.raw.decode_state`); every chunk's checksum is verified; with
``step=None`` a corrupt or truncated checkpoint is skipped for the next older good one (one
warning line each on the ``nonstop.durable`` logger, logged once a good one is found).
Every returned tensor owns its memory (no two share storage). Errors: SnapshotMissingError when
there is no usable checkpoint (or no such ``step``), SnapshotCorruptError when the chosen
``step`` is corrupt, UsageError for a bad location.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nonstop.errors import SnapshotCorruptError, SnapshotError, SnapshotMissingError
from nonstop.snapshot.durable import DurableStore
from nonstop.snapshot.raw import decode_state
from nonstop.snapshot.sharded import LocalShard, iter_local_shards, stitch
from nonstop.snapshot.validate import decoding

__all__ = ["Checkpoint", "load_checkpoint"]

log = logging.getLogger("nonstop.checkpoint")


@dataclass(frozen=True)
class Checkpoint:
    """One durable checkpoint as plain state dicts (see the module docstring).

    ``model``: the model's ``state_dict()`` (gathered for a sharded job), ready for
    ``model.load_state_dict``; ``optimizer``: the optimizer's ``state_dict()`` (``{"state":
    {index: {...}}, "param_groups": [...]}``, DTensor state gathered), or None when the job had
    none; ``extras``: each rank's extras (what ``extras=`` returned), by rank; ``rng``: each
    rank's RNG states (``torch``, ``python``, ``numpy``), by rank -- both empty when loaded with
    ``ranks=False``."""

    url: str
    step: int
    world_size: int
    sharded: bool
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    extras: list[dict[str, Any]] = field(default_factory=list)
    rng: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "world_size", "model", "optimizer", "extras"}``: what ``nonstop export
        --what all`` writes."""
        return {
            "step": self.step,
            "world_size": self.world_size,
            "model": self.model,
            "optimizer": self.optimizer,
            "extras": self.extras,
        }


def load_checkpoint(
    url: str | os.PathLike[str], step: int | None = None, *, ranks: bool = True
) -> Checkpoint:
    """The checkpoint at durable location ``url`` (a directory or fsspec URL: what ``--persist``
    and ``--resume`` take) as plain state dicts: step ``step``, or with None the newest good one.
    ``ranks=False`` skips keeping each rank's extras and RNG (every rank is still verified)."""
    store = DurableStore(url)
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an integer >= 0 (got {step!r})")
        committed = store.steps()
        if step not in committed:
            have = ", ".join(map(str, committed[-8:])) or "none"
            raise SnapshotMissingError(
                f"{store.url} has no committed checkpoint step {step} (newest steps: {have})"
            )
        return _read_step(store, step, ranks)
    return store.first_good(lambda s: _read_step(store, s, ranks), defer_warnings=True)


def _read_step(store: DurableStore, step: int, keep_ranks: bool) -> Checkpoint:
    world = store.world_size_at(step)
    states = [_rank_state(store, step, 0)]
    sharded = _has_shards(states[0].get("model")) or _has_shards(states[0].get("optimizer"))
    extras: list[dict[str, Any]] = []
    rngs: list[dict[str, Any]] = []

    def keep(state: dict[str, Any]) -> None:
        if keep_ranks:
            extras.append(_plain(state.get("extras") or {}))
            rngs.append(_plain(state.get("rng") or {}))

    keep(states[0])
    differs = []
    for r in range(1, world):
        st = _rank_state(store, step, r)
        keep(st)
        if sharded:
            states.append(st)  # every rank's shards, to gather
        elif not _same(st.get("model"), states[0].get("model")):
            differs.append(r)
    if differs:
        log.warning(
            "checkpoint step %d: the model of rank(s) %s differs from rank 0's; rank 0's is taken",
            step,
            differs,
        )
    first = states[0]
    where = f"checkpoint step {step} ({store.url})"
    model = _gather([s.get("model") for s in states], f"{where}: model") if sharded else first.get("model")
    opt = first.get("optimizer")
    if sharded and opt is not None:
        opt = _gather([s.get("optimizer") for s in states], f"{where}: optimizer")
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise SnapshotCorruptError(f"{where}: its model is not a state dict of tensors")
    return Checkpoint(
        url=store.url,
        step=step,
        world_size=world,
        sharded=sharded,
        model=dict(model),
        optimizer=opt,
        extras=extras,
        rng=rngs,
    )


def _rank_state(store: DurableStore, step: int, rank: int) -> dict[str, Any]:
    meta, data = store.load_rank(step, rank)
    buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    what = f"checkpoint step {step} ({store.url}) rank {rank}"
    state = decode_state(meta, buf, len(data), what, copy=True)  # each tensor its own memory
    if not isinstance(state, dict) or "model" not in state:
        raise SnapshotCorruptError(f"{what}: not a training state (no model)")
    return state


def _has_shards(obj: Any) -> bool:
    return next(iter_local_shards(obj), None) is not None


def _same(a: Any, b: Any) -> bool:
    """Whether two rank's models are equal, bit for bit (tensors by their bytes)."""
    if not isinstance(a, dict) or not isinstance(b, dict) or list(a) != list(b):
        return False
    for k, t in a.items():
        u = b[k]
        if not isinstance(t, torch.Tensor) or not isinstance(u, torch.Tensor):
            return False
        if t.dtype != u.dtype or t.shape != u.shape:
            return False
        if not torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)):
            return False
    return True


def _gather(trees: list[Any], where: str) -> Any:
    """Rank 0's tree with every :class:`LocalShard` replaced by the full tensor stitched from
    that place in every rank's tree."""

    def walk(nodes: list[Any], path: str) -> Any:
        head = nodes[0]
        if isinstance(head, LocalShard):
            if not all(isinstance(n, LocalShard) for n in nodes):
                raise SnapshotCorruptError(f"{where}: {path} is sharded on some ranks only")
            try:
                return stitch(nodes)
            except SnapshotError as e:
                raise SnapshotError(f"{where}: {path}: {e}") from None
        if isinstance(head, dict):
            if not all(isinstance(n, dict) and n.keys() == head.keys() for n in nodes):
                raise SnapshotCorruptError(f"{where}: the ranks' state differ in structure at {path}")
            return {k: walk([n[k] for n in nodes], f"{path}.{k}" if path else str(k)) for k in head}
        if isinstance(head, (list, tuple)) and _has_shards(head):
            if not all(type(n) is type(head) and len(n) == len(head) for n in nodes):
                raise SnapshotCorruptError(f"{where}: the ranks' state differ in structure at {path}")
            out = [walk([n[i] for n in nodes], f"{path}[{i}]") for i in range(len(head))]
            return tuple(out) if isinstance(head, tuple) else out
        return head

    with decoding(where, "it is not exported"):
        return walk(trees, "")


def _plain(obj: Any) -> Any:
    """``obj`` with NumPy arrays as tensors (what ``torch.load(weights_only=True)`` reads)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj
