"""A hot spare of a sharded job warms DTensor's dispatch cache while it waits for a rank.

**Why** -- DTensor works out each operator's output layout (sharding propagation) once per
operator, argument layouts and mesh, and caches the answer for the process. A spare that takes a
rank pays every miss in its first optimizer step, after the last collective of the step, so it
ends the recovery. Measured (torch 2.13, CPU, the demo GPT ``small`` as HSDP on a 2 x 2 mesh,
AdamW): that first ``optimizer.step()`` takes 0.20-0.28 s, the next ones 0.012-0.03 s, and a
profile puts 0.22 s of it in 63 cache misses. A warm-up on a small model of another shape on the
same mesh does not help (0.30-0.33 s): the entries are per layout.

**How** -- while it waits, the spare makes a fake world of the job's mesh (torch's ``fake``
backend: collectives return at once, nothing leaves the process) with the same groups and
``DeviceMesh`` the real generation makes (:func:`~nonstop.train.meshgroups.mesh_of`), calls the
script's ``build(mesh)`` in it, gives every parameter a zero gradient (``DTensor.from_local``: not
an operator, so it caches nothing) and takes one optimizer step; then the fake world is torn
down. Its first real step then takes 0.013-0.019 s (measured as above). The model and optimizer
built there are thrown away; ``build`` runs once more than otherwise, which its contract
(collective-free, called on every rank of every generation) already allows.

**Why it stays correct** -- the cache's keys compare meshes by layout, device type, dim names
and thread, not by this rank's coordinate nor its groups: the real mesh hits what the fake one
put there, whichever rank the spare is given. A hit hands back the layout computed then, though,
with the *fake* mesh in it: fake rank 0's coordinate and group names. Once the spare has built
its real mesh, :meth:`Warmed.adopt` gives each fake mesh object the state of the real mesh equal
to it, so every cached layout names this rank's coordinate and groups -- what a survivor's cache
holds after a rebuild (each generation makes new mesh objects; the group names hash the ranks).
A fake mesh with no real counterpart clears the whole cache instead (correct, just cold again).

**Interruptible** -- a reconfigure that arrives while the spare warms up interrupts it like a
step (:meth:`~nonstop.train.link.CoordinatorLink.enter_step`: SIGUSR1, :class:`PeerFailed`): the
fake world is torn down and the spare takes its rank at once, cold. Main thread only.
"""

from __future__ import annotations

import gc
import importlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nonstop.config import WorkerEnv
from nonstop.mesh import MeshSpec
from nonstop.train.link import PeerFailed

__all__ = ["MeshHistory", "Warmed", "adopt_meshes", "live_meshes", "prepare_spare", "warm_sharded"]

log = logging.getLogger(__name__)


class _Interruptible(Protocol):
    """What the warm-up needs of the link: a step's interrupt (CoordinatorLink)."""

    in_step: bool

    def enter_step(self) -> None: ...


class Warmed:
    """The fake meshes a warm-up left in DTensor's cache, until the real mesh replaces them."""

    def __init__(self, meshes: list[Any], *, took_s: float) -> None:
        self.meshes = meshes
        self.took_s = took_s
        self.adopted = 0

    def adopt(self, real: Any) -> bool:
        """Give each fake mesh the state of the real mesh equal to it: ``real`` (the generation's
        root mesh) or the submesh of ``real`` with the fake's dim names. Returns False, having
        cleared DTensor's cache, where one has no counterpart. Once per process: the meshes are
        forgotten here (the cache still holds them, as it holds a survivor's earlier meshes)."""
        meshes, self.meshes = self.meshes, []
        self.adopted, unmatched = adopt_meshes(meshes, real)
        if unmatched:
            log.warning("%d warm-up mesh(es) have no real counterpart: DTensor's cache is cleared", unmatched)
            clear_dtensor_cache()
            return False
        return True


class MeshHistory:
    """A survivor's side of the same hazard. Each generation makes new mesh objects, and the
    cache keeps answering with the first one it saw of each layout: harmless while this process
    plays the same coordinates on groups of the same names in every generation of a mesh shape
    (the group names hash the ranks, and a kept group takes the name a new one would get,
    :func:`~nonstop.train.meshgroups._creation_name`), wrong once either changes. An elastic job
    renumbers ranks at a shrink, and the grow back keeps the new numbers, so a rank 2 of
    ``shard=3`` can come back as rank 1 of ``shard=3``: its parameters would then carry rank 2's
    mesh, and the snapshot would record rank 2's offsets for rank 1's shards (measured: ``[86,
    0]`` for ``[43, 0]``). A group under another name (a torch that names groups otherwise) would
    leave a cached layout naming a group that is gone, and its first collective would fail. So
    when the rank or the group names this process has at a shape change, every older mesh equal
    to a part of the new one is given the new one's state (a scan of the live objects, ~0.1 s:
    only then)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, ...], tuple[int, tuple[str, ...]]] = {}
        self.readopted = 0

    def joined(self, real: Any, *, rank: int) -> None:
        """This process plays ``rank`` on ``real``, the generation's root mesh, before ``build``."""
        shape = tuple(int(n) for n in real.shape)
        now = (rank, _group_names(real))
        before = self._seen.get(shape, now)
        self._seen[shape] = now
        if before != now:
            self.readopted, _ = adopt_meshes([m for m in live_meshes() if m is not real], real)
            log.info(
                "rank %d -> %d, groups %s -> %s at mesh %s: %d cached meshes given the new state",
                before[0],
                rank,
                before[1],
                now[1],
                shape,
                self.readopted,
            )


def _group_names(mesh: Any) -> tuple[str, ...]:
    """The names of ``mesh``'s groups, one per dim (what a cached layout finds them by)."""
    return tuple(str(mesh.get_group(d).group_name) for d in mesh.mesh_dim_names or ())


def adopt_meshes(meshes: list[Any], real: Any) -> tuple[int, int]:
    """Give each of ``meshes`` that equals ``real`` or its submesh of the same dim names that
    mesh's state (attributes). Returns (adopted, without a counterpart)."""
    adopted = unmatched = 0
    names_of_real = tuple(real.mesh_dim_names or ())
    for old in meshes:
        names = tuple(old.mesh_dim_names or ())
        twin = None
        try:
            twin = real if names == names_of_real else real[names]
        except Exception as e:  # (a flattened or foreign mesh: no counterpart by names)
            log.debug("no mesh in the new one for %s: %s", names, e)
        if twin is None or twin != old or not hasattr(old, "__dict__"):
            unmatched += 1
            continue
        if twin is not old:
            old.__dict__.update(twin.__dict__)
        adopted += 1
    return adopted, unmatched


def clear_dtensor_cache() -> None:
    """Drop every cached sharding propagation (C++ and Python), where this torch has them."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    try:
        from torch.distributed.tensor import DTensor

        prop: Any = DTensor._op_dispatcher.sharding_propagator
        prop.propagate_op_sharding.cache_clear()
        prop._propagate_tensor_meta_cached.cache_clear()
    except Exception as e:  # (another torch's internals: nothing of ours is cached there)
        log.debug("the Python sharding cache was not cleared: %s", e)


def prepare_spare(
    env: WorkerEnv,
    modules: tuple[str, ...],
    build: Callable[[Any], Any] | None,
    *,
    device_type: str,
    link: _Interruptible | None,
) -> Warmed | None:
    """A hot spare (``env.role``; any other process returns None at once) before it waits: import
    ``modules`` (the lazy imports a first optimizer or DDP construction would pay after the
    takeover), then, for a sharded job (``env.mesh``) whose script gave ``build``,
    :func:`warm_sharded`. A data-parallel job's ``build`` is ignored here (run() reports it)."""
    if env.role != "spare":
        return None
    for name in modules:
        importlib.import_module(name)
    if build is None or env.mesh is None:
        return None
    return warm_sharded(build, MeshSpec.parse(env.mesh), device_type=device_type, link=link)


def warm_sharded(
    build: Callable[[Any], Any],
    spec: MeshSpec,
    *,
    device_type: str,
    link: _Interruptible | None,
    fake_rank: int = 0,
) -> Warmed | None:
    """Warm DTensor's cache with ``build`` in a fake world of ``spec`` (see the module docstring).

    Returns the :class:`Warmed` to adopt the real mesh with, or None: warming is an
    optimisation, so a failure (``build`` raised, this torch has no fake backend) is logged and
    nothing is left behind -- the default group is gone and the cache is cleared; so is an
    interrupt (``link``'s reconfigure). Must run where no process group exists yet."""
    from nonstop.train.meshgroups import mesh_of

    if dist.is_initialized():
        raise RuntimeError("a warm-up needs a process without a process group")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        log.info("no warm-up: this torch has no fake process group (%s)", e)
        return None
    t0 = time.monotonic()
    ok = False
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=fake_rank, world_size=spec.world_size)
        ranks = [spec.group_of(fake_rank, dim) for dim in spec.names]
        groups = [dist.new_group(r, use_local_synchronization=True) for r in ranks]
        mesh = mesh_of(spec, groups, device_type)
        try:
            if link is not None:
                link.enter_step()  # from here a reconfigure interrupts (PeerFailed)
            try:
                _one_step(build, mesh)
            finally:
                if link is not None:
                    link.in_step = False
            ok = True
        except PeerFailed:
            log.info("the warm-up was interrupted: this spare was given a rank")
        del mesh, groups
    except Exception as e:  # an optimisation: never fail the spare for it
        log.warning("the warm-up failed (a first step after a takeover will be slower): %s", e)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if not ok:
        clear_dtensor_cache()
        return None
    meshes = live_meshes()  # (no real group was ever made here: the fake ones)
    took = time.monotonic() - t0
    log.info("warmed DTensor's cache in %.2fs (%d meshes)", took, len(meshes))
    return Warmed(meshes, took_s=took)


def _one_step(build: Callable[[Any], Any], mesh: Any) -> None:
    """``build(mesh)``, a zero gradient on every parameter, one optimizer step; then drop it all."""
    from torch.distributed.tensor import DTensor

    from nonstop.train.trainee import _built  # (trainee imports this module)

    model, optimizer, objects = _built(build(mesh))  # checked as a generation's build is
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if isinstance(p, DTensor):
                local = torch.zeros_like(p.to_local())
                p.grad = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    del model, optimizer, objects
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def live_meshes() -> list[Any]:
    """Every ``DeviceMesh`` alive in the process (a scan of the garbage collector's objects:
    ~0.1 s with a model built; a spare's idle time, or a renumbered survivor's rare join)."""
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()
    # (by the class's MRO: isinstance runs DeviceMesh's metaclass hook on every object, which
    # touches deprecated torch attributes and warns)
    return [o for o in gc.get_objects() if DeviceMesh in type(o).__mro__]
