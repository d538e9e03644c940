"""Costs measured by the runtime's benchmarks, and the laws that scale them to a cluster.

:func:`load_calibration` reads ``benchmarks/results/{mttr,snapshot_stall,step_overhead,persist,elastic}.json``
(and ``migration.json``, the live migration benchmark). Every figure of :class:`Calibration`
records where it came from in ``sources``: ``measured: <file>:<field>``, ``law: ...`` or
``assumption: ...``. A missing file or field falls back to the documented default and says so.

Laws (docs/simulator.md has the derivations):

* **Restart of a whole job on n nodes** (torchrun + load, everything but the checkpoint read):
  ``restart_s(n) = 28.8 + 2.82 * log2(n)`` — a logarithm fitted through Parcae's measured 28.8 s at
  1 node and 42.9 s at 32 nodes (Duan et al., NSDI'24): group formation is a tree/ring of
  rendezvous rounds, so it grows with log n; 14.1 s over 5 doublings = 2.82 s per doubling.
* **Rendezvous on n nodes**: ``rendezvous_s(n) = 6.6 * restart_s(n) / restart_s(32)`` — Parcae's
  6.6 s rendezvous, taken at its 32-node scale and scaled like the restart.
* **Snapshot stall per step at scale**: ``copy = bytes / d2h_gbps`` (a bare device-to-host copy of
  the GPU's state); ``stall = overlapped_ratio * copy`` when the copy fits in the step, the whole
  ``copy`` when it does not (measured on an H200: a 43 ms step with a 118 ms copy took step +
  copy). The ratio is the one measured on a GPU where ``gpu_capture.json`` has per-step samples
  (the mean step with the snapshot minus the mean step without, over the copy, for training steps
  longer than the copy: :func:`gpu_stall_ratio`); the CPU's otherwise (snapshot_stall.json, where
  the copy competes with compute for the cores: higher).
* **Restore from memory**: ``bytes / restore_local_gbps``, the rate measured for the in-place
  restore stage (mttr.json, 26.3 M parameters x 12 bytes of fp32 + Adam per rank).
* **Per-step cost of the framework** (every step, whether or not anything fails): the seconds
  torchft's quorum, commit vote and managed allreduce add to a plain-DDP step, and nonstop's
  worker without its snapshot, measured side by side with a model small enough that compute and
  gradient traffic are negligible (``step_cost_peers-tiny.json``, ``bench_step_cost_peers.py
  --model tiny``): the fixed latency each step pays on any hardware. The part that grows with the
  model (on CPU: torchft's comm hook waits for each bucket inside backward) is not charged: it
  depends on the backend (NCCL waits on the stream, not the CPU), so this is a lower bound.
* **Migration and elastic grow at scale** (``sim/swapsim.py``): the runtime's boundary-swap machine
  timed action by action; its pause is the boundary fetch still in flight + the joiner's restore +
  ``rendezvous_s(n)`` + the per-swap cost measured on one node beyond the step itself
  (``migration_pause_steps`` from migration.json, ``grow_pause_steps`` from elastic.json: the
  step gap at the swap / the median step, minus 1).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_RESULTS",
    "PARCAE_RESTART_1_S",
    "PARCAE_RESTART_32_S",
    "PARCAE_RENDEZVOUS_S",
    "Calibration",
    "gpu_stall_ratio",
    "load_calibration",
    "rendezvous_s",
    "restart_s",
]

DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
PARCAE_RESTART_1_S = 28.8
PARCAE_RESTART_32_S = 42.9
PARCAE_RENDEZVOUS_S = 6.6
_SLOPE = (PARCAE_RESTART_32_S - PARCAE_RESTART_1_S) / math.log2(32)


def restart_s(num_nodes: float) -> float:
    """Seconds to restart a job on ``num_nodes`` nodes (Parcae, log fit; see module docstring)."""
    return PARCAE_RESTART_1_S + _SLOPE * math.log2(max(1.0, num_nodes))


def rendezvous_s(num_nodes: float) -> float:
    """Seconds for all ranks of ``num_nodes`` nodes to form a new group."""
    return PARCAE_RENDEZVOUS_S * restart_s(num_nodes) / restart_s(32)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Every cost constant the strategies use. ``sources[field]`` says where each came from."""

    # measured by benchmarks/bench_mttr.py (nonstop on one node, CPU)
    detect_exit_s: float = 0.164
    plan_s: float = 0.001
    launch_spare_s: float = 0.003
    launch_cold_s: float = 2.67
    restore_local_gbps: float = 1.5
    rebuild_local_s: float = 0.02
    baseline_detect_exit_s: float = 0.131
    baseline_first_step_factor: float = 1.7  # first step after a torchrun restart / a normal step
    # measured by benchmarks/bench_snapshot_stall.py
    overlapped_stall_ratio: float = 0.058  # overlapped stall / bare copy
    dcp_async_stall_ratio: float = 1.41  # dcp.async_save blocking / bare copy
    host_copy_gbps: float = 13.2
    # measured by benchmarks/bench_step_overhead.py (CPU, compute and copy share 2 cores)
    cpu_every_step_throughput: float = 0.918
    # measured by benchmarks/bench_persist.py
    persist_node_gbps: float = 0.93
    # measured by benchmarks/bench_step_cost_peers.py --model tiny: seconds a framework adds to every
    # plain-DDP step (torchft: quorum + commit vote + managed allreduce; nonstop: its worker with
    # the snapshot off -- the snapshot's stall is charged by the law above)
    torchft_step_overhead_s: float = 0.0018
    nonstop_step_overhead_s: float = 0.0006
    # live-migration pause in median steps beyond the step itself (bench_migration.py)
    migration_pause_steps: float = 2.0
    # measured by benchmarks/bench_elastic.py: the pause of an elastic grow (joiners prepared while
    # the job trains) beyond the step itself, in median steps: rank 0's step gap at the grow - 1
    grow_pause_steps: float = 1.0
    # assumptions about a GPU cluster (documented in docs/simulator.md)
    d2h_gbps: float = 25.0
    peer_gbps_per_gpu: float = 25.0
    durable_aggregate_gbps: float = 2000.0
    heartbeat_timeout_s: float = 1.0
    node_lease_s: float = 5.0
    collective_timeout_s: float = 600.0
    torchft_heartbeat_s: float = 5.0
    quorum_s: float = 1.0
    forward_share: float = 1 / 3
    node_provision_s: float = 300.0
    repair_s: float = 2 * 86_400.0
    sources: dict[str, str] = field(default_factory=dict)

    def source(self, name: str) -> str:
        return self.sources.get(name, _DEFAULT_SOURCES.get(name, "default"))

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("sources")
        return {k: {"value": v, "source": self.source(k)} for k, v in d.items()}

    def restore_local_s(self, state_bytes: float) -> float:
        return state_bytes / (self.restore_local_gbps * 1e9)

    def snapshot_stall_s(self, state_bytes: float, step_s: float | None = None) -> float:
        """Stall of one overlapped snapshot of ``state_bytes`` (one GPU) in a step of ``step_s``
        (None: assumed longer than the copy): the measured share of a bare copy when the copy
        fits in the step, else the whole copy (the module docstring)."""
        copy_s = self.capture_s(state_bytes)
        if step_s is not None and copy_s > step_s:
            return copy_s
        return self.overlapped_stall_ratio * copy_s

    def capture_s(self, state_bytes: float) -> float:
        """The bare device-to-host copy of one GPU's ``state_bytes``: how long after a step's
        boundary its snapshot is whole in host memory (the copy overlaps the next step)."""
        return state_bytes / (self.d2h_gbps * 1e9)

    def dcp_blocking_s(self, state_bytes: float) -> float:
        """Blocking part of a ``dcp.async_save`` of ``state_bytes`` (one GPU)."""
        return self.dcp_async_stall_ratio * state_bytes / (self.d2h_gbps * 1e9)

    def peer_transfer_s(self, state_bytes: float) -> float:
        """Fetch one GPU's state from another node's memory (each GPU has its own NIC share)."""
        return state_bytes / (self.peer_gbps_per_gpu * 1e9)

    def durable_read_s(self, state_bytes: float, num_gpus: int, gpus_per_node: int) -> float:
        """Every GPU reads its state from the durable tier at once: the slower of the
        aggregate storage bandwidth and each node's share of it."""
        agg = state_bytes * num_gpus / (self.durable_aggregate_gbps * 1e9)
        per_node = state_bytes * gpus_per_node / (self.peer_gbps_per_gpu * gpus_per_node * 1e9)
        return max(agg, per_node)

    def durable_write_s(self, state_bytes: float, num_gpus: int, gpus_per_node: int) -> float:
        """Persist every GPU's state: aggregate bandwidth or the node's own write rate."""
        agg = state_bytes * num_gpus / (self.durable_aggregate_gbps * 1e9)
        per_node = state_bytes * gpus_per_node / (self.persist_node_gbps * gpus_per_node * 1e9)
        return max(agg, per_node)


_DEFAULT_SOURCES = {
    "migration_pause_steps": "assumption when migration.json is absent: 2 steps (drain the step in "
    "flight + hand over), BENCH.md's figure 'migration pause / median step'",
    "d2h_gbps": "assumption: pinned device-to-host copy over PCIe Gen5 x16 at ~40% of its 64 GB/s, "
    "every GPU of a node copying at once through shared PCIe switches (one H200 alone measured "
    "54.4 GB/s: gpu_capture.json)",
    "peer_gbps_per_gpu": "assumption: half of one 400 Gb/s NIC per GPU (Llama 3's fabric: 400 Gbps per GPU)",
    "durable_aggregate_gbps": "Llama 3 paper: Tectonic storage sustains 2 TB/s (7 TB/s peak)",
    "heartbeat_timeout_s": "nonstop default (config.DetectorConfig.heartbeat_timeout_s)",
    "node_lease_s": "assumption: a node agent's lease, like torchft's 5 s heartbeat",
    "collective_timeout_s": "PyTorch default NCCL process-group timeout (10 min)",
    "torchft_heartbeat_s": "torchft default heartbeat timeout (5 s), shared/brief/BENCH.md",
    "quorum_s": "assumption: one torchft Lighthouse quorum round (its process-group "
    "reconfiguration is charged by the rendezvous law, as nonstop's rebuild of the same group)",
    "forward_share": "assumption: the forward pass is a third of a step (the backward costs twice "
    "it); torchft's async quorum (its default) reconfigures while the forward runs",
    "node_provision_s": "assumption: the scheduler hands a fresh node from its free pool in 5 min",
    "repair_s": "assumption: a drained machine is repaired and back as a spare in 2 days",
}


def _get(doc: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) and v > 0 else None


def _mean_step(case: Any, contender: str) -> float | None:
    steps = _get(case, contender, "steps_s")
    ok = [v for v in steps if _num(v) is not None] if isinstance(steps, list) else []
    return statistics.fmean(ok) if ok else None


def gpu_stall_ratio(doc: Any) -> tuple[float | None, str]:
    """The overlapped snapshot's stall on a GPU as a share of a bare copy, from
    ``bench_gpu_capture.py``'s report: for each training case whose step (without a snapshot) is
    longer than the state's copy at the measured snapshot bandwidth, (mean step with ``nonstop`` -
    mean step with none) / copy, at least 0; the median over such cases. A mean, not a median: an
    occasional step that waits for a whole copy costs throughput. (None, why) without such a case
    or without per-step samples (reports before they were recorded)."""
    gbps = _num(_get(doc, "bandwidth", "nonstop_gbps"))
    ratios = []
    for case in _get(doc, "loops") or []:
        state = _num(_get(case, "state_bytes"))
        bare, snap = _mean_step(case, "none"), _mean_step(case, "nonstop")
        if gbps is None or state is None or bare is None or snap is None:
            continue
        copy_s = state / (gbps * 1e9)
        if copy_s < bare:
            ratios.append(max(0.0, snap - bare) / copy_s)
    if not ratios:
        return None, "gpu_capture.json: no case with per-step samples whose step outlasts its copy"
    gpu = _get(doc, "machine", "gpu") or "a GPU"
    return statistics.median(ratios), f"gpu_capture.json ({gpu}): (nonstop - none mean step) / copy"


def load_calibration(results_dir: Path = DEFAULT_RESULTS, **overrides: float) -> Calibration:
    """Read the runtime benchmark results; fields not found keep their defaults (and say so)."""
    values: dict[str, float] = {}
    sources: dict[str, str] = {}

    def take(name: str, value: float | None, source: str) -> None:
        if value is not None:
            values[name] = value
            sources[name] = f"measured: {source}"
        else:
            sources[name] = f"default {getattr(Calibration(), name)!r} ({source} not found)"

    def load(fname: str) -> Any:
        p = results_dir / fname
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    mttr = load("mttr.json")
    hot = _get(mttr, "contenders", "nonstop_hot", "summary", "stages")
    cold = _get(mttr, "contenders", "nonstop_cold", "summary", "stages")
    base = _get(mttr, "contenders", "torchrun_ckpt", "summary", "stages")
    take("detect_exit_s", _num(_get(hot, "detect", "median")), "mttr.json nonstop_hot detect")
    take("plan_s", _num(_get(hot, "plan", "median")), "mttr.json nonstop_hot plan")
    take("launch_spare_s", _num(_get(hot, "launch", "median")), "mttr.json nonstop_hot launch")
    take("launch_cold_s", _num(_get(cold, "launch", "median")), "mttr.json nonstop_cold launch")
    take("rebuild_local_s", _num(_get(hot, "rebuild", "median")), "mttr.json nonstop_hot rebuild")
    params = _num(_get(mttr, "workload", "num_params"))
    restore = _num(_get(hot, "restore", "median"))
    take(
        "restore_local_gbps",
        params * 12 / restore / 1e9 if params and restore else None,
        "mttr.json num_params x 12 B (fp32 + Adam) / nonstop_hot restore",
    )
    take("baseline_detect_exit_s", _num(_get(base, "detect", "median")), "mttr.json torchrun_ckpt detect")
    first = _num(_get(base, "first_step", "median"))
    step = _num(_get(mttr, "workload", "step_s_median"))
    take(
        "baseline_first_step_factor",
        first / step if first and step else None,
        "mttr.json torchrun_ckpt first_step / workload step_s_median",
    )

    stall = load("snapshot_stall.json")
    cases = _get(stall, "cases") or []

    def ratio(contender: str) -> float | None:
        vals = [
            _num(_get(c, "contenders", contender, "ratio_to_floor", "median"))
            for c in cases
            if isinstance(c, dict)
        ]
        ok = [v for v in vals if v is not None]
        return statistics.median(ok) if ok else None

    gpu_ratio, gpu_source = gpu_stall_ratio(load("gpu_capture.json"))
    if gpu_ratio is not None:
        take("overlapped_stall_ratio", gpu_ratio, gpu_source)
    else:
        take("overlapped_stall_ratio", ratio("nonstop_overlapped"), "snapshot_stall.json median over cases")
    take("dcp_async_stall_ratio", ratio("dcp_async"), "snapshot_stall.json median over cases")
    gbps = [_num(_get(c, "contenders", "floor", "gb_per_s_at_median")) for c in cases if isinstance(c, dict)]
    ok = [g for g in gbps if g is not None]
    take("host_copy_gbps", statistics.median(ok) if ok else None, "snapshot_stall.json floor GB/s")

    over = load("step_overhead.json")
    take(
        "cpu_every_step_throughput",
        _num(_get(over, "summary", "overlapped", "throughput_vs_off", "median")),
        "step_overhead.json overlapped throughput_vs_off",
    )
    persist = load("persist.json")
    take(
        "persist_node_gbps",
        _num(_get(persist, "summary", "persist_none", "raw_gb_per_s")),
        "persist.json persist_none raw GB/s",
    )
    peers = load("step_cost_peers-tiny.json")
    for name, contender in (
        ("torchft_step_overhead_s", "torchft"),
        ("nonstop_step_overhead_s", "nonstop_off"),
    ):
        extra = _get(peers, "summary", contender, "extra_s_vs_ddp", "median")
        take(
            name,
            max(0.0, float(extra)) if isinstance(extra, int | float) and math.isfinite(extra) else None,
            f"step_cost_peers-tiny.json {contender} extra_s_vs_ddp (>= 0)",
        )
    elastic = load("elastic.json")
    gap = _num(_get(elastic, "summary", "grow_gap_over_median", "median"))
    take(
        "grow_pause_steps",
        _num(gap - 1.0) if gap is not None else None,
        "elastic.json summary.grow_gap_over_median - 1",
    )
    migration = load("migration.json")
    swap_gap = _num(_get(migration, "contenders", "nonstop_migrate", "coordinator_pause_ratio", "median"))
    take(
        "migration_pause_steps",
        _num(swap_gap - 1.0) if swap_gap is not None else None,
        "migration.json nonstop_migrate coordinator_pause_ratio (the rank's gap across the swap "
        "over its median step) - 1",
    )
    for name, v in overrides.items():
        if not hasattr(Calibration(), name) or name == "sources":
            raise ValueError(f"unknown calibration field {name!r}")
        values[name] = float(v)
        sources[name] = "override"
    for name, src in _DEFAULT_SOURCES.items():
        sources.setdefault(name, src)
    if sources.get("migration_pause_steps", "").startswith("default"):
        sources["migration_pause_steps"] = _DEFAULT_SOURCES["migration_pause_steps"]
    return Calibration(**values, sources=sources)
