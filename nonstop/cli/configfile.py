"""``nonstop run --config job.toml``: a job's flags in a TOML file.

Format: one key per flag, named as the long flag without its dashes (``nproc-per-node = 4``,
``persist = "s3://bucket/job"``, ``lossy = true``); a repeatable flag takes a list
(``fail = ["kill:rank=1,step=10"]``); the training script and its arguments are ``script``
and ``script-args`` (a list of strings); ``module = true`` is ``-m``. Underscores are accepted for
dashes. Tables are not used. Precedence, highest first: the command line, the file, the
scheduler's environment (:mod:`nonstop.slurm`), the built-in defaults; a repeatable flag given on
the command line adds to the file's list.

Bad files fail before anything starts, with one line naming the key (:class:`UsageError`):
a key that is no flag of ``nonstop run``, a value of the wrong type (an int where a path is
expected, a string for a switch), a value outside a flag's choices, a file that is not TOML.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError

__all__ = ["load_config"]

# Keys that are not a flag's long name: the positional arguments and ``-m``.
_POSITIONAL = {"script": "script", "script-args": "script_args", "module": "module"}


def load_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's values as ``parser``'s ``dest -> value`` defaults, each checked against the
    flag it names (type, choices). UsageError (one line, naming the file and key) otherwise."""
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None
    flags = _flags(parser)
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = key.replace("_", "-")
        where = f"--config {path}: key {key!r}"
        if name in _POSITIONAL:
            out[_POSITIONAL[name]] = _positional(name, value, where)
            continue
        action = flags.get(name)
        if action is None or name == "config":
            raise UsageError(f"{where} is not a flag of nonstop run (keys are the long flag names)")
        out[action.dest] = _value(action, value, where)
    return out


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``long-name -> action`` of every long option of ``parser``."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                out[opt[2:]] = action
    return out


def _positional(name: str, value: Any, where: str) -> Any:
    if name == "module":
        if not isinstance(value, bool):
            raise UsageError(f"{where} must be true or false (got {value!r})")
        return value
    if name == "script":
        if not isinstance(value, str):
            raise UsageError(f"{where} must be a string: the training script (got {value!r})")
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where} must be a list of strings (got {value!r})")
    return list(value)


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the flag ``action`` would have stored it."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise UsageError(f"{where} is a switch: true or false (got {value!r})")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, v, where) for v in items]
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    kind = action.type
    if isinstance(value, bool) or isinstance(value, dict | list):
        raise UsageError(f"{where} must be {_kind_name(kind)} (got {value!r})")
    if kind is int:
        if not isinstance(value, int):
            raise UsageError(f"{where} must be an integer (got {value!r})")
        got: Any = value
    elif kind is float:
        if not isinstance(value, int | float):
            raise UsageError(f"{where} must be a number (got {value!r})")
        got = float(value)
    elif kind is Path:
        if not isinstance(value, str):
            raise UsageError(f"{where} must be a path, as a string (got {value!r})")
        got = Path(value)
    elif kind is None or kind is str:
        if not isinstance(value, str):
            raise UsageError(f"{where} must be a string (got {value!r})")
        got = value
    else:  # a flag with its own parser (--nproc-per-node, --nnodes): hand it the text
        try:
            got = kind(str(value)) if callable(kind) else value
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise UsageError(f"{where}: {e}") from None
    if action.choices is not None and got not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise UsageError(f"{where} must be one of {choices} (got {value!r})")
    return got


def _kind_name(kind: object) -> str:
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    return "a path, as a string" if kind is Path else "a string"
