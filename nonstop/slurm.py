"""Slurm's environment as ``nonstop run``'s node flags, so ``srun nonstop run ... train.py`` needs
none: one ``nonstop run`` per node (``srun --ntasks-per-node=1``), each reading

* ``--nnodes``: ``SLURM_STEP_NUM_NODES`` (an ``srun`` step's nodes), else ``SLURM_NNODES``;
* ``--node-rank``: ``SLURM_NODEID`` (the node's index in the step);
* ``--coordinator``: the first host of ``SLURM_STEP_NODELIST``, else of ``SLURM_JOB_NODELIST``
  (compressed forms such as ``node[01-03,07],gpu5`` expanded as Slurm does), port
  ``29400 + SLURM_JOB_ID mod 1000`` (two jobs sharing a node do not collide) unless
  ``NONSTOP_COORDINATOR_PORT`` names one (a one-node step keeps the loopback and a free port).

Outside an ``srun`` step (the batch script itself runs on the first node only) nothing is
read. These are defaults: the command line and ``--config`` win over them. A step that started more
than one task on a node is refused in one line (nonstop's agent starts the workers itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nonstop.errors import UsageError

__all__ = ["BASE_PORT", "expand_nodelist", "slurm_defaults"]

BASE_PORT = 29400
PORT_ENV = "NONSTOP_COORDINATOR_PORT"


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in order: ``node[01-03,07],gpu5`` ->
    ``node01 node02 node03 node07 gpu5`` (zero padding kept; several bracket groups in one name,
    ``rack[1-2]-n[1-2]``, expand as a product). UsageError for a malformed list."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            hosts.extend(_expand_one(item, text))
    if not hosts:
        raise UsageError(f"Slurm node list {text!r} names no host")
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return out


def _expand_one(item: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if m is None:
        if "[" in item or "]" in item:
            raise UsageError(f"Slurm node list {whole!r}: cannot read {item!r}")
        return [item]
    head, ranges, tail = m.groups()
    names: list[str] = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise UsageError(f"Slurm node list {whole!r}: cannot read the range {part!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if dash else lo) + 1):
            names.append(f"{head}{n:0{width}d}")
    return [name + rest for name in names for rest in _expand_one(tail, whole)] if tail else names


def slurm_defaults(env: Mapping[str, str]) -> dict[str, object]:
    """``nnodes``, ``node_rank`` and ``coordinator`` (argparse dests) from a Slurm step's
    environment; empty outside Slurm (no ``SLURM_NODEID`` or no node list)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    node_id = env.get("SLURM_NODEID")
    if not nodelist or not nnodes or node_id is None:
        return {}
    if env.get("SLURM_STEP_ID") is None and env.get("SLURM_STEPID") is None:
        return {}  # the batch script itself (one process, on the first node): not a node of a job
    try:
        n, k = int(nnodes), int(node_id)
    except ValueError:
        raise UsageError(f"Slurm environment: SLURM_NNODES={nnodes!r}, SLURM_NODEID={node_id!r}") from None
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if tasks is not None and tasks.isdigit() and int(tasks) > n:
        raise UsageError(
            f"this Slurm step runs {tasks} tasks on {n} node(s): run one nonstop per node "
            "(srun --ntasks-per-node=1); its agent starts the --nproc-per-node workers"
        )
    port = env.get(PORT_ENV)
    if port is None:
        job = env.get("SLURM_JOB_ID", "0")
        port = str(BASE_PORT + (int(job) % 1000 if job.isdigit() else 0))
    elif not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"${PORT_ENV}={port!r}: give a port number 1..65535")
    if n == 1:  # one node: the coordinator stays on the loopback, on a free port
        return {"nnodes": 1, "node_rank": 0}
    host = expand_nodelist(nodelist)[0]
    return {"nnodes": n, "node_rank": k, "coordinator": f"{host}:{port}"}
