"""nonstop: keep PyTorch training running through failures, preemptions and maintenance.

The worker-side API is :func:`init` and :class:`Session` (see
:mod:`nonstop.train.session`); the launcher is the ``nonstop`` command.
"""

from nonstop.errors import NonstopError, UsageError
from nonstop.train.session import RunResult, Session, init

__all__ = ["NonstopError", "RunResult", "Session", "UsageError", "init"]
__version__ = "0.1.0"
