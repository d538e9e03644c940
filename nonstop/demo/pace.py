"""The demo scripts' pace: extra seconds per step, to watch or interrupt a run, and while the job
runs shrunk (a rank plays several data shards, or the job fewer than its own), so a node
rejoining a busy machine has time to come up before the run ends (the grow-back tests)."""

from __future__ import annotations

import argparse
import time
from typing import Protocol

__all__ = ["add_pace_args", "pace"]


class _Shards(Protocol):
    """What the pace reads of a session (read-only)."""

    @property
    def shards(self) -> tuple[int, ...]: ...

    @property
    def num_shards(self) -> int: ...

    @property
    def shards_played(self) -> int: ...


def add_pace_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--step-delay", type=float, default=0.0, help="extra seconds per step (to watch or interrupt a run)"
    )
    ap.add_argument(
        "--shrunk-step-delay",
        type=float,
        default=0.0,
        help="extra seconds per step while the job runs shrunk (this rank plays several data shards, "
        "or --shrink-batch drop skips some): "
        "a node rejoining a busy machine has time to come up before the run ends (tests)",
    )


def pace(args: argparse.Namespace, session: _Shards) -> None:
    """Sleep what ``args`` asks for this step (call it inside ``train_step``)."""
    if args.step_delay:
        time.sleep(args.step_delay)
    shrunk = len(session.shards) > 1 or session.shards_played < session.num_shards  # keep, drop
    if args.shrunk_step_delay and shrunk:
        time.sleep(args.shrunk_step_delay)
