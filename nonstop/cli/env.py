"""torchrun's flags on ``nonstop run``, and every flag from the environment.

Aliases (same meaning, same value):

* the underscore spelling of each multiword flag torchrun has (``--nproc_per_node``,
  ``--node_rank``, ``--max_restarts``, ``--log_dir``, ``--local_ranks_filter``,
  ``--rdzv_endpoint``, ...);
* ``--rdzv-endpoint HOST[:PORT]``: ``--coordinator`` (port 29400 by default, as torchrun's);
  ``--master-addr``/``--master-port`` (static rendezvous): ``--coordinator ADDR:PORT`` (29500)
  when no coordinator is given;
* ``--nproc-per-node gpu``: the node's accelerator device count (``torch.accelerator``, or
  ``$NONSTOP_FAKE_DEVICES``: :func:`nonstop.devices.inventory.detect_devices`; an error with none);
  ``auto``: that, or the CPU count with no accelerator. With ``--spares K`` on a device node
  every process needs a device of its own: ``gpu`` leaves K devices for the spares (8 GPUs,
  ``--spares 1``: 7 ranks), and the launcher refuses more processes than devices;
* ``--nnodes MIN:MAX``: ``--nnodes MAX`` and, when MIN < MAX and no ``--min-world-size`` is given,
  ``--min-world-size MIN x nproc-per-node`` (``--min-world-size`` counts ranks: the job may shrink
  to MIN nodes' worth of ranks);
* ``--standalone``: one node, the coordinator on the loopback on a free port;
* ``--rdzv-backend``, ``--rdzv-id``: accepted and ignored (the rendezvous is the coordinator's; the
  job's id is nonstop's).

The environment: each long flag ``--some-flag`` of ``nonstop run`` (aliases included) is also
``NONSTOP_SOME_FLAG``; one torchrun has is also ``PET_SOME_FLAG`` (torchrun's and Kubeflow's
convention). A switch takes 1/0, true/false, yes/no, on/off; a repeatable flag a shell-quoted
list (``NONSTOP_FAIL='kill:rank=1,step=4 hang:rank=0,step=9'``); ``NONSTOP_CONFIG`` names the
``--config`` file. Precedence, highest first: the command line, ``--config``, ``NONSTOP_*``,
``PET_*``, Slurm's environment (:mod:`nonstop.slurm`), the built-in defaults — what one names for
this run beats what a cluster's launcher exports for every run. A bad value fails before anything
starts, in one line naming the variable (:class:`UsageError`, exit 2).
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping
from typing import Any

from nonstop.errors import UsageError

__all__ = ["add_torchrun_args", "env_defaults", "nnodes_value", "nproc_value", "resolve_torchrun"]

# torchrun's flags that nonstop has (dashed names): each also takes its underscore spelling and PET_*
TORCHRUN_FLAGS = (
    "nproc-per-node", "nnodes", "node-rank", "max-restarts", "log-dir", "local-ranks-filter",
    "rdzv-endpoint", "rdzv-backend", "rdzv-id", "standalone", "master-addr", "master-port",
)  # fmt: skip
RDZV_PORT = 29400  # torchrun's default rendezvous port
MASTER_PORT = 29500  # torchrun's default --master-port
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def nproc_value(text: str) -> int | str:
    """``--nproc-per-node``: a positive count, or ``gpu`` / ``auto`` (resolved by
    :func:`resolve_torchrun`, which needs torch)."""
    if text in ("gpu", "auto"):
        return text
    try:
        return int(text)  # its range is checked with the job's config
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of processes, gpu or auto") from None


def nnodes_value(text: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as ``(min, max)``."""
    lo, colon, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi if colon else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: N or MIN:MAX") from None
    return (a, b)  # checked by resolve_torchrun (one line) and the job's config


def add_torchrun_args(run: argparse.ArgumentParser) -> None:
    """The flags only torchrun has, and torchrun's spellings of nonstop's (the module docstring)."""
    g = run.add_argument_group("torchrun's flags")
    g.add_argument("--standalone", action="store_true", help="one node, coordinator on a free loopback port")
    g.add_argument("--master-addr", default=None, help="torchrun's static rendezvous host: the coordinator's")
    g.add_argument("--master-port", type=int, default=None, help="with --master-addr (default 29500)")
    g.add_argument("--rdzv-backend", default=None, help="ignored: the rendezvous is the coordinator's")
    g.add_argument("--rdzv-id", default=None, help="ignored: the job id is nonstop's")
    actions = _long_options(run)
    _alias(run, actions["coordinator"], "--rdzv-endpoint")
    for flag in TORCHRUN_FLAGS:
        if "-" in flag:
            _alias(run, _long_options(run)[flag], "--" + flag.replace("-", "_"))


def _alias(p: argparse.ArgumentParser, action: argparse.Action, opt: str) -> None:
    """``opt`` names ``action`` too (argparse has no public way to add a spelling afterwards)."""
    action.option_strings = [*action.option_strings, opt]
    p._option_string_actions[opt] = action


def _long_options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o[2:]: a for a in p._actions for o in a.option_strings if o.startswith("--")}


def env_defaults(run: argparse.ArgumentParser, env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """``dest -> value`` from ``PREFIX<FLAG>`` variables (``prefix`` ``NONSTOP_``: every long flag;
    ``PET_``: torchrun's); UsageError naming the variable for a bad value."""
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # dest -> the variable that set it
    for name, action in sorted(_long_options(run).items()):
        dashed = name.replace("_", "-")
        if name in ("help", "config") or (prefix == "PET_" and dashed not in TORCHRUN_FLAGS):
            continue
        var = prefix + dashed.replace("-", "_").upper()
        text = env.get(var)
        if text is None:
            continue
        value = _parse(action, text, var)
        if action.dest in out and out[action.dest] != value:
            raise UsageError(f"${var}={text!r} disagrees with ${seen[action.dest]}")
        out[action.dest], seen[action.dest] = value, var
    return out


def _parse(action: argparse.Action, text: str, var: str) -> Any:
    """``text`` as the flag ``action`` would have stored it."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        low = text.strip().lower()
        if low not in _TRUE + _FALSE:
            raise UsageError(f"${var}={text!r}: a switch, 1 or 0 (true/false, yes/no, on/off)")
        on = low in _TRUE
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if isinstance(action, argparse._AppendAction):
        try:
            items = shlex.split(text)
        except ValueError as e:
            raise UsageError(f"${var}={text!r}: a shell-quoted list ({e})") from None
        return [_scalar(action, t, var) for t in items]
    return _scalar(action, text, var)


def _scalar(action: argparse.Action, text: str, var: str) -> Any:
    kind = action.type
    try:
        value = kind(text) if callable(kind) else text
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        what = {int: "an integer", float: "a number"}.get(kind, str(e) or "a valid value")  # type: ignore[call-overload]
        raise UsageError(f"${var}={text!r}: must be {what}") from None
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"${var}={text!r}: one of {', '.join(str(c) for c in action.choices)}")
    return value


def resolve_torchrun(ns: argparse.Namespace) -> None:
    """Turn torchrun's forms in ``ns`` into nonstop's, in place (the module docstring):
    ``nproc_per_node`` an int, ``nnodes`` an int, ``min_world_size`` from ``--nnodes MIN:MAX``,
    ``coordinator`` from ``--master-addr`` / ``--rdzv-endpoint`` without a port / ``--standalone``."""
    ns.nproc_per_node = _nproc(ns.nproc_per_node, int(getattr(ns, "spares", 0) or 0))
    lo, hi = ns.nnodes if isinstance(ns.nnodes, tuple) else (int(ns.nnodes), int(ns.nnodes))
    if ns.standalone:
        if hi > 1:
            raise UsageError(f"--standalone runs one node, not --nnodes {hi}")
        ns.node_rank, ns.coordinator, ns.host, ns.port = 0, None, "127.0.0.1", 0
    if lo > hi or lo < 1:
        raise UsageError(f"--nnodes {lo}:{hi}: MIN:MAX with 1 <= MIN <= MAX")
    ns.nnodes = hi
    if lo < hi and not ns.min_world_size:
        ns.min_world_size = lo * ns.nproc_per_node
    if ns.coordinator is None and ns.master_addr is not None and not ns.standalone:
        ns.coordinator = f"{ns.master_addr}:{ns.master_port or MASTER_PORT}"
    if ns.coordinator is not None and ":" not in ns.coordinator.rsplit("]", 1)[-1]:
        ns.coordinator = f"{ns.coordinator}:{RDZV_PORT}"


def _nproc(value: int | str, spares: int = 0) -> int:
    """``gpu``/``auto`` as a count: the node's devices less one per spare (each process holds a
    device of its own), or with no accelerator the CPU count (``auto``) or an error (``gpu``)."""
    if isinstance(value, int):
        return value
    from nonstop.devices.inventory import detect_devices  # imports torch: only for gpu / auto

    devices = detect_devices()
    if devices.count is None:
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no accelerator device is visible (torch.accelerator)")
        return os.cpu_count() or 1
    if devices.count - spares < 1:
        raise UsageError(
            f"--nproc-per-node {value} with --spares {spares}: this node has {devices.describe()}, "
            "no device left for a rank"
        )
    return devices.count - spares
