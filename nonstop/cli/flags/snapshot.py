"""The snapshot and durable-tier flags of ``nonstop run`` (``--snapshot``, ``--snapshot-every``,
``--persist``, ``--shm-dir``, ``--resume``, ...) and the config parts they fill:
:func:`snapshot_args` (and :func:`resume_arg`) add them to a parser, with the parts' defaults;
:func:`snapshot_config` reads the memory tier's back as a
:class:`~nonstop.config.SnapshotConfig`, :func:`persist_config` the durable tier's as a
:class:`~nonstop.config.PersistConfig` (each validated: a bad value is one line)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.config import SNAPSHOT_COPIES, SNAPSHOT_MODES, PersistConfig, SnapshotConfig

__all__ = ["persist_config", "resume_arg", "snapshot_args", "snapshot_config"]


def snapshot_args(p: argparse.ArgumentParser) -> None:
    c, d = SnapshotConfig(), PersistConfig()
    p.add_argument(
        "--snapshot",
        choices=SNAPSHOT_MODES,
        default=c.mode,
        help="per-step capture: overlapped with the next step, sync, or off (default %(default)s)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=c.every,
        metavar="K",
        help="snapshot every K steps: 1/K of the per-step snapshot cost, up to K-1 steps redone after "
        "a failure (`nonstop advise` weighs it; default %(default)s)",
    )
    p.add_argument(
        "--snapshot-budget",
        type=float,
        default=c.budget,
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
        default=c.max_age_s,
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
        default=c.copies,
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
        default=d.every,
        help="persist the committed step every N steps, lazily; 0: only on demand, SIGTERM and exit "
        "(default %(default)s)",
    )
    p.add_argument(
        "--keep", type=int, default=d.keep, help="durable checkpoints to retain (default %(default)s)"
    )
    p.add_argument(
        "--lossy", action="store_true", help="quantise delta checkpoints (optimizer moments, weight deltas)"
    )
    p.add_argument("--lossy-bits", type=int, default=d.lossy_bits, help="4 or 8 (default %(default)s)")
    p.add_argument(
        "--shm-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where this node keeps its snapshot memory: a memory filesystem with room for every "
        "slot (default /dev/shm)",
    )


def resume_arg(p: argparse.ArgumentParser) -> None:
    """``--resume URL``: the durable tier a whole job restarts from (:func:`persist_config`)."""
    p.add_argument(
        "--resume",
        default=None,
        metavar="URL",
        help="restart the whole job from the newest good checkpoint here",
    )


def snapshot_config(ns: argparse.Namespace) -> SnapshotConfig:
    """The memory tier's part from :func:`snapshot_args`'s flags."""
    return SnapshotConfig(
        mode=ns.snapshot,
        every=ns.snapshot_every,
        budget=ns.snapshot_budget,
        max_age_s=ns.snapshot_max_age,
        rescue_wait_s=ns.rescue_wait,
        copies=ns.snapshot_copies,
        shm_dir=ns.shm_dir,
    )


def persist_config(ns: argparse.Namespace) -> PersistConfig:
    """The durable tier's part from :func:`snapshot_args`'s and :func:`resume_arg`'s flags."""
    return PersistConfig(
        url=ns.persist,
        every=ns.persist_every,
        keep=ns.keep,
        lossy=ns.lossy,
        lossy_bits=ns.lossy_bits,
        resume=ns.resume,
    )
