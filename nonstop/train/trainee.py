"""What a :class:`~nonstop.train.session.Session` trains, generation after generation.

Two kinds, one contract (:class:`Trainee`):

* :class:`Replicated` -- data-parallel replicas (``Session.run(model=, optimizer=)``): one model
  for the life of the process, restored from the snapshot *before* the generation's group is
  joined, then wrapped in DDP with the deterministic gradient sync (:mod:`nonstop.train.ddp`).
* :class:`Sharded` -- a model whose state is sharded over the job's mesh (``--mesh``;
  ``Session.run(build=)``: FSDP2, HSDP, tensor parallel). Its parameters are DTensors over the
  generation's process groups, so the model exists only once the group is joined: every
  generation, every rank -- survivors included -- calls the user's collective-free
  ``build(mesh)`` on the new mesh and restores its own snapshot into the fresh model. Survivors
  rebuild rather than rebind because FSDP2 caches its process-group objects in private state
  (``FSDPParamGroup.mesh_info``); a rebuilt module relies on public API only, and restoring the
  committed step from local memory makes it bitwise the state a rebind would have kept.

Threading contract: main thread only (the training loop's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from nonstop.control.rdzv import ChannelStore
from nonstop.errors import UsageError
from nonstop.mesh import MeshSpec
from nonstop.snapshot import StateCapture
from nonstop.train import devicegroups
from nonstop.train.ddp import CanonicalGradSync
from nonstop.train.group import GenerationGroup
from nonstop.train.prewarm import MeshHistory, Warmed
from nonstop.train.steps import check_objects

__all__ = ["Build", "Replicated", "Sharded", "Trainee", "accumulate", "average_over", "trainee_for"]

# build(mesh) -> (model, optimizer) or (model, optimizer, objects): collective-free; called on
# every rank of every generation; objects: more state= objects, built on this optimizer
Build = Callable[[Any], Any]
Fence = Callable[[], None]
Extras = Callable[[], dict[str, Any]] | None
LoadExtras = Callable[[dict[str, Any]], None] | None


class Trainee(Protocol):
    """The model side of a Session (see the module docstring)."""

    restore_in_group: bool  # True: restore after the group is joined (the model is built there)
    sync: CanonicalGradSync | None  # the deterministic DDP gradient sync, if any (heartbeats read it)

    @property
    def capture(self) -> StateCapture | None:
        """What snapshots read and restores write (None until a sharded model is built)."""
        ...

    @property
    def bare(self) -> torch.nn.Module | None:
        """The unwrapped model for a joiner's warm-up step (None: no warm-up possible)."""
        ...

    def join(
        self,
        group: GenerationGroup,
        store: ChannelStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        restored: bool,
        divisor: int,
        generation: int = 0,
    ) -> torch.nn.Module:
        """Join the generation's group; the module ``train_step`` gets this generation."""
        ...

    def close(self) -> None: ...


class Replicated:
    """Data-parallel replicas in DDP (see the module docstring)."""

    restore_in_group = False

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        extras: Extras,
        load_extras: LoadExtras,
        deterministic: bool,
        fence: Fence | None,
        objects: dict[str, Any] | None = None,
        wrap: bool = True,
    ) -> None:
        self.model = model
        self._capture = StateCapture(
            model=model, optimizer=optimizer, extras=extras, load_extras=load_extras, objects=objects
        )
        self._wrap = wrap
        self.sync = CanonicalGradSync(model) if deterministic and wrap else None
        # overlapped snapshots: the bulk copy of step k runs during step k+1 until its optimizer step
        self._hook = (
            optimizer.register_step_pre_hook(lambda *_: fence())
            if fence is not None and optimizer is not None
            else None
        )

    @property
    def capture(self) -> StateCapture:
        return self._capture

    @property
    def bare(self) -> torch.nn.Module:
        return self.model

    def join(
        self,
        group: GenerationGroup,
        store: ChannelStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        restored: bool,
        divisor: int,
        generation: int = 0,
    ) -> torch.nn.Module:
        if not self._wrap:  # the script's framework wraps the model in the default group
            group.join_plain(store, rank=rank, world_size=world_size, timeout_s=timeout_s)
            return self.model
        return group.join(
            store,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            model=self.model,
            sync=self.sync,
            restored=restored,  # after a restore every rank holds the same committed step
            divisor=divisor,
        )

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class Sharded:
    """A model built on the job's mesh every generation (see the module docstring)."""

    restore_in_group = True
    sync: CanonicalGradSync | None = None
    bare = None  # a sharded model's step is collective: no sandboxed warm-up

    def __init__(
        self,
        build: Build,
        spec: MeshSpec,
        *,
        extras: Extras,
        load_extras: LoadExtras,
        fence: Fence | None,
        device_type: str = "cpu",
        objects: dict[str, Any] | None = None,
        warmed: Warmed | None = None,
    ) -> None:
        self._build, self.spec, self.device_type = build, spec, device_type
        self._warmed = warmed  # a spare's warm-up (train/prewarm.py): its meshes take the first real one
        self._meshes = MeshHistory()  # older meshes in DTensor's cache take a renumbered rank's (prewarm.py)
        self._objects = dict(objects or {})
        self._extras, self._load_extras, self._fence = extras, load_extras, fence
        self._capture: StateCapture | None = None
        self._hook: Any = None
        self.model: torch.nn.Module | None = None

    @property
    def capture(self) -> StateCapture | None:
        return self._capture

    def join(
        self,
        group: GenerationGroup,
        store: ChannelStore,
        *,
        rank: int,
        world_size: int,
        timeout_s: float,
        restored: bool,
        divisor: int,
        generation: int = 0,
    ) -> torch.nn.Module:
        try:
            spec = self.spec.with_world(world_size)  # fewer replica groups after an elastic shrink
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.close()  # the previous generation's model and optimizer go with its groups

        def mesh() -> Any:
            return group.mesh_groups.build(
                spec,
                rank=rank,
                generation=generation,
                store=store,
                device_type=self.device_type,
                timeout=group.timeout,
            )

        device_mesh = group.join_plain(
            store,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            then=mesh,
            unbound=devicegroups.mode() == devicegroups.INDEPENDENT,  # (split: from a bound world)
        )
        warmed, self._warmed = self._warmed, None
        if warmed is not None:  # before build: fully_shard's own DTensors hit the warm cache
            warmed.adopt(device_mesh)
        self._meshes.joined(device_mesh, rank=rank)
        model, optimizer, objects = _built(self._build(device_mesh))
        clash = sorted(set(objects) & set(self._objects))
        if clash:
            raise UsageError(f"build(mesh) returned state objects named like state= ones: {clash}")
        self.model = model
        if divisor != spec.dp_size:  # shrunk, its groups playing the lost ones' batches too
            average_over(model, divisor)
        self._capture = StateCapture(
            model=model,
            optimizer=optimizer,
            extras=self._extras,
            load_extras=self._load_extras,
            objects={**self._objects, **objects},
        )
        fence = self._fence
        if fence is not None:
            self._hook = optimizer.register_step_pre_hook(lambda *_: fence())
        return model

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.model, self._capture = None, None


def trainee_for(
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    build: Build | None,
    state: Mapping[str, Any] | None,
    extras: Extras,
    load_extras: LoadExtras,
    deterministic: bool,
    wrap: bool,
    mesh: str | None,
    fence: Fence | None,
    device_type: str,
    warmed: Warmed | None,
) -> Trainee:
    """What ``Session.steps``'s arguments train, checked against the job (``mesh``: its
    ``--mesh``): a :class:`Sharded` model for ``build``, else :class:`Replicated`. A mistake is a
    :class:`~nonstop.errors.UsageError` (it fails the job). ``fence``: an overlapped snapshot's,
    held before each optimizer step; ``warmed``: a spare's warm-up, which a sharded model adopts."""
    if (model is None) == (build is None):
        raise UsageError("give model= (and optimizer=) for DDP, or build= for a --mesh job")
    if (extras is None) != (load_extras is None):
        raise UsageError("give both extras= and load_extras=, or neither")
    objects = check_objects(state)
    if build is not None:
        if mesh is None:
            raise UsageError("build=... trains a sharded model: start the job with --mesh")
        if not wrap:
            raise UsageError("wrap=False is for a data-parallel model= (a --mesh job's build wraps it)")
        return Sharded(
            build,
            MeshSpec.parse(mesh),
            extras=extras,
            load_extras=load_extras,
            fence=fence,
            objects=objects,
            device_type=device_type,  # the mesh on the rank's device (cuda on a GPU node)
            warmed=warmed,
        )
    assert model is not None
    if mesh is not None:
        raise UsageError(f"this job has --mesh {mesh}: train through build=...")
    return Replicated(
        model,
        optimizer,
        extras=extras,
        load_extras=load_extras,
        deterministic=deterministic,
        fence=fence if optimizer is not None else None,
        objects=objects,
        wrap=wrap,
    )


def _built(built: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """What ``build(mesh)`` returned, checked: ``(model, optimizer)`` or ``(model, optimizer,
    objects)`` -- ``objects`` being ``state=`` objects made on this generation's optimizer (an LR
    scheduler must be: the optimizer is new every generation)."""
    if (
        not isinstance(built, tuple)
        or len(built) not in (2, 3)
        or not isinstance(built[0], torch.nn.Module)
        or not isinstance(built[1], torch.optim.Optimizer)
    ):
        raise UsageError("build(mesh) must return (model, optimizer) or (model, optimizer, {name: object})")
    return built[0], built[1], check_objects(built[2] if len(built) == 3 else None)


def average_over(model: torch.nn.Module, dp_size: int) -> None:
    """Set FSDP2 up for a shrunk generation, whose ranks play several data shards each
    (:func:`accumulate`), maybe not all as many:

    * divide the summed gradients by ``dp_size``, the full-size job's data-parallel degree, not
      the generation's: the sum over the smaller mesh is the full job's, so the mean must be the
      full job's too (per FSDP module, the setting is not recursive; on gloo the divide factor
      needs sum reductions: FSDP's pre-multiplied sum is not a gloo op);
    * keep the parameters unsharded from the step's first forward to its last backward
      (``reshard_after_forward`` off, and ``accumulate`` keeps them after a backward that does
      not sync): a rank's collectives are then one all-gather per module and one reduce-scatter
      per module, however many micro-batches it plays, so ranks playing 1 and 2 shards of one
      shard group issue the same collectives (without it, the first waits for the second's
      second all-gather, forever)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(float(dp_size))
            m.set_reshard_after_forward(False, recurse=False)


def accumulate(model: torch.nn.Module, shards: tuple[int, ...]) -> Iterator[int]:
    """Yield ``shards`` for gradient accumulation: only the last backward synchronises gradients
    (DDP's ``no_sync``; FSDP2's ``set_requires_gradient_sync``, with its parameters kept
    unsharded until then: see :func:`average_over`), the others accumulate locally."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    for i, shard in enumerate(shards):
        last = i == len(shards) - 1
        if not last and isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield shard
        elif isinstance(model, FSDPModule) and len(shards) > 1:
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            yield shard
        else:
            yield shard
