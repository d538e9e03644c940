"""Cluster-scale simulator and policy advisor, calibrated on the runtime's measured costs.

Concepts (each in its own module):

* :mod:`~nonstop.sim.api` — the contract: :class:`JobSpec`, :class:`FailureEvents`, the
  :class:`Strategy` protocol (and :class:`~nonstop.sim.api.Resizing`, what an elastic strategy
  adds), :class:`Recovery` (a strategy's answer to one failure) and :class:`SimResult`. Losses are
  GPU-seconds booked per (cause, stage).
* :mod:`~nonstop.sim.failures` — failure processes (Poisson / Weibull per node, lemon nodes),
  Llama 3's cause mix, Meta's rates, spot-trace replay; :mod:`~nonstop.sim.traces` reads traces.
* :mod:`~nonstop.sim.failslow` — fail-slow ranks (a synchronous job runs at its slowest rank's
  pace) and degraded signals before failures, with their sources; :mod:`~nonstop.sim.proactivesim`
  — nonstop's moves ahead of trouble, decided by the runtime's detector, grading and proactive
  policy (:mod:`nonstop.policy.straggler`, :mod:`~nonstop.policy.grading`,
  :mod:`~nonstop.policy.proactive`).
* :mod:`~nonstop.sim.engine` — the discrete-event engine (:func:`simulate`).
* :mod:`~nonstop.sim.strategies` — :class:`CheckpointRestart` (DCP + torchrun) and
  :class:`TorchftLike`; :mod:`~nonstop.sim.nonstop_strategy` — :class:`Nonstop`, which decides
  through the runtime's own policies (:mod:`nonstop.policy.decisions`, :mod:`nonstop.policy.elastic`);
  its elastic world (who is out, who joins, the shrunk rate, shrink first or replace first:
  :mod:`nonstop.policy.survivors`) is :mod:`~nonstop.sim.elasticsim`; grows, migrations and
  recoveries are timed through the runtime's machines (:mod:`~nonstop.sim.swapsim`,
  :mod:`~nonstop.sim.recoverysim`).
* :mod:`~nonstop.sim.calibrate` — costs read from ``benchmarks/results`` and the scaling laws.
* :mod:`~nonstop.sim.theory` — Young/Daly, the exact renewal formula, Meta's E[ETTR].
* :mod:`~nonstop.sim.metrics` — ETTR, goodput, breakdowns, JSON, plots.
* :mod:`~nonstop.sim.advisor` / :mod:`~nonstop.sim.predictor` — ``nonstop advise``: settings
  under a host-memory budget, the goodput frontier, spot-availability forecasting.
* :mod:`~nonstop.sim.cli` — ``nonstop simulate`` / ``nonstop advise``.

docs/simulator.md describes the model, the laws and their sources, and the validation.
"""

from nonstop.sim.api import FailureEvents, JobSpec, Recovery, SimResult, Strategy
from nonstop.sim.calibrate import Calibration, load_calibration
from nonstop.sim.engine import simulate
from nonstop.sim.failslow import FailSlowModel, WithFailSlow
from nonstop.sim.failures import LLAMA3_CAUSES, PRESETS, Cause, FailureModel, TraceFailures, preset
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.strategies import CheckpointRestart, TorchftLike

__all__ = [
    "LLAMA3_CAUSES",
    "PRESETS",
    "Calibration",
    "Cause",
    "CheckpointRestart",
    "FailSlowModel",
    "FailureEvents",
    "FailureModel",
    "JobSpec",
    "Nonstop",
    "NonstopParams",
    "Recovery",
    "SimResult",
    "Strategy",
    "TorchftLike",
    "TraceFailures",
    "WithFailSlow",
    "load_calibration",
    "preset",
    "simulate",
]
