"""The memory tier's config (:class:`SnapshotConfig`, ``config.snapshot``: what the workers'
snapshots, the cadence tuner and the rescues read) and the durable tier's
(:class:`PersistConfig`, ``config.persist``: what the persister, persist rounds and a resume read).
Each validates its own fields at construction: a bad value is one line naming its flag."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from nonstop.config.enums import SnapshotCopies, SnapshotMode, set_members
from nonstop.errors import UsageError
from nonstop.policy.cadence import DEFAULT_BUDGET, MAX_AGE_S

__all__ = ["PersistConfig", "SnapshotConfig"]


@dataclass(frozen=True, kw_only=True)
class SnapshotConfig:
    """The in-memory snapshots (``--snapshot*``, ``--rescue-wait``, ``--shm-dir``).

    ``mode``: how each step's state is captured (``--snapshot``). ``every``: steps between
    snapshots (1: every step); K > 1 trades the snapshot's cost per step (1/K of it) for up to
    K - 1 steps redone after a failure; swaps' boundaries and the last step are always
    snapshotted (``nonstop simulate --snapshot-every`` and its advisor weigh it). ``budget`` > 0:
    the fraction of the training time the snapshots' stall may cost; the coordinator measures it
    and snapshots every K-th step, K >= ``every`` the smallest within it (policy/cadence.py);
    failures are rescued meanwhile; 0: every ``every``-th step. ``max_age_s``: with a budget, the
    widest interval's steps take at most this long, so the committed step (what persists, peer
    replicas and a failure no rescue saves go back to) is never older. ``rescue_wait_s``: K > 1
    (or a budget): how long a recovery's plan waits for the survivors' rescue reports (the state
    after their last completed step, policy/rescue.py); 0: no rescues. ``copies``: where the
    state a node's ranks hold alike (a DDP job's, an HSDP job's replica groups') lives in its
    memory tier (snapshot/nodecopy.py). ``shm_dir``: this node's snapshot memory (None:
    /dev/shm)."""

    mode: SnapshotMode = SnapshotMode.OVERLAPPED
    every: int = 1
    budget: float = DEFAULT_BUDGET
    max_age_s: float = MAX_AGE_S
    rescue_wait_s: float = 2.0
    copies: SnapshotCopies = SnapshotCopies.NODE
    shm_dir: Path | None = None

    def __post_init__(self) -> None:
        set_members(
            self, (("mode", SnapshotMode, "--snapshot"), ("copies", SnapshotCopies, "--snapshot-copies"))
        )
        if self.every < 1:
            raise UsageError(f"--snapshot-every must be >= 1 step (got {self.every}); 1 snapshots every step")
        if not 0.0 <= self.budget < 1.0:
            raise UsageError(
                f"--snapshot-budget must be a fraction in [0, 1) of the training time, e.g. 0.002 "
                f"(got {self.budget}); 0 keeps --snapshot-every fixed"
            )
        if not (math.isfinite(self.max_age_s) and self.max_age_s > 0):
            raise UsageError(
                f"--snapshot-max-age must be > 0 seconds (got {self.max_age_s}), e.g. 300: "
                f"with --snapshot-budget the interval's steps never take longer"
            )
        if not 0.0 <= self.rescue_wait_s <= 60.0:
            raise UsageError(f"--rescue-wait must be between 0 and 60 seconds (got {self.rescue_wait_s})")
        if self.shm_dir is not None and not (self.shm_dir.is_dir() and os.access(self.shm_dir, os.W_OK)):
            raise UsageError(f"--shm-dir {str(self.shm_dir)!r} is not a writable directory")


@dataclass(frozen=True, kw_only=True)
class PersistConfig:
    """The durable tier (``--persist*``, ``--keep``, ``--lossy*``, ``--resume``).

    ``url``: where checkpoints go (None: ``<job_dir>/checkpoints``, see
    :attr:`JobConfig.checkpoint_url`). ``every``: steps between lazy persists (0: only on demand,
    SIGTERM and exit). ``keep``: checkpoints retained. ``lossy``/``lossy_bits``: quantised delta
    checkpoints. ``timeout_s``: how long a persist round may take. ``resume``: a durable URL to
    restart the whole job from (None: a fresh start)."""

    url: str | None = None
    every: int = 100
    keep: int = 3
    lossy: bool = False
    lossy_bits: int = 8
    timeout_s: float = 120.0
    resume: str | None = None

    def __post_init__(self) -> None:
        if self.every < 0:
            raise UsageError(f"--persist-every must be >= 0 (got {self.every}); 0 persists only on demand")
        if self.lossy_bits not in (4, 8):
            raise UsageError(f"--lossy-bits must be 4 or 8 (got {self.lossy_bits})")
        if self.keep < 1:
            raise UsageError(f"--keep must be >= 1 (got {self.keep})")
