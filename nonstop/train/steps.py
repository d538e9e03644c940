"""The pieces of a training loop the user owns: :class:`Step`, the objects of ``state=``, and
:class:`Batches`.

``Session.steps`` (:mod:`nonstop.train.session`) yields one :class:`Step` per optimizer step::

    for step in session.steps(num_steps, model=model, optimizer=opt, state={"sched": sched}):
        with step:                              # a failure inside is handed to nonstop
            loss = train(step.model, step)      # step is the step's index (an int)
            step.loss = loss.item()             # optional: reported with the step

A :class:`Step` is an ``int`` (the number of optimizer steps done before it; 0-based) and a
context manager. Inside ``with step:`` a failure of another rank interrupts the body (a
:class:`~nonstop.train.link.PeerFailed`, raised where the main thread is) and a collective
error or any exception of the body is caught by the ``with``; the loop then recovers as
``Session.run`` does and the next step it yields is the committed one, maybe an earlier index.
Code after the ``with`` block in the loop body still runs for a failed step: keep the whole
step inside it. ``KeyboardInterrupt`` and ``SystemExit`` are never caught.

``state=``: named objects with ``state_dict()`` and ``load_state_dict()`` (DCP's ``Stateful``:
LR schedulers, ``torch.amp.GradScaler``, torchdata's ``StatefulDataLoader``, your own), captured
with every snapshot and restored exactly (:class:`~nonstop.snapshot.StateCapture`).
:func:`check_objects` refuses at start what cannot be captured.

Threading contract: main thread only (the training loop's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import torch

from nonstop.errors import SnapshotError, UsageError
from nonstop.snapshot.flatten import flatten_state
from nonstop.train.link import PeerFailed, uninterruptible

__all__ = ["Batches", "Stateful", "Step", "check_objects"]


@runtime_checkable
class Stateful(Protocol):
    """What ``state=`` takes: ``torch.distributed.checkpoint.stateful.Stateful``'s two methods."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Step(int):
    """One optimizer step of ``Session.steps`` (see the module docstring).

    Attributes: ``model`` (this generation's module: DDP-wrapped for a data-parallel job unless
    ``wrap=False``, the built model for a ``--mesh`` job; a new object after a recovery),
    ``generation``, ``new_generation`` (True for the first step this process runs in a
    generation: after its join, a recovery or a resize -- rebuild what wraps the model or
    iterates restored state then), ``loss`` (set it to report the step's loss)."""

    model: torch.nn.Module
    generation: int
    new_generation: bool
    loss: float | None
    _enter: Callable[[], None]
    _leave: Callable[[], None]
    _entered: bool
    _error: BaseException | None

    def __new__(
        cls,
        index: int,
        *,
        model: torch.nn.Module,
        generation: int,
        new_generation: bool,
        enter: Callable[[], None],
        leave: Callable[[], None],
    ) -> Step:
        self = super().__new__(cls, index)
        self.model, self.generation, self.new_generation = model, generation, new_generation
        self.loss = None
        self._enter, self._leave = enter, leave
        self._entered = False
        self._error = None
        return self

    def __repr__(self) -> str:
        return f"Step({int(self)}, generation={self.generation})"

    @uninterruptible
    def __enter__(self) -> Step:
        if self._entered:
            raise UsageError(f"step {int(self)}: enter `with step:` once per step")
        self._entered = True
        self._enter()
        return self

    @uninterruptible
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._leave()  # first: from here a recovery no longer interrupts this thread
        if exc is None or not isinstance(exc, (Exception, PeerFailed)):
            return False
        self._error = exc
        return True

    def outcome(self) -> BaseException | None:
        """What the body raised (None: the step completed). A step whose body never entered
        ``with step:`` is a :class:`UsageError`: without it a failure could not be recovered."""
        if not self._entered:
            raise UsageError(
                f"step {int(self)} ran outside `with step:`: write the loop body as "
                "`for step in session.steps(...):` / `    with step: ...`"
            )
        return self._error


def check_objects(objects: Mapping[str, Any] | None) -> dict[str, Any]:
    """``state=`` checked at start: str names; each object has callable ``state_dict`` and
    ``load_state_dict``, and its state dict is one a snapshot can hold (tensors, numbers,
    strings, lists, tuples, dicts). Raises a one-line :class:`UsageError` naming the object."""
    if objects is None:
        return {}
    if not isinstance(objects, Mapping):
        raise UsageError(f"state= takes a dict of name -> object, not a {type(objects).__name__}")
    out: dict[str, Any] = {}
    for name, obj in objects.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"state=: names must be non-empty strings, not {name!r}")
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise UsageError(
                f"state={{{name!r}: ...}}: a {type(obj).__name__} has no state_dict()/load_state_dict(); "
                "give objects with both (LR schedulers, GradScaler, StatefulDataLoader, nonstop.Batches)"
            )
        try:
            flatten_state(obj.state_dict())
        except SnapshotError as e:
            what = f"state={{{name!r}: ...}}"
            raise UsageError(f"{what}: its state_dict() cannot be snapshotted: {e}") from None
        out[name] = obj
    return out


class Batches:
    """An endless iterator over a loader, itself :class:`Stateful` -- put it in ``state=`` and
    call ``next(batches)`` in the step.

    Its state is the loader's (``StatefulDataLoader`` and any loader with ``state_dict()``) plus
    the epoch. A restore loads the loader's state and drops the live iterator, so the next batch
    is the one after the restored step's, as in an uninterrupted run; an iterator over a loader
    held by the script would go on where it was. At the end of an epoch a new one starts
    (``epoch`` counts them; ``on_epoch(epoch)`` is called before each iterator is made, e.g.
    ``sampler.set_epoch``). A loader without ``state_dict()`` restarts its epoch on a restore:
    give a ``torchdata.stateful_dataloader.StatefulDataLoader`` for exact data order."""

    def __init__(self, loader: Iterable[Any], *, on_epoch: Callable[[int], None] | None = None) -> None:
        self.loader = loader
        self.epoch = 0
        self._on_epoch = on_epoch
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            if self._on_epoch is not None:
                self._on_epoch(self.epoch)
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            self._it = None
            return self.__next__()

    def state_dict(self) -> dict[str, Any]:
        loader_state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        return {"epoch": self.epoch, "loader": loader_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        if state_dict["loader"] is not None:
            self.loader.load_state_dict(state_dict["loader"])  # type: ignore[attr-defined]
        self._it = None  # the next batch starts a new iterator, from the loaded state
