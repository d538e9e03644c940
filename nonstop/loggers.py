"""Ready-made callbacks for :meth:`Session.on_event <nonstop.train.session.Session.on_event>`: the
job's failures, recoveries, resizes, migrations and persists as a logger's scalars and text.

::

    from torch.utils.tensorboard import SummaryWriter
    from nonstop.loggers import TensorBoardHook

    session = nonstop.init()
    if session.rank == 0:
        session.on_event(TensorBoardHook(SummaryWriter("runs/job1")))

* :func:`event_record` (pure) says what an event is worth logging: scalars by name, a line of
  text, and the training step to log them at (the event's own step when it has one, else the
  last step an event gave). Every adapter logs that.
* :class:`TensorBoardHook`: scalars with ``add_scalar`` (``walltime``: when the event was
  logged) and text with ``add_text`` under ``{prefix}events``.
* :class:`WandbHook`: ``run.log`` of the scalars and the text (``{prefix}event``), against a step
  metric of its own (``{prefix}step``, declared with ``define_metric``), with ``commit=False``
  by default: merged into the row the script commits next, so it never moves the script's own
  ``step`` (two events before one commit: the later's values win). ``wandb`` is imported only
  when a WandbHook is built: nonstop does not depend on it.

Scalars (``prefix`` ``nonstop/``): ``failures`` (count so far), ``mttr_s``, ``detect_s``,
``lost_steps``, ``recovery/<stage>_s``, ``world_size``, ``generation``, ``committed_step``,
``persist/seconds``, ``persist/stored_bytes``, ``migration/pause_ratio``, ``migrations``,
``nodes_lost`` (count so far). Text: a line per failure, recovery, resize, migration, node loss,
persist failure and the job's failure.

Threading: an adapter is called by one thread at a time (the session's delivery thread, or the
loop between steps); TensorBoard's ``SummaryWriter`` is thread-safe, W&B's ``run.log`` is called
from that thread.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nonstop import events as ev
from nonstop.errors import UsageError
from nonstop.events.hook import Committed

__all__ = ["EventRecord", "EventTally", "TensorBoardHook", "WandbHook", "event_record"]


@dataclass(frozen=True)
class EventRecord:
    """What one event is worth logging: ``scalars`` (name without prefix -> value) and ``text``
    at training step ``step`` (None: the event gives none and no earlier one did)."""

    step: int | None
    scalars: Mapping[str, float] = field(default_factory=dict)
    text: str | None = None


@dataclass
class EventTally:
    """What the records need to remember: the last step seen, counts so far."""

    step: int | None = None
    failures: int = 0
    migrations: int = 0
    nodes_lost: int = 0


def _s(x: float | None) -> str:
    return "?" if x is None else f"{x:.3f}s"


def event_record(e: ev.Event, tally: EventTally) -> EventRecord | None:
    """The record of ``e`` (None: not worth logging), updating ``tally``. Pure but for ``tally``."""
    scalars: dict[str, float] = {}
    text: str | None = None
    step: int | None = None
    if isinstance(e, Committed):
        step, scalars = e.step, {"committed_step": e.step, "world_size": e.world_size}
    elif isinstance(e, ev.Failure):
        tally.failures += 1
        step, scalars = e.step, {"failures": tally.failures}
        text = f"failure: {e.failure_kind} of rank {e.rank} at step {e.step}" + (
            f" ({e.detail})" if e.detail and e.detail != e.failure_kind else ""
        )
    elif isinstance(e, ev.Recovery):
        step = e.restore_step if e.restore_step is not None else e.step
        if e.mttr_s is not None:
            scalars["mttr_s"] = e.mttr_s
        if e.detect_s is not None:
            scalars["detect_s"] = e.detect_s
        if e.lost_steps is not None:
            scalars["lost_steps"] = e.lost_steps
        scalars.update({f"recovery/{k}_s": v for k, v in e.stages.items()})
        stages = ", ".join(f"{k} {_s(v)}" for k, v in e.stages.items())
        text = (
            f"recovery: {e.failure_kind} of rank {e.rank} recovered in {_s(e.mttr_s)} from step "
            f"{e.restore_step} ({e.lost_steps} step(s) redone; {e.replacement or 'no replacement'}): {stages}"
        )
    elif isinstance(e, ev.NewGeneration):
        step = e.restore_step
        scalars = {"world_size": len(e.members)}
        if e.generation is not None:
            scalars["generation"] = e.generation
    elif isinstance(e, ev.Shrink | ev.Grow):
        step = e.boundary if isinstance(e, ev.Grow) else None
        if e.world_size is not None:
            scalars["world_size"] = e.world_size
        text = f"{e.kind}: {e.old_world_size} -> {e.world_size} ranks" + (
            f" ({e.reason})" if isinstance(e, ev.Shrink) and e.reason else ""
        )
    elif isinstance(e, ev.MigrationDone):
        tally.migrations += 1
        step = e.boundary
        scalars = {"migrations": tally.migrations}
        if e.pause_ratio is not None:
            scalars["migration/pause_ratio"] = e.pause_ratio
        text = f"migration: rank {e.rank} moved {e.source} -> {e.target} at step {e.boundary} ({e.reason})"
    elif isinstance(e, ev.MigrationAborted | ev.GrowAborted):
        text = f"{e.kind}: {e.error}"
    elif isinstance(e, ev.NodeLost):
        tally.nodes_lost += 1
        scalars = {"nodes_lost": tally.nodes_lost}
        text = f"node lost: {e.node} ({e.reason})"
    elif isinstance(e, ev.Persist):
        step = e.step
        if e.seconds is not None:
            scalars["persist/seconds"] = e.seconds
        if e.stored_bytes is not None:
            scalars["persist/stored_bytes"] = e.stored_bytes
    elif isinstance(e, ev.PersistFailed | ev.JobFailed):
        text = f"{e.kind}: {e.error}"
    else:
        return None
    if step is not None:
        tally.step = step
    return EventRecord(step=tally.step, scalars=scalars, text=text)


class _Writer(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` the hook uses."""

    def add_scalar(
        self, tag: str, scalar_value: float, global_step: int | None = ..., walltime: float | None = ...
    ) -> None: ...

    def add_text(
        self, tag: str, text_string: str, global_step: int | None = ..., walltime: float | None = ...
    ) -> None: ...


class TensorBoardHook:
    """An :meth:`~nonstop.train.session.Session.on_event` callback that writes events to a
    TensorBoard ``SummaryWriter`` (see the module docstring). ``flush``: flush the writer after
    each event that wrote something (recoveries are rare; a reader sees them at once)."""

    def __init__(self, writer: _Writer, *, prefix: str = "nonstop/", flush: bool = True) -> None:
        self.writer = writer
        self.prefix = prefix
        self.flush = flush
        self.tally = EventTally()

    def __call__(self, event: ev.Event) -> None:
        rec = event_record(event, self.tally)
        if rec is None:
            return
        step = rec.step if rec.step is not None else 0
        for name, value in rec.scalars.items():
            self.writer.add_scalar(self.prefix + name, value, global_step=step, walltime=event.ts)
        if rec.text is not None:
            self.writer.add_text(self.prefix + "events", rec.text, global_step=step, walltime=event.ts)
        flush = getattr(self.writer, "flush", None)
        if self.flush and callable(flush):
            flush()


class WandbHook:
    """An :meth:`~nonstop.train.session.Session.on_event` callback that logs events to a Weights &
    Biases run (``run``: default ``wandb.run``, so call ``wandb.init`` first). Imports ``wandb``
    here: a :class:`UsageError` when it is not installed or no run is active."""

    def __init__(self, run: Any = None, *, prefix: str = "nonstop/", commit: bool = False) -> None:
        if run is None:
            try:
                wandb = importlib.import_module("wandb")
            except ImportError as e:
                raise UsageError("WandbHook needs the wandb package: pip install wandb") from e
            run = wandb.run
            if run is None:
                raise UsageError("WandbHook: no active W&B run; call wandb.init() first or pass run=")
        self.run = run
        self.prefix = prefix
        self.commit = commit
        self.tally = EventTally()
        run.define_metric(f"{prefix}step")
        run.define_metric(f"{prefix}*", step_metric=f"{prefix}step")

    def __call__(self, event: ev.Event) -> None:
        rec = event_record(event, self.tally)
        if rec is None:
            return
        data: dict[str, Any] = {self.prefix + k: v for k, v in rec.scalars.items()}
        if rec.text is not None:
            data[self.prefix + "event"] = rec.text
        data[self.prefix + "step"] = rec.step if rec.step is not None else 0
        self.run.log(data, commit=self.commit)
