"""A rank's snapshot slots as its training loop uses them.

:class:`LoopSnapshots` holds the rank's open :class:`~nonstop.snapshot.RankSnapshotStore`
(reopened under a new rank number when an elastic resize renumbers the rank), takes each step's
snapshot in the job's mode, fences the overlapped copy before the next optimizer step, and adds
up what the loop waited on that fence, for the step's reported stall.

Threading contract: main thread only (the training loop's); the store's background copy is the
store's own business.
"""

from __future__ import annotations

import logging

from nonstop.config import WorkerEnv
from nonstop.mesh import MeshSpec
from nonstop.policy.cadence import Cadence
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.snapshot.nodecopy import NodeCopy, node_slots
from nonstop.snapshot.sharded import replicated_along
from nonstop.snapshot.store import PendingWrite, Share
from nonstop.train.restore import open_store

__all__ = ["LoopSnapshots"]

log = logging.getLogger(__name__)


class LoopSnapshots:
    """The rank's snapshot store while ``Session.run`` trains (see the module docstring)."""

    def __init__(self, env: WorkerEnv) -> None:
        self._env = env
        self._store: RankSnapshotStore | None = None
        self._fence_wait_s = 0.0
        self.taken: int | None = None  # the step of the newest snapshot begun
        # a DDP job's replicated state, once per node (snapshot/nodecopy.py); a sharded job's
        # ranks hold different shards, so each keeps its own
        # (an HSDP job's replica groups hold their shards alike: one copy per copy group; opened
        # at the first snapshot, when the model's placements say whether it replicates)
        self._node: NodeCopy | None = None
        self._alike: tuple[int, bool] | None = None  # (id(optimizer), replicated along "replicate")
        self._mesh = MeshSpec.parse(env.mesh) if env.mesh is not None else None
        self.cadence = Cadence(every=env.snapshot_every)  # (policy/cadence.py)
        self._next: Cadence | None = None  # announced, from its step on

    @property
    def may_skip(self) -> bool:
        """Whether some steps go unsnapshotted: the interval is above 1, or a new one is announced."""
        return self.cadence.every > 1 or self._next is not None

    def schedule(self, cadence: Cadence) -> None:
        """The coordinator's new interval (``--snapshot-budget``), from step ``cadence.since`` on."""
        self._next = cadence

    def announced(self) -> Cadence:
        """The newest interval heard: the one announced and not reached yet, else the one run."""
        return self._next or self.cadence

    def due(self, step: int, *, final: bool, pause_at: int | None) -> bool:
        """Whether the state after ``step`` is snapshotted: the job's cadence (every
        ``--snapshot-every`` K-th step, or the interval a budget tuned), the run's last step, and
        a swap's boundary (``pause_at``: the coordinator asked this rank to stop after that step)
        -- each of those must be restorable."""
        if self._next is not None and step >= self._next.since:
            self.cadence, self._next = self._next, None
        return self.cadence.due(step) or final or (pause_at is not None and step >= pause_at)

    def open(self, rank: int) -> None:
        """Open the slots of ``rank``, closing the ones open under another number."""
        if self._store is not None:
            self._store.close()
        self._store = open_store(self._env, rank)

    @property
    def live(self) -> RankSnapshotStore:
        assert self._store is not None, "Session.run() has not started"
        return self._store

    def _copy_group(self, capture: StateCapture) -> int | None:
        """This rank's copy group (snapshot/nodecopy.py), or None when it keeps its own whole copy:
        a DDP job's ranks are group 0; an HSDP job's rank is in its shard coordinates' group when
        the optimizer's parameters are replicated along ``replicate`` (checked once per
        optimizer: a model sharded along a dim named so is not alike across it)."""
        if not self._env.node_copy:
            return None
        if self._mesh is None:
            return 0
        opt = capture.optimizer
        if opt is None:
            return None
        if self._alike is not None and self._alike[0] == id(opt):
            alike = self._alike[1]
        else:  # (a sharded job's optimizer is built again each generation)
            params = [p for group in opt.param_groups for p in group["params"]]
            alike = replicated_along(params, "replicate")
            self._alike = (id(opt), alike)
            if not alike:
                log.info("node copy: parameters not replicated along 'replicate'; each rank keeps its own")
        return self._mesh.copy_group(self.live.rank) if alike else None

    def _shared(self, capture: StateCapture, gen: int) -> Share | None:
        """With a node copy: what of ``capture`` goes to the copy group's shared write (the
        parameters and optimizer state, what ``optimizer.step`` alone changes, alike on every DDP
        rank and across an HSDP job's replica groups), the store told which generation's shared
        writes to join. None without one."""
        group = self._copy_group(capture)
        if group is None:
            return None
        if self._node is None or self._node.group != group:
            if self._node is not None:
                self._node.close()
            env = self._env
            self._node = NodeCopy(
                shm_dir=env.shm_dir, job_id=env.job_id, num_slots=node_slots(env.num_slots), group=group
            )
        self.live.share_with(self._node, gen)
        return capture.deferrable()

    def take(self, step: int, capture: StateCapture, gen: int) -> PendingWrite | None:
        """Snapshot the state after ``step`` steps (in generation ``gen``) per the job's mode,
        the state alike on every rank to the node's shared write of the step (:meth:`_shared`)."""
        mode = self._env.snapshot
        if mode == "off":  # only for measuring what snapshots cost; nothing to recover from
            return None
        share = self._shared(capture, gen)
        deferred = (share if share is not None else capture.deferrable()) if mode == "overlapped" else None
        pending = self.live.begin(step, capture.state(step), deferred=deferred, share=share)
        self.taken = step
        return pending

    def write(self, step: int, capture: StateCapture, gen: int) -> None:
        """Snapshot the state after ``step`` now, whatever the job's mode (a generation's first
        snapshot: a fresh job's step 0, a renumbered rank's restored step)."""
        share = self._shared(capture, gen)
        self.live.write(step, capture.state(step), share=share)

    def prefault(self, capture: StateCapture, step: int) -> int:
        """Size this rank's slots for its state ahead of its first snapshots (a joiner's)."""
        return self.live.prefault(capture.state(step), share=self._shared(capture, 0))

    def fence(self) -> None:
        """Hold the optimizer back until the previous step's overlapped copy is done with the
        state: on the CPU a host wait; with device tensors each device's current stream waits for
        that device's copies, and the host only for CPU-resident ones still copying
        (:meth:`~nonstop.snapshot.pending.PendingWrite.fence`)."""
        pending = self.live.pending
        if pending is not None:
            before = pending.waited_s
            pending.fence()
            self._fence_wait_s += pending.waited_s - before

    def waited_s(self) -> float:
        """Seconds the loop waited on fences since the last call."""
        out, self._fence_wait_s = self._fence_wait_s, 0.0
        return out
