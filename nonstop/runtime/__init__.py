"""Deprecated: the modules that lived here moved to packages by concept (issue 46).

``nonstop.runtime.X`` keeps importing -- it is the module at its new place, the same object, with
a :class:`DeprecationWarning` -- so code written against the old paths goes on working:

=======================  ==================================================================
old                      new
=======================  ==================================================================
``coordinator``          :mod:`nonstop.coordinator.loop` (the coordinator's operations are
                         beside it in :mod:`nonstop.coordinator`)
``node``, ``agent``      :mod:`nonstop.agent.node`, :mod:`nonstop.agent.processes`
``launcher``             :mod:`nonstop.launch.launcher`
``events``, ``eventlog`` :mod:`nonstop.events`, :mod:`nonstop.events.log`
``policy``, ``recovery`` :mod:`nonstop.policy.decisions`, :mod:`nonstop.policy.reconfiguration`
``wire``                 :mod:`nonstop.protocol.wire`
=======================  ==================================================================

and :data:`MOVED` for the rest.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED"]

# old name under nonstop.runtime -> the module's name now
MOVED: dict[str, str] = {
    "agent": "nonstop.agent.processes",
    "cadence": "nonstop.policy.cadence",
    "client": "nonstop.launch.job_client",
    "clients": "nonstop.coordinator.client_requests",
    "coordinator": "nonstop.coordinator.loop",
    "coordproc": "nonstop.launch.coordproc",
    "detector": "nonstop.coordinator.detector",
    "devices": "nonstop.devices.inventory",
    "elastic": "nonstop.policy.elastic",
    "eventfeed": "nonstop.coordinator.event_feed",
    "eventlog": "nonstop.events.log",
    "events": "nonstop.events",
    "events.base": "nonstop.events.base",
    "events.feed": "nonstop.events.hook",
    "events.health": "nonstop.events.health",
    "events.job": "nonstop.events.job",
    "events.memory": "nonstop.events.memory",
    "events.moves": "nonstop.events.moves",
    "events.recovery": "nonstop.events.recovery",
    "executor": "nonstop.coordinator.executor",
    "failures": "nonstop.coordinator.failures",
    "gc": "nonstop.agent.gc",
    "generations": "nonstop.coordinator.generations",
    "grading": "nonstop.policy.grading",
    "healthops": "nonstop.coordinator.health",
    "jobdir": "nonstop.launch.jobdir",
    "jobfiles": "nonstop.launch.jobfiles",
    "jobstore": "nonstop.control.jobstore",
    "launcher": "nonstop.launch.launcher",
    "localnodes": "nonstop.launch.local_nodes",
    "metrics": "nonstop.coordinator.metrics",
    "migration": "nonstop.policy.migration",
    "ncclenv": "nonstop.devices.nccl",
    "node": "nonstop.agent.node",
    "nodelease": "nonstop.agent.lease",
    "nodes": "nonstop.coordinator.node_agents",
    "nodespawn": "nonstop.agent.spawn",
    "nodework": "nonstop.agent.data_path",
    "notice": "nonstop.agent.notice",
    "persistence": "nonstop.coordinator.persistence",
    "persistops": "nonstop.coordinator.persistence",
    "phase": "nonstop.policy.phase",
    "planning": "nonstop.policy.planning",
    "planwait": "nonstop.coordinator.plan_asks",
    "policy": "nonstop.policy.decisions",
    "proactive": "nonstop.policy.proactive",
    "probes": "nonstop.agent.probes",
    "probing": "nonstop.agent.probe_thread",
    "recovery": "nonstop.policy.reconfiguration",
    "replication": "nonstop.coordinator.replication",
    "rescue": "nonstop.policy.rescue",
    "resizing": "nonstop.coordinator.resizing",
    "restoring": "nonstop.coordinator.restore_sources",
    "shmspace": "nonstop.agent.memory",
    "silence": "nonstop.agent.silence",
    "statusserver": "nonstop.coordinator.status_server",
    "storesync": "nonstop.coordinator.store_sync",
    "straggler": "nonstop.policy.straggler",
    "survivors": "nonstop.policy.survivors",
    "swap": "nonstop.policy.boundary_swap",
    "swapops": "nonstop.coordinator.swaps",
    "torchenv": "nonstop.coordinator.torch_env",
    "view": "nonstop.coordinator.view",
    "wire": "nonstop.protocol.wire",
    "workerlog": "nonstop.workerlog",
    "workers": "nonstop.coordinator.workers",
}

_PREFIX = __name__ + "."


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``nonstop.runtime.X`` as the module :data:`MOVED` names (the same module object:
    its classes, its state and what tests patch on it are shared)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX) :] not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name[len(_PREFIX) :]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: it keeps its own
        for alias, own in list(self._specs.items()):
            if sys.modules.get(alias, module) is module and own is not None and own.name == module.__name__:
                module.__spec__ = own


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())


def __getattr__(name: str) -> ModuleType:
    if name in MOVED:
        return importlib.import_module(_PREFIX + name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
