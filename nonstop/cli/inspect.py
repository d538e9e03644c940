"""``nonstop inspect URL``: list the checkpoints at a durable URL and verify them."""

from __future__ import annotations

import argparse
import json

from nonstop.progress import add_progress_args

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``inspect`` to ``nonstop``'s subcommands."""
    inspect = sub.add_parser("inspect", help="list the checkpoints at a durable URL and verify them")
    inspect.add_argument("url", help="a directory or fsspec URL (e.g. .nonstop/job/checkpoints)")
    inspect.add_argument("--no-verify", action="store_true", help="skip reading every chunk")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_args(inspect)


def run(ns: argparse.Namespace) -> int:
    """Print the report (for a person or as JSON); 0."""
    from nonstop.progress import inspect_report, wanted
    from nonstop.snapshot.durable import format_inspect

    report = inspect_report(ns.url, verify=not ns.no_verify, show=wanted(ns.progress, json_output=ns.json))
    print(json.dumps(report, indent=2) if ns.json else format_inspect(report))
    return 0
