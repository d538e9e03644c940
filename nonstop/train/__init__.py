"""The worker-side training API: :func:`init`, :class:`Session`, deterministic DDP."""

from nonstop.train.ddp import CanonicalGradSync, wrap_ddp
from nonstop.train.session import RunResult, Session, init

__all__ = ["CanonicalGradSync", "RunResult", "Session", "init", "wrap_ddp"]
