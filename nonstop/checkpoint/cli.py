"""``nonstop export URL --format safetensors|dcp|torch --out PATH [--step S] [--what ...]``:
the subcommand's flags (:func:`add_export_parser`) and its run (:func:`run_export`).

Bad input -- an unknown format, a location with no usable checkpoint, a ``--step`` that does
not exist or is corrupt -- fails with one line on stderr and exit status 2 (a UsageError, which
``nonstop``'s main prints)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.checkpoint.export import FORMATS, WHATS, export_checkpoint
from nonstop.errors import SnapshotError, UsageError

__all__ = ["add_export_parser", "run_export"]


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` to ``nonstop``'s subcommands."""
    p = sub.add_parser(
        "export",
        help="write a durable checkpoint as safetensors, a torch.distributed.checkpoint directory or "
        "a torch.save file",
    )
    p.add_argument("url", help="the job's durable tier: a directory or fsspec URL (what --persist names)")
    # checked by run_export, not argparse's choices: a bad value fails in one line, without usage
    p.add_argument("--format", dest="fmt", required=True, metavar="|".join(FORMATS))
    p.add_argument("--out", type=Path, required=True, help="the file to write (a directory for dcp)")
    p.add_argument("--step", type=int, default=None, help="the step to export (default: the newest good one)")
    p.add_argument(
        "--what",
        default="model",
        metavar="|".join(WHATS),
        help="the model's state_dict (default), the optimizer's, or all (step, model, optimizer, "
        "each rank's extras; dcp and torch only)",
    )


def run_export(ns: argparse.Namespace) -> int:
    """Run ``nonstop export``; 0 on success. UsageError (exit 2) for bad input."""
    try:
        res = export_checkpoint(ns.url, ns.out, fmt=ns.fmt, what=ns.what, step=ns.step)
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    kind = "gathered from shards" if res.sharded else "data-parallel, once"
    print(
        f"nonstop: exported {ns.what} of step {res.step} ({res.world_size} ranks, {kind}): "
        f"{res.tensors} tensors, {res.bytes / 1e6:.1f} MB, to {res.path} as {ns.fmt}"
    )
    return 0
