"""nonstop: keep PyTorch training running through failures, preemptions and maintenance.

The worker-side API is :func:`init` and :class:`Session` (see
:mod:`nonstop.train.session`); the launcher is the ``nonstop`` command.
"""

from nonstop.checkpoint import Checkpoint, load_checkpoint
from nonstop.errors import NonstopError, UsageError
from nonstop.train.session import RunResult, Session, init
from nonstop.train.steps import Batches, Step

__all__ = ["Batches", "NonstopError", "RunResult", "Session", "Step", "UsageError", "init"]
__all__ += ["Checkpoint", "load_checkpoint"]  # reading durable checkpoints back (nonstop.checkpoint)
__version__ = "0.1.0"
