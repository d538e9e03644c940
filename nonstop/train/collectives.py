"""Whether the training thread is inside a collective, seen from another thread.

The heartbeat thread reports it (``coll``) so the coordinator's no-progress rule blames only the
rank the others wait for: a rank blocked in a collective is waiting on a peer, not stuck itself.
DDP's gradient allreduce is known exactly (:class:`~nonstop.train.ddp.CanonicalGradSync` stamps
it). Sharded models (FSDP2's all-gathers and reduce-scatters, tensor parallel's redistributions)
issue their collectives from ``torch.distributed``'s own Python code and block there (``wait()``
on the work, ``wait_tensor``) -- so the innermost Python frame of a thread blocked in one lies in
``torch/distributed/``. :func:`in_collective` looks at exactly that frame: cheap (one dict lookup
per heartbeat), no hook in the collectives' path, and it covers any library that communicates
through ``torch.distributed``. A thread merely computing inside DTensor's dispatch counts too for
as long as it is there, which a compute step never is for seconds.
"""

from __future__ import annotations

import os
import sys

import torch.distributed

__all__ = ["in_collective"]

_DIST_DIR = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep


def in_collective(thread_id: int | None) -> bool:
    """True when thread ``thread_id`` is executing ``torch.distributed`` code now (its innermost
    Python frame is there: issuing or waiting for a collective)."""
    if thread_id is None:
        return False
    frame = sys._current_frames().get(thread_id)
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_DIST_DIR)
