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

:class:`StepRescue` is the training loop's side: it arms the head as a step begins (when this job's
failures are rescued at all) and, when the step fails, writes the rescued state to the rank's slots
and says what the fault report carries of it.

Cost per step, only where the previous step was not snapshotted: one pass over the state's tensors
and the head's copy.
Threading: main thread only.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nonstop.policy.rescue import Report
from nonstop.snapshot import StateCapture

if TYPE_CHECKING:
    from nonstop.train.snapshots import LoopSnapshots

__all__ = ["Rescued", "StepHead", "StepRescue", "digest", "now", "rest_digest"]

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


class StepRescue:
    """A rank's rescues (see the module docstring): ``snaps``, the loop's snapshot slots, which
    say whether steps go unsnapshotted and take the rescued state; ``snapshot``, the job's
    snapshot mode (``"off"``: nothing to rescue into)."""

    def __init__(self, snaps: LoopSnapshots, *, snapshot: str) -> None:
        self._snaps = snaps
        self._off = snapshot == "off"
        self._head = StepHead()

    @property
    def enabled(self) -> bool:
        """Whether this job's failures are rescued: steps go unsnapshotted (``--snapshot-every``
        K > 1, or an interval a ``--snapshot-budget`` widened: from its announcement on, as the
        coordinator's ``WorkerProtocol.rescues``), snapshots on."""
        return self._snaps.may_skip and not self._off

    def arm(self, capture: StateCapture | None, step: int) -> None:
        """Step ``step + 1`` begins on ``capture`` (built: the generation's group is joined):
        note its start for a rescue."""
        if self.enabled:
            assert capture is not None, "the model is built once the generation's group is joined"
            self._head.arm(capture, step)
        else:
            self._head.disarm()

    def disarm(self) -> None:
        """The step completed: nothing to rescue from its start."""
        self._head.disarm()

    def rescue(self, capture: StateCapture | None, step: int) -> Report | None:
        """A step failed, or the coordinator asked this rank to leave (a ``leave``, before or
        in a step): have the state after the last completed step (``step``) in this rank's slots
        -- the live tensors with the step's head if the failed step left them untouched, or as
        they are if no step began (:func:`now`) -- written unless that step was snapshotted;
        what the fault report says of it (:class:`~nonstop.protocol.worker.FaultMsg`'s
        ``rescue``: the step rescued, None when it could not be, and its head's digest; None
        when rescues are off or no model is built yet). A rescue that fails costs nothing but the
        rescue."""
        if not self.enabled or capture is None:
            return None
        try:
            found = self._head.rescue(capture, step) if self._head.armed else now(capture, step)
            if found is None:
                return (None, None)
            t0 = time.monotonic()
            self._snaps.live.drain()
            if self._snaps.taken != found.step:
                self._snaps.live.write(found.step, found.state)
                self._snaps.taken = found.step
                log.info("rescued step %d into memory in %.3fs", found.step, time.monotonic() - t0)
            return (found.step, found.digest)
        except Exception:
            log.warning("the rescue snapshot failed; recovery restores the last snapshot", exc_info=True)
            return (None, None)
        finally:
            self._head.disarm()


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
