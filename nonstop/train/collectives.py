"""Whether the training thread is inside a collective, seen from another thread.

The heartbeat thread reports it (``coll``) so the coordinator's no-progress rule blames only the
rank the others wait for: a rank blocked in a collective is waiting on a peer, not stuck itself.
DDP's gradient allreduce is known exactly (:class:`~nonstop.train.ddp.CanonicalGradSync` stamps it;
so does a framework's DDP wrapper given nonstop's sync: ``foreign_allreduce_pending``). Sharded
models (FSDP2's all-gathers and reduce-scatters, tensor parallel's redistributions) issue their
collectives from ``torch.distributed``'s own Python code and block there (``wait()`` on the work,
``wait_tensor``) -- so the innermost Python frame of a thread blocked in one lies in
``torch/distributed/``. :func:`in_collective` looks at exactly that frame: cheap (one dict lookup
per heartbeat), no hook in the collectives' path, and it covers any library that communicates
through ``torch.distributed``. A thread merely computing inside DTensor's dispatch counts too for
as long as it is there, which a compute step never is for seconds. DDP's own module
(``torch/nn/parallel/distributed.py``) counts too: its forward runs collectives of its own from
there -- the broadcast of the rebuilt bucket order in a fresh wrapper's second iteration, buffer
broadcasts -- while the model's own forward runs in the model's frames.

On a device (NCCL) a collective returns at enqueue, so neither the stamp nor the frame test sees a
rank waiting in it: the canonical sync then also answers from device events recorded around its
allreduce (:mod:`nonstop.train.liveness`). Sharded models' NCCL collectives wait on the device,
after ``torch.distributed`` has returned: the heartbeat reads those from torch's flight recorder
(:mod:`nonstop.train.frwatch`).
"""

from __future__ import annotations

import os
import sys

import torch.distributed
import torch.nn.parallel.distributed

from nonstop.train.ddp import foreign_allreduce_pending

__all__ = ["in_collective"]

_DIST_DIR = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep
_DDP_FILE = os.path.abspath(torch.nn.parallel.distributed.__file__)


def in_collective(thread_id: int | None) -> bool:
    """True when thread ``thread_id`` is executing ``torch.distributed`` code now (its innermost
    Python frame is there: issuing or waiting for a collective)."""
    if thread_id is None:
        return False
    if foreign_allreduce_pending():  # a framework's DDP with nonstop's canonical sync (ddp.py)
        return True
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return False
    path = os.path.abspath(frame.f_code.co_filename)
    return path.startswith(_DIST_DIR) or path == _DDP_FILE
