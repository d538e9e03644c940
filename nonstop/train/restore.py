"""What a worker restores when a generation starts, read from this node's memory or the
durable tier (no process group needed), and applied once a sharded model is built.

* its own snapshot of the restore step (:func:`read_own`; under its old rank number when an
  elastic shrink renumbered it);
* every old rank's state, to reshard (:func:`read_to_reshard`): an elastic resize of a sharded
  job without replicas (from the node's own and replica slots) or a resume on another mesh
  (from the durable tier). From memory these are views of the slots, not copies: a new rank
  copies out only the slices its own shards need (:func:`~nonstop.snapshot.sharded.reshard`),
  so resharding W old ranks costs it its own share, not W old ranks' states;
* :func:`read_restore` decides which from the ``reconfigure`` message: a data-parallel model
  restores at once; a sharded model exists only once the generation's groups are joined, so
  what it restores is held (:class:`InGroup`) and copied in then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nonstop.config import WorkerEnv
from nonstop.errors import SnapshotError
from nonstop.mesh import MeshSpec
from nonstop.protocol.worker import ReconfigureMsg
from nonstop.reshardplan import TensorLayout, needed_old_ranks
from nonstop.snapshot import RankSnapshotStore, StateCapture
from nonstop.snapshot.capture import restore_resharded
from nonstop.snapshot.sharded import iter_local_shards

__all__ = ["InGroup", "Resharding", "open_store", "read_own", "read_restore", "read_to_reshard"]

log = logging.getLogger(__name__)


@dataclass
class Resharding:
    """The old ranks' states of one step (``states[r]``: old rank r's), to cut new shards out
    of. Read from memory, the tensors are views of the slots of ``stores`` (this node's own and
    replica slots), which stay open until :meth:`close`: the slots must not be written before
    then (``rejoin._resharded_everywhere`` holds every rank's fresh snapshot back until all the
    generation's ranks have resharded)."""

    states: list[dict[str, Any] | None]  # None: an old rank this node's ranks do not need
    stores: list[RankSnapshotStore] = field(default_factory=list)
    # reads an old rank left out (None) after all: the durable tier can, memory cannot
    load: Callable[[int], dict[str, Any]] | None = None

    def fill(self) -> bool:
        """Read every old rank left out (with ``load``); whether there was any to read."""
        missing = [r for r, st in enumerate(self.states) if st is None]
        if self.load is None or not missing:
            return False
        log.warning("resharding needs old ranks %s after all: reading them too", missing)
        for r in missing:
            self.states[r] = self.load(r)
        return True

    def close(self) -> None:
        """Drop the states and close the stores they are views into. A store whose mapping is
        still referenced (an exception's traceback holding a view) stays mapped until those
        references die: that is logged, not raised."""
        self.states = []
        for store in self.stores:
            try:
                store.close()
            except BufferError:
                log.debug("a slot store stays mapped: views of it are still referenced")
        self.stores = []


@dataclass
class InGroup:
    """A sharded model's restore, read at the restore stage: its own snapshot (``held``) or
    every old rank's (``old_ranks``, to reshard); :meth:`apply` once the model is built, then
    :meth:`close`."""

    held: Any = None
    old_ranks: Resharding | None = None

    def apply(self, capture: StateCapture, rank: int) -> None:
        if self.held is not None:
            capture.restore(self.held)
        elif self.old_ranks is not None:
            try:
                restore_resharded(capture, self.old_ranks.states, rank)
            except SnapshotError:
                # a slice the planned old ranks leave uncovered (the model's new layout is not
                # the old placements on the new sizes): read the rest, if it can, and cut again
                if not self.old_ranks.fill():
                    raise
                restore_resharded(capture, self.old_ranks.states, rank)

    @property
    def reads_slots(self) -> bool:
        """Whether what it restores is views of slots other ranks of this node may write."""
        return self.old_ranks is not None and bool(self.old_ranks.stores)

    def close(self) -> None:
        """Release what was read (idempotent)."""
        self.held = None
        if self.old_ranks is not None:
            self.old_ranks.close()
            self.old_ranks = None


def read_restore(
    msg: ReconfigureMsg,
    *,
    env: WorkerEnv,
    store: RankSnapshotStore,
    in_group: bool,
    capture: Callable[[], StateCapture],
    step: int,
    live_at: int | None,
    mesh: MeshSpec | None = None,
) -> tuple[int, InGroup | None]:
    """Restore what the ``reconfigure`` message ``msg`` says (``store``: this rank's slots;
    ``capture``: a callable giving the data-parallel model's :class:`StateCapture`). Returns the
    step this rank is at, and for a sharded model (``in_group``) what to apply once it is built.
    ``live_at``: the step this rank paused after (a boundary swap keeps that live state);
    ``mesh``: this generation's (a resume from the durable tier reads only what it reshards from)."""
    own_step = msg.restore_step
    if own_step is None:
        return 0, None
    if in_group and msg.reshard is not None:
        info = msg.reshard
        old = read_to_reshard(info, env, rank=msg.rank, mesh=mesh)
        return int(info["step"]), InGroup(old_ranks=old)
    if in_group:
        held = read_own(env, store, msg.from_rank, own_step)
        return int(held["step"]), InGroup(held=held)
    if msg.live and live_at == own_step:
        return step, None  # paused after exactly that step: the live state is the snapshot, bit for bit
    return capture().restore(read_own(env, store, msg.from_rank, own_step)), None


def open_store(env: WorkerEnv, rank: int) -> RankSnapshotStore:
    """The snapshot slots of ``rank`` on this process's node."""
    return RankSnapshotStore(shm_dir=env.shm_dir, job_id=env.job_id, rank=rank, num_slots=env.num_slots)


def read_own(env: WorkerEnv, store: RankSnapshotStore, from_rank: int | None, step: int) -> Any:
    """This process's snapshot of ``step``: in ``store`` (its rank's slots), or in its old rank's
    when it was renumbered (an elastic shrink; copied out, as that store closes)."""
    if from_rank is None:
        return store.read(step, copy=False)
    old = open_store(env, int(from_rank))
    try:
        return old.read(step, copy=True)
    finally:
        old.close()


def read_to_reshard(
    info: Mapping[str, Any],
    env: WorkerEnv,
    *,
    copy: bool = False,
    rank: int | None = None,
    mesh: MeshSpec | None = None,
) -> Resharding:
    """Every old rank's state of step ``info["step"]`` of a world of ``info["world"]`` ranks,
    which the new model, once built, cuts its shards out of
    (:func:`~nonstop.snapshot.capture.restore_resharded`): from this node's memory when
    ``info["memory"]`` says where each old rank's is (``local``: the slots of that rank number
    here, ``replica``: the replicas this node keeps; an old rank it leaves out is not needed
    here and reads as None), else from the durable
    checkpoint at ``info["url"]``, each checksum verified (a job resumed on another mesh).

    From memory the states are views of the slots (their stores stay open in the result);
    ``copy=True`` copies each old rank's whole state out instead and closes them (what this did
    before; ``benchmarks/bench_reshard.py`` measures the two side by side). From the durable
    tier, given this rank's number and ``mesh``, only the old ranks it cuts from
    (:func:`durable_plan`), the rest read later only if its model needs them after all."""
    from nonstop.snapshot.store import decode_raw

    step, world = int(info["step"]), int(info["world"])
    where = info.get("memory")
    if where is None:
        from nonstop.snapshot.durable import DurableStore

        durable = DurableStore(str(info["url"]))

        def load(r: int) -> dict[str, Any]:
            state: dict[str, Any] = decode_raw(*durable.load_rank(step, r))
            return state

        if rank is None or mesh is None:
            return Resharding([load(r) for r in range(world)])
        base = rank % world  # read first: the unsharded rest comes from it, the layouts too
        states: list[dict[str, Any] | None] = [None] * world
        states[base] = load(base)
        for r in sorted(durable_plan(states[base], world, mesh, rank) - {base}):
            states[r] = load(r)
        return Resharding(states, load=load)
    from nonstop.replica.peer import REPLICA_SLOTS, replicas_beside

    out = Resharding([])
    try:
        for old in range(world):
            if str(old) not in where:  # not needed by this node's ranks (nonstop/reshardplan.py)
                out.states.append(None)
                continue
            local = where[str(old)] == "local"
            store = RankSnapshotStore(
                shm_dir=env.shm_dir,
                job_id=env.job_id if local else replicas_beside(env.job_id),
                rank=old,
                num_slots=env.num_slots if local else REPLICA_SLOTS,
            )
            out.stores.append(store)
            out.states.append(store.read(step, copy=copy))
            if copy:
                out.stores.pop().close()
    except BaseException:
        out.close()
        raise
    return out


def durable_plan(state: Any, world: int, mesh: MeshSpec, rank: int) -> set[int]:
    """The old ranks (of ``world``) whose shards new rank ``rank`` of ``mesh`` cuts from, by the
    layouts of one old rank's ``state`` (:mod:`nonstop.reshardplan`; the old mesh from its
    DTensors' mesh dims and sizes); every old rank when those do not give the old mesh."""
    every = set(range(world))
    shards = list(iter_local_shards(state))
    named = [sh for sh in shards if sh.mesh_dims is not None]
    if not named or len(named) != len(shards):
        return every
    widest = max(named, key=lambda sh: len(sh.mesh_shape))
    try:
        old = MeshSpec.of(dict(zip(widest.mesh_dims or (), widest.mesh_shape, strict=True)))
    except ValueError:
        return every  # mesh dims nonstop does not name
    if old.world_size != world:
        return every
    layouts = {TensorLayout(sh.global_shape, sh.placements, sh.mesh_dims or ()): None for sh in shards}
    try:
        return needed_old_ranks(list(layouts), old, mesh, [rank])
    except ValueError:
        return every
