"""The log flags of the CLI: how workers' output reaches the console and files (``nonstop run``:
``--log-prefix``, ``--log-dir``, ``--local-ranks-filter``) and how much nonstop itself says
(``--log-level``, every command). What the options do: :mod:`nonstop.workerlog`."""

from __future__ import annotations

import argparse
from pathlib import Path

from nonstop.workerlog import LOG_LEVELS, PREFIXES, LogConfig, parse_ranks

__all__ = ["add_level_arg", "add_log_args", "log_config", "log_level"]


def add_level_arg(p: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--log-level``; on a subcommand it is only set when given (the top-level one stays)."""
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None if top else argparse.SUPPRESS,
        help="nonstop's own log lines (timestamped, on stderr): debug, info, warning (default; "
        "-v: info) or error",
    )


def add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker output")
    g.add_argument(
        "--log-prefix",
        choices=PREFIXES,
        default="rank",
        help="what starts each line a worker prints: 'rank' ([rank 3] ..., a hot spare [spare S] "
        "until it takes a rank), 'torchrun' ([default3]:...), 'none' (default %(default)s)",
    )
    g.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write each process's output, unprefixed, to DIR/rank{R}-spawn{S}.log "
        "(S: the process's spawn id; a hot spare's lines before it took a rank: "
        "DIR/spare-spawn{S}.log)",
    )
    g.add_argument(
        "--local-ranks-filter",
        "--ranks-filter",
        dest="ranks_filter",
        default=None,
        metavar="R,R-R",
        help="only these ranks' output reaches the console (e.g. 0 or 0,2-3; hot spares are "
        "hidden until they take one of them); --log-dir files get every line. Ranks are the "
        "job's (global) ranks, the ones in the prefix",
    )


def log_config(ns: argparse.Namespace) -> LogConfig:
    """The worker-output options ``ns`` holds (from :func:`add_log_args`)."""
    return LogConfig(
        prefix=ns.log_prefix,
        log_dir=ns.log_dir,
        ranks=parse_ranks(ns.ranks_filter) if ns.ranks_filter is not None else None,
    )


def log_level(ns: argparse.Namespace) -> str:
    """``--log-level`` if given, else ``info`` with ``-v``, else ``warning``."""
    level = getattr(ns, "log_level", None)
    return str(level) if level else ("info" if ns.verbose else "warning")
