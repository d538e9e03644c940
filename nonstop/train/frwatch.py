"""Whether a rank waits in *any* collective on a device, read from torch's flight recorder.

**Why.** On NCCL a collective returns at enqueue and the rank waits for it later, on the device
(:mod:`nonstop.train.liveness`, "Why"). nonstop's own DDP allreduce is watched with device events
it records itself; the collectives FSDP2 and tensor parallel issue (all-gathers, reduce-scatters,
DTensor redistributions) are issued inside ``torch.distributed`` and have no hook for them. Without
this module a sharded job's healthy ranks, all waiting on the device for a peer that stopped, would
look stuck to the coordinator's no-progress rule and be killed with it.

**How.** torch's flight recorder (``TORCH_FR_BUFFER_SIZE`` > 0) keeps a ring of every collective
each process group issued, whatever library issued it, and NCCL's watchdog updates each entry from
the work's CUDA events: ``scheduled`` (enqueued), ``started`` (its kernel runs: the rank's own work
that feeds it is done) and ``completed``. ``started`` needs a start event, which NCCL records only
with ``TORCH_NCCL_ENABLE_TIMING=1``; :mod:`nonstop.devices.nccl` sets both on a CUDA node. The
heartbeat thread asks for the active entries (``onlyActive``: not completed) and the rank is in a
collective while one of them has started: exactly the ``ready`` and not ``done`` of
:class:`~nonstop.train.liveness.CollectiveWatch`, for every collective. A rank stuck in its own
kernels has only ``scheduled`` entries, and one stuck on the host issues none: both are still
blamed.

**Cost.** A dump holds the GIL while torch serialises every entry not seen completed, and gloo's
never are (a CUDA node's composite group sends nonstop's CPU collectives there): measured here, 2,000
such entries are a 0.9 MB dump, 30 ms to make and 10 ms to parse. So the watch dumps only when the
answer can matter -- once the rank has gone :data:`MIN_IDLE_S`, and as long as its last step,
without completing one. The detector blames no rank sooner than ``max(hang_min_s, hang_factor x
the median step)`` (``hang_factor`` > 1, ``hang_min_s`` 3 s by default); a healthy step pays at
most for the heartbeats of a tail that outlasts the step before it.

**Limits.** The dump is torch's (``torch._C._distributed_c10d._dump_fr_trace_json``, not public
API): if it moves or fails, :meth:`FlightRecorderWatch.pending` answers False (logged once) and the
collective timeout (:mod:`nonstop.train.backend`) stays the backstop, as before. gloo records
entries too but never moves them past ``scheduled`` (measured, torch 2.13): on the CPU the frame
test of :mod:`nonstop.train.collectives` answers instead, and no watch is made
(:func:`flight_recorder_watch`). Not run on a GPU yet: no device was lent to the sessions that built
it; its parsing is tested on fake dumps and on the real (gloo) recorder's format.

Threading contract: :meth:`FlightRecorderWatch.pending` is called by the heartbeat thread only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["FR_BUFFER_VARS", "MIN_IDLE_S", "FlightRecorderWatch", "flight_recorder_watch", "started_entries"]

log = logging.getLogger(__name__)

# the ring's size: torch reads the first of these that is set (distributed_c10d.py, torch 2.13)
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
# no dump before the rank has gone this long (and as long as its last step) without a step;
# the detector's hang limit is at least its hang_min_s (3 s by default)
MIN_IDLE_S = 1.0

Dump = Callable[[], bytes | str]


def _dump_active() -> bytes:
    """torch's flight-recorder dump of the collectives not yet completed, as JSON."""
    import torch._C._distributed_c10d as c10d  # (private, untyped: see "Limits")

    dump: Any = getattr(c10d, "_dump_fr_trace_json")  # noqa: B009 - not in torch's stubs
    raw = dump(includeCollectives=True, onlyActive=True)
    return raw if isinstance(raw, bytes) else str(raw).encode()  # bytes in torch 2.13; text taken too


def started_entries(dump: bytes | str) -> int:
    """How many entries of a flight-recorder JSON dump have started and not completed. A dump
    that is not the expected shape is a :class:`ValueError` (the caller decides what it means)."""
    doc = json.loads(dump)
    entries: Any = doc.get("entries", []) if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"flight-recorder dump without an entry list: {str(dump)[:80]!r}")
    n = 0
    for e in entries:
        if not isinstance(e, dict):
            raise ValueError(f"flight-recorder entry is not an object: {str(e)[:80]!r}")
        if e.get("retired") is True or e.get("time_discovered_completed_ns"):
            continue  # finished, whatever its state says (gloo's stay "scheduled" when retired)
        if e.get("state") == "started":
            n += 1
    return n


class FlightRecorderWatch:
    """Answers "is the rank waiting in a collective on the device?" from the flight recorder
    (module docstring). ``dump``: the dump function (tests pass fakes)."""

    def __init__(self, dump: Dump = _dump_active) -> None:
        self._dump = dump
        self._warned = False

    def pending(self, *, idle_s: float, step_s: float | None) -> bool:
        """True while a collective has started on the device and not completed. False when none
        has, and when the recorder cannot answer (logged once: a broken dump is no reason to
        protect a rank). ``idle_s``: seconds since the rank's last completed step; ``step_s``: how
        long that step took (None before the first). Below ``max(MIN_IDLE_S, step_s)`` the
        answer is False without a dump (see "Cost")."""
        if idle_s < max(MIN_IDLE_S, step_s or 0.0):
            return False
        try:
            return started_entries(self._dump()) > 0
        except Exception as e:  # never stop the heartbeat thread
            if not self._warned:
                self._warned = True
                log.warning(
                    "collective liveness: the flight recorder's dump failed (%s); not in a collective", e
                )
            return False


def flight_recorder_watch(
    device_type: str, env: Mapping[str, str] = os.environ
) -> FlightRecorderWatch | None:
    """The watch for a rank on ``device_type``: one on a CUDA device whose flight recorder is on
    (a ring size above 0 in ``env``), None otherwise (the CPU, or a user who turned it off)."""
    if device_type != "cuda":
        return None
    for name in FR_BUFFER_VARS:
        if name in env:
            try:
                return FlightRecorderWatch() if int(env[name]) > 0 else None
            except ValueError:
                return None
    return None
