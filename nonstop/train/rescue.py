"""A survivor's rescue snapshot: with ``--snapshot-every K`` (K > 1) a failure need not cost the
survivors the up to K - 1 steps since the last snapshot.

A rank's state after step ``s`` is still in its live tensors while step ``s + 1`` runs, up to the
step's first in-place write (``optimizer.step()``, a BatchNorm's running stats, a DDP buffer
broadcast; a sharded model's all-gathers write other buffers, not its shards). When ``s`` was
not snapshotted, :class:`StepHead` notes at the start of step ``s + 1`` the ``_version`` counter
of every state tensor (torch bumps it on each in-place write) and copies out what a step changes
outside them -- RNGs, extras, ``state=`` objects, the optimizer's hyperparameters
(:meth:`~nonstop.snapshot.StateCapture.head`; a few KB). When the step fails,
:meth:`StepHead.rescue` gives the state after ``s`` if no counter moved: the live tensors with the
head copied at the start. The survivor writes it to its slots before it reports the fault
(``rescued: s``), and the coordinator plans the newest step every rank holds with it
(:mod:`nonstop.policy.rescue`).

``digest`` fingerprints the head: when every survivor's is the same, the ranks' state outside the
replicated tensors is alike (seeded alike, no per-rank state), so a replaced rank may take the
state of ``s`` of a survivor holding the same shards (any, data-parallel; one of its copy group,
HSDP) as a grow's joiner takes rank 0's.

Cost per step, only where the previous step was not snapshotted: one pass over the state's tensors
and the head's copy.
Threading: main thread only.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nonstop.snapshot import StateCapture

__all__ = ["Rescued", "StepHead", "digest", "now", "rest_digest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rescued:
    """The state after ``step`` (a snapshot's dict) and its head's :func:`digest`."""

    step: int
    state: dict[str, Any]
    digest: str


class StepHead:
    """The start of the step in flight, for a rescue should it fail (see the module docstring)."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._versions: list[int] = []
        self._head: dict[str, Any] = {}

    def arm(self, capture: StateCapture, step: int) -> None:
        """Step ``step + 1`` begins; the state after ``step`` is not snapshotted."""
        tensors = capture.tensors()
        self._versions = [t._version for t in tensors]
        self._head = capture.head()
        self._step = step

    def disarm(self) -> None:
        self._step, self._versions, self._head = None, [], {}

    @property
    def armed(self) -> bool:
        return self._step is not None

    def rescue(self, capture: StateCapture, step: int) -> Rescued | None:
        """The state after ``step`` if the failed step left every state tensor as it found it;
        None when not armed for ``step`` or a tensor was written (or the optimizer made new
        state: its first step)."""
        if self._step != step:
            return None
        tensors = capture.tensors()
        if len(tensors) != len(self._versions) or any(
            t._version != v for t, v in zip(tensors, self._versions, strict=True)
        ):
            log.info("no rescue of step %d: the failed step had written the state", step)
            return None
        return _with_head(capture, step, self._head)


def now(capture: StateCapture, step: int) -> Rescued:
    """The state after ``step`` when no step has begun since: the live state as it is."""
    return _with_head(capture, step, capture.head())


def _with_head(capture: StateCapture, step: int, head: dict[str, Any]) -> Rescued:
    opt = capture.optimizer
    optimizer = None
    if opt is not None:  # the live state, the hyperparameters of the head
        sd = opt.state_dict()
        groups = [{**g, **h} for g, h in zip(sd["param_groups"], head["param_groups"], strict=True)]
        optimizer = {"state": sd["state"], "param_groups": groups}
    state = {
        "step": step,
        "model": capture.model.state_dict(keep_vars=True),
        "optimizer": optimizer,
        "rng": head["rng"],
        "extras": head["extras"],
        "objects": head["objects"],
    }
    return Rescued(step, state, rest_digest(head))


def rest_digest(head: dict[str, Any]) -> str:
    """The :func:`digest` of a head's state outside the replicated tensors (RNGs, extras,
    ``state=`` objects): equal on ranks that may stand in for each other."""
    return digest({k: head[k] for k in ("rng", "extras", "objects")})


def digest(obj: Any) -> str:
    """A fingerprint of a nested state (dicts, lists, tensors, arrays, scalars), equal for equal
    contents: keys in sorted order, tensors by dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    _feed(h, obj)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())
