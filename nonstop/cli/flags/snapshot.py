"""The snapshot and durable-tier flags of ``nonstop run`` (``--snapshot``, ``--snapshot-every``,
``--persist``, ``--shm-dir``, ...): :func:`snapshot_args` adds them to a parser and
:func:`snapshot_config` reads them back as the job config's values."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.config import SNAPSHOT_COPIES, SNAPSHOT_MODES, JobConfig

__all__ = ["snapshot_args", "snapshot_config"]


def snapshot_args(p: argparse.ArgumentParser) -> None:
    c = JobConfig(script="")
    p.add_argument(
        "--snapshot",
        choices=SNAPSHOT_MODES,
        default=c.snapshot,
        help="per-step capture: overlapped with the next step, sync, or off (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=c.snapshot_every,
        metavar="K",
        help="snapshot every K steps: 1/K of the per-step snapshot cost, up to K-1 steps redone after "
        "a failure (`nonstop advise` weighs it; default %(default)s)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=c.snapshot_budget,
        metavar="FRACTION",
        help="tune the interval to a stall budget: the coordinator measures each snapshot's stall "
        "and the step time and snapshots every K-th step (K >= --snapshot-every, at most 128), the "
        "smallest K whose stall costs at most FRACTION of the training time, e.g. 0.002; failures "
        "between snapshots are rescued; it widens only where a rescue can replace a lost rank (ranks "
        "alike, two model copies or more) (0: keep --snapshot-every, every step unless it is set; "
        "default %(default)s)",
    )
    p.add_argument(
        "--snapshot-max-age",
        type=float,
        default=c.snapshot_max_age_s,
        metavar="SECONDS",
        help="with --snapshot-budget: the interval's steps take at most this long, so the newest "
        "step every rank snapshotted (what persists and peer replicas follow) is never older "
        "(default %(default)s)",
    )
    p.add_argument(
        "--rescue-wait",
        type=float,
        default=c.rescue_wait_s,
        metavar="SECONDS",
        help="with --snapshot-every > 1 or a --snapshot-budget, how long a recovery waits for the "
        "survivors to write the state after their last completed step (redoing only the step in "
        "flight); 0: roll back to the last snapshot (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-copies",
        choices=SNAPSHOT_COPIES,
        default=c.snapshot_copies,
        help="a data-parallel job's parameters and optimizer state, alike on every rank, are kept once "
        "per node (node: one rank copies them each step, the others only their own RNG, buffers "
        "and data position) or once per rank (default %(default)s)",
    )
    p.add_argument(
        "--persist",
        default=None,
        metavar="URL",
        help="durable tier: directory or fsspec URL (default JOB_DIR/checkpoints)",
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=c.persist_every,
        help="persist the committed step every N steps, lazily; 0: only on demand, SIGTERM and exit "
        "(default %(default)s)",
    )
    p.add_argument(
        "--keep", type=int, default=c.keep, help="durable checkpoints to retain (default %(default)s)"
    )
    p.add_argument(
        "--lossy", action="store_true", help="quantise delta checkpoints (optimizer moments, weight deltas)"
    )
    p.add_argument("--lossy-bits", type=int, default=c.lossy_bits, help="4 or 8 (default %(default)s)")
    p.add_argument(
        "--shm-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where this node keeps its snapshot memory: a memory filesystem with room for every "
        "slot (default /dev/shm)",
    )


def snapshot_config(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "snapshot": ns.snapshot,
        "snapshot_every": ns.snapshot_every,
        "snapshot_budget": ns.snapshot_budget,
        "snapshot_max_age_s": ns.snapshot_max_age,
        "rescue_wait_s": ns.rescue_wait,
        "snapshot_copies": ns.snapshot_copies,
        "persist_url": ns.persist,
        "persist_every": ns.persist_every,
        "keep": ns.keep,
        "lossy": ns.lossy,
        "lossy_bits": ns.lossy_bits,
        "shm_dir": ns.shm_dir,
    }
