"""The ``nonstop`` command: ``run``, ``demo``, ``persist``, ``status``, ``migrate``, ``drain``,
``inspect``, ``timeline``, ``export``, ``gc``, ``simulate``, ``advise`` and ``chaos``.

Each subcommand lives in a module of its own with an ``add_parser(subparsers)`` that adds it and
a ``run(ns) -> int`` that runs it (``run``, ``demo``, ``status``, ...: this package;
``simulate``/``advise``, ``chaos`` and ``export`` in their own packages' ``cli`` modules); the
argument groups several share are in :mod:`nonstop.cli.flags`. :func:`main` builds the parser
from :func:`commands` and calls the chosen one's ``run``.

User errors print one line (``nonstop: error: ...``) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nonstop.cli import demo, gc, inspect, migrate, persist, run, status, timeline
from nonstop.cli.flags.logs import add_level_arg, log_level
from nonstop.errors import JobFailedError, NonstopError, UsageError
from nonstop.workerlog import setup_logging

__all__ = ["Command", "build_parser", "commands", "main"]


@dataclass(frozen=True, kw_only=True)
class Command:
    """A subcommand (or a few close ones): ``add_parser`` adds the parsers named ``names`` to
    ``nonstop``'s subparsers; ``run`` runs a namespace one of them parsed and returns the exit
    status (a :class:`~nonstop.errors.UsageError` it raises is exit 2, other nonstop errors 1)."""

    names: tuple[str, ...]
    add_parser: Callable[[Any], None]
    run: Callable[[argparse.Namespace], int]


def commands() -> tuple[Command, ...]:
    """Every subcommand, in the order ``nonstop --help`` lists them."""
    from nonstop.chaos import cli as chaos_cli
    from nonstop.checkpoint import cli as export_cli
    from nonstop.sim import cli as sim_cli

    return (
        Command(names=("simulate", "advise"), add_parser=sim_cli.add_parsers, run=sim_cli.dispatch),
        Command(names=("chaos",), add_parser=chaos_cli.add_parsers, run=chaos_cli.dispatch),
        Command(names=("run",), add_parser=run.add_parser, run=run.run),
        Command(names=("demo",), add_parser=demo.add_parser, run=demo.run),
        Command(names=("persist",), add_parser=persist.add_parser, run=persist.run),
        Command(names=("status",), add_parser=status.add_parser, run=status.run),
        Command(names=("migrate", "drain"), add_parser=migrate.add_parser, run=migrate.run),
        Command(names=("inspect",), add_parser=inspect.add_parser, run=inspect.run),
        Command(names=("timeline",), add_parser=timeline.add_parser, run=timeline.run),
        Command(names=("export",), add_parser=export_cli.add_export_parser, run=export_cli.run_export),
        Command(names=("gc",), add_parser=gc.add_parser, run=gc.run),
    )


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The CLI's parser and its subparsers by name (``run``'s is the one ``--config``, the
    environment and Slurm give defaults: :func:`nonstop.cli.run.with_defaults`)."""
    ap = argparse.ArgumentParser(
        prog="nonstop", description="Keep PyTorch training running through failures."
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    add_level_arg(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in commands():
        command.add_parser(sub)
    return ap, dict(sub.choices)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's), run the subcommand, and return its exit status:
    0 done, 1 the job (or a nonstop operation) failed, 2 a user error (one line on stderr)."""
    ap, parsers = build_parser()
    ns = ap.parse_args(argv)
    runs = {name: c.run for c in commands() for name in c.names}
    try:
        if ns.cmd == "run":
            ns = run.with_defaults(ap, parsers["run"], ns, argv)
        setup_logging(log_level(ns))
        return runs[ns.cmd](ns)
    except UsageError as e:
        print(f"nonstop: error: {e}", file=sys.stderr)
        return 2
    except JobFailedError as e:
        print(f"nonstop: job failed: {e}", file=sys.stderr)
        return 1
    except NonstopError as e:
        print(f"nonstop: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
