"""Hugging Face Accelerate in a nonstop job: an :class:`Accelerator` for one generation.

Accelerate owns the loop and wraps the model; nonstop owns the processes, the process group and
recovery. The script trains through ``Session.steps(..., wrap=False)`` and makes a new
:class:`Accelerator` -- and prepares the *same* raw model and optimizer again -- on the first
step of every generation (its start, every recovery, every resize)::

    import nonstop
    from nonstop.integrations.accelerate import Accelerator

    session = nonstop.init()
    model = Net(); optimizer = torch.optim.AdamW(model.parameters())
    for step in session.steps(num_steps, model=model, optimizer=optimizer, wrap=False):
        with step:
            if step.new_generation:            # the process group is new: wrap again
                accelerator = Accelerator()
                ddp_model, ddp_opt = accelerator.prepare(model, optimizer)
            loss = loss_fn(ddp_model(x), y)
            accelerator.backward(loss)
            ddp_opt.step(); ddp_opt.zero_grad()

Why each piece (Accelerate 1.x):

* nonstop creates the default process group (gloo, on its own rendezvous store) each generation
  and destroys it on recovery. Accelerate would create one itself (``init_process_group`` from
  ``env://``) if none existed, and ``MASTER_ADDR``/``MASTER_PORT`` name nonstop's coordinator,
  not a ``TCPStore``: so an :class:`Accelerator` may only be made while the group exists --
  inside ``with step:``; made elsewhere it raises :class:`~nonstop.errors.UsageError`.
* Accelerate keeps process-wide singletons (``PartialState``, ``AcceleratorState``,
  ``GradientState``) that cache the rank, the world size and the device from the first
  construction; a new generation may renumber the rank or change the world size, so every
  construction here resets them first. A previous generation's accelerator, model wrapper and
  optimizer wrapper hold the destroyed group: drop them.
* ``prepare`` wraps the raw model in ``DistributedDataParallel`` and the raw optimizer in an
  ``AcceleratedOptimizer`` that steps it; neither marks the raw objects, so preparing them again
  is what Accelerate does for a first preparation. nonstop snapshots and restores the raw ones
  (those given to ``session.steps``), in place.
* Bitwise recovery: gloo's ring allreduce adds the ranks' values in an order that depends on an
  element's offset in the bucket, and a fresh DDP wrapper's buckets differ from a long-lived one's
  (with 3 ranks or more the sums differ in the last bits). With ``deterministic=True`` (the
  default) DDP is built with one bucket and nonstop's canonical-order gradient allreduce
  (:func:`~nonstop.train.ddp.register_canonical_hook`), as ``Session.run`` does: a recovered run's
  weights are bitwise those of an uninterrupted run. It excludes a ``comm_hook`` of the script's
  ``DistributedDataParallelKwargs`` and a ``bucket_cap_mb`` below the gradients' size.
* On a machine without CUDA ``cpu`` defaults to True (nonstop's group is gloo): Accelerate then
  runs its ``MULTI_CPU`` mode, which reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE`` (nonstop sets them each generation, :mod:`nonstop.coordinator.torch_env`).

Limits: a data loader prepared by Accelerate starts its epoch again when prepared again; derive
the batch from the step (and ``accelerator.process_index``) or iterate a
``nonstop.Batches`` over a ``StatefulDataLoader`` given in ``state=``. An elastic job
(``--min-world-size``) that shrinks divides the gradient sum by the smaller world size: the
framework path is not bitwise across a resize. Data-parallel only (Accelerate's FSDP, DeepSpeed
and tensor parallel are not hosted). Mixed precision re-wraps the raw model's ``forward`` at every
preparation (harmless, untested).
"""

from __future__ import annotations

from typing import Any

import accelerate  # type: ignore[import-untyped]
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState  # type: ignore[import-untyped]
from accelerate.utils import DistributedDataParallelKwargs  # type: ignore[import-untyped]
from torch.nn.parallel import DistributedDataParallel

from nonstop.errors import UsageError
from nonstop.train.ddp import register_canonical_hook

__all__ = ["Accelerator"]

_ONE_BUCKET_MB = 1 << 20  # every gradient in one bucket (a cap of 1 TiB)


class Accelerator(accelerate.Accelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` for one generation of a nonstop job (see the module docstring).

    Takes Accelerate's arguments, plus ``deterministic`` (default True: DDP with one bucket and
    nonstop's canonical-order gradient allreduce, so recovered runs are bitwise equal to
    uninterrupted ones). Make one on every ``step.new_generation``, inside ``with step:``, and
    prepare the raw model and optimizer with it again."""

    def __init__(self, *args: Any, deterministic: bool = True, **kwargs: Any) -> None:
        if not dist.is_initialized():
            raise UsageError(
                "make the Accelerator inside `with step:` of session.steps(..., wrap=False), on "
                "step.new_generation: nonstop creates the process group there (Accelerate must not)"
            )
        # The singletons cache the previous generation's rank, world size and device.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        kwargs.setdefault("cpu", not torch.cuda.is_available())
        self._nonstop_deterministic = deterministic
        if deterministic:
            handlers = list(kwargs.get("kwargs_handlers") or [])
            ddp_kwargs = [h for h in handlers if isinstance(h, DistributedDataParallelKwargs)]
            if not ddp_kwargs:
                handlers.append(DistributedDataParallelKwargs(bucket_cap_mb=_ONE_BUCKET_MB))
            elif ddp_kwargs[0].comm_hook.value != "no":
                raise UsageError(
                    "a DDP comm_hook replaces nonstop's deterministic gradient sync: give "
                    "Accelerator(deterministic=False) to use it (recovered runs are then not bitwise)"
                )
            kwargs["kwargs_handlers"] = handlers
        super().__init__(*args, **kwargs)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        """Accelerate's, and then nonstop's canonical gradient sync on the DDP wrapper it made."""
        out: torch.nn.Module = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        if self._nonstop_deterministic and isinstance(out, DistributedDataParallel):
            try:
                register_canonical_hook(out)
            except ValueError as e:
                raise UsageError(f"{e}: DistributedDataParallelKwargs(bucket_cap_mb=...)") from None
        return out
