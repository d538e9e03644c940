"""Snapshots: the captured state of one rank at one step, kept in host memory.

Concepts
--------
* A **snapshot** is the state of one rank after ``step`` optimizer steps: model,
  optimizer, RNG (torch, numpy, python), data position and user extras.
* Each rank owns ``num_slots`` **slots**: files in shared memory
  (``/dev/shm/nonstop-<job>-r<rank>-s<i>``) that outlive the worker process.
  Step ``k`` is written to slot ``k % num_slots``, so the newest
  ``num_slots - 1`` complete snapshots survive while the next is written.
* Buffers are allocated on the first write and reused; a slot grows only when
  the state grows (e.g. when Adam creates its moments on the first step).
* Nothing is pickled: tensors are raw bytes at aligned offsets, everything else
  is a JSON tree that references tensors by index (see :mod:`.flatten`).
* A slot is valid only when its header says ``COMPLETE`` with the step asked for;
  a writer killed mid-write leaves ``WRITING`` and the slot is ignored.
"""

from nonstop.snapshot.api import SlotState, SnapshotInfo, TensorEntry
from nonstop.snapshot.capture import StateCapture
from nonstop.snapshot.flatten import flatten_state, unflatten_state
from nonstop.snapshot.store import RankSnapshotStore, segment_prefix

__all__ = [
    "RankSnapshotStore",
    "SlotState",
    "SnapshotInfo",
    "StateCapture",
    "TensorEntry",
    "flatten_state",
    "segment_prefix",
    "unflatten_state",
]
