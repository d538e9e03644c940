"""``nonstop simulate`` and ``nonstop advise``: the simulator's command-line edge.

The main CLI wires these in with :func:`add_parsers` (on its ``add_subparsers(dest="cmd")``) and
calls :func:`dispatch` when ``ns.cmd`` is ``simulate`` or ``advise``. Bad input raises
:class:`~nonstop.errors.UsageError` (one line: what to do), which the main CLI prints and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from nonstop.config import SHRINK_BATCHES
from nonstop.errors import UsageError
from nonstop.plotting import require_plots
from nonstop.policy.cadence import DEFAULT_BUDGET, MAX_AGE_S
from nonstop.policy.decisions import QuarantinePolicy
from nonstop.policy.survivors import SurvivorMode
from nonstop.sim.advisor import advise, plot_frontier, proactive_worth
from nonstop.sim.api import JobSpec, SimResult, Strategy, require
from nonstop.sim.calibrate import DEFAULT_RESULTS, Calibration, load_calibration
from nonstop.sim.engine import EventSource, simulate
from nonstop.sim.failslow import DEFAULT_FAILSLOW, FailSlowModel, WithFailSlow
from nonstop.sim.failures import PRESETS, FailureModel, TraceFailures, preset
from nonstop.sim.metrics import NO_PROACTIVE_NAME, failslow_summary, markdown_table, plot_results, result_json
from nonstop.sim.nonstop_strategy import Nonstop, NonstopParams
from nonstop.sim.predictor import ARForecaster, evaluate
from nonstop.sim.proactivesim import NO_PROACTIVE
from nonstop.sim.strategies import CheckpointRestart, TorchftLike
from nonstop.sim.theory import optimal_interval
from nonstop.sim.traces import find_trace, load_availability, load_node_trace

__all__ = ["STRATEGIES", "add_parsers", "build_strategies", "dispatch"]

STRATEGIES = ("checkpoint-restart", "torchft-like", "nonstop")


def _job_args(p: argparse.ArgumentParser, *, days: float) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--gpus", type=int, default=16_384, help="GPUs training (default %(default)s)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="(default %(default)s)")
    g.add_argument("--days", type=float, default=days, help="wall time simulated (default %(default)s)")
    g.add_argument(
        "--state-gb", type=float, default=4.0, help="training state per GPU, GB (default %(default)s)"
    )
    g.add_argument("--step-s", type=float, default=5.0, help="median step time, s (default %(default)s)")
    g.add_argument(
        "--nodes-per-domain", type=int, default=2, help="nodes per failure domain (default %(default)s)"
    )
    f = p.add_argument_group("failures")
    f.add_argument("--preset", choices=sorted(PRESETS), default="llama3", help="(default %(default)s)")
    f.add_argument(
        "--rate", type=float, default=None, help="failures per 1,000 node-days (overrides the preset's)"
    )
    f.add_argument("--weibull-shape", type=float, default=1.0, help="1 = Poisson (default %(default)s)")
    f.add_argument("--lemon-fraction", type=float, default=0.0, help="share of nodes failing more often")
    f.add_argument("--lemon-factor", type=float, default=1.0, help="how much more often (x)")
    f.add_argument(
        "--fail-slow",
        action="store_true",
        help="also model fail-slow ranks and degraded signals before failures (docs/simulator.md); "
        "nonstop then moves ranks ahead of trouble, and the report says what that is worth",
    )
    f.add_argument(
        "--fail-slow-rate",
        type=float,
        default=DEFAULT_FAILSLOW.rate_per_gpu_hour,
        metavar="PER_GPU_HOUR",
        help="fail-slow events per GPU-hour (default %(default).3g: an assumption, see the docs)",
    )
    f.add_argument(
        "--warned-fraction",
        type=float,
        default=DEFAULT_FAILSLOW.warned_fraction,
        help="share of hardware failures with a degraded signal first (default %(default)s: assumed)",
    )
    f.add_argument(
        "--lead-s",
        type=float,
        default=DEFAULT_FAILSLOW.lead_s,
        help="how long before its failure a node looks degraded, s (default %(default)s: assumed)",
    )
    p.add_argument(
        "--results-dir", type=Path, default=DEFAULT_RESULTS, help="runtime benchmark JSON to calibrate on"
    )
    p.add_argument("--seed", type=int, default=0, help="first seed (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the full result as JSON")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PATH",
        help="write a PNG a person reads at a glance (needs matplotlib: pip install 'nonstop[plots]')",
    )


def add_parsers(sub: Any) -> None:
    """Add ``simulate`` and ``advise`` to an ``argparse`` subparsers object."""
    _add_simulate(sub)
    _add_advise(sub)


def _add_simulate(sub: Any) -> None:
    """``simulate``: the job and its failures, the strategies compared, then nonstop's settings."""
    sim = sub.add_parser("simulate", help="simulate a cluster-scale job through failures, per strategy")
    _job_args(sim, days=54.0)
    sim.add_argument(
        "--trace", default=None, help="replay a spot trace (p3, g4dn or a path) instead of a preset"
    )
    sim.add_argument(
        "--spot-notice-s", type=float, default=0.0, help="preemption notice: > 0 makes it planned"
    )
    sim.add_argument(
        "--strategy",
        action="append",
        choices=STRATEGIES,
        default=None,
        help="repeatable (default: all three)",
    )
    sim.add_argument("--seeds", type=int, default=1, help="runs per strategy; the median is reported")
    sim.add_argument(
        "--ckpt-interval-s", type=float, default=None, help="checkpoint-restart interval (default: optimal)"
    )
    sim.add_argument("--group-nodes", type=int, default=None, help="torchft replica-group size in nodes")
    _nonstop_snapshots(sim)
    _nonstop_elastic(sim)
    _nonstop_groups(sim)
    progress = sim.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None)
    progress.add_argument("--no-progress", dest="progress", action="store_false")


def _nonstop_snapshots(sim: argparse.ArgumentParser) -> None:
    """``simulate``'s nonstop settings: replicas, the snapshot cadence, spares, persists, quarantine."""
    sim.add_argument("--replicas", type=int, default=1, help="nonstop peer replicas (default %(default)s)")
    sim.add_argument("--snapshot-every", type=int, default=1, help="nonstop snapshot interval, steps")
    sim.add_argument(
        "--snapshot-budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="FRACTION",
        help="nonstop: the interval tuned to this stall budget, as the runtime's --snapshot-budget "
        "(the smallest K >= --snapshot-every whose stall costs at most FRACTION of a step; 0: fixed; "
        "default %(default)s, the runtime's)",
    )
    sim.add_argument(
        "--snapshot-max-age",
        type=float,
        default=MAX_AGE_S,
        metavar="SECONDS",
        help="nonstop, with a budget: the interval's steps take at most this long, as the runtime's "
        "(default %(default)s)",
    )
    sim.add_argument("--spares-per-node", type=int, default=1, help="nonstop process spares per node")
    sim.add_argument(
        "--spare-nodes", type=int, default=None, help="spare nodes, every strategy (default 1%%)"
    )
    sim.add_argument("--persist-every-s", type=float, default=1800.0, help="nonstop persist interval")
    sim.add_argument(
        "--stall-s", type=float, default=None, help="nonstop stall per snapshot (default: calibrated)"
    )
    sim.add_argument(
        "--quarantine", default="3/600", help="nonstop quarantine: FAILURES/WINDOW_S (default %(default)s)"
    )


def _nonstop_elastic(sim: argparse.ArgumentParser) -> None:
    """``simulate``'s nonstop elastic settings: shrinking, its batch, waiting, survivors."""
    sim.add_argument(
        "--min-world-size",
        type=int,
        default=0,
        metavar="N",
        help="nonstop elastic: a lost node no hot spare can replace is dropped and the job trains on "
        "with fewer ranks (GPUs), never fewer than N, until a fresh node joins; 0 never shrinks: "
        "wait for the fresh node (default %(default)s)",
    )
    sim.add_argument(
        "--shards-per-rank",
        type=int,
        default=1,
        metavar="M",
        help="nonstop elastic: micro-batches each rank plays per step at full size; a shrunk job "
        "spreads a lost rank's over more ranks (default %(default)s)",
    )
    sim.add_argument(
        "--shrink-batch",
        choices=SHRINK_BATCHES,
        default="keep",
        help="nonstop elastic, while shrunk: keep the global batch (the lost ranks' shards played by "
        "the others: slower steps) or drop the lost ranks' shares (torchft's semantics: full-speed "
        "steps, fewer samples) (default %(default)s)",
    )
    sim.add_argument(
        "--elastic-wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="nonstop elastic: wait this long for the fresh node before shrinking (default %(default)s)",
    )
    sim.add_argument(
        "--survivors",
        choices=[m.value for m in SurvivorMode],
        default=SurvivorMode.AUTO.value,
        help="nonstop elastic, a failure a hot spare could take: auto (the runtime's policy chooses "
        "with this job's costs at scale), wait (replace first), continue (shrink first, the spare "
        "joins by a grow) (default %(default)s)",
    )


def _nonstop_groups(sim: argparse.ArgumentParser) -> None:
    """``simulate``'s nonstop layout: replica groups, what a failure rebuilds, rescues."""
    sim.add_argument(
        "--replica-nodes",
        type=int,
        default=None,
        metavar="N",
        help="nonstop: the job is HSDP over replica groups of N nodes, so a live migration or a "
        "grow rebuilds only the groups with the moved node's ranks in them, and an elastic job "
        "shrinks by whole groups; 0: data-parallel, one group of the whole job, shrinking by "
        "nodes (default: torchft-like's replica groups, --group-nodes, 16: the same job)",
    )
    sim.add_argument(
        "--keep-groups-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nonstop: a failure also rebuilds only the groups with a replaced rank in them, as "
        "the runtime does (train/settle.py; on NCCL train/devicegroups.py, untested on a GPU); "
        "--no-keep-groups-on-failure charges every group (default: keep; docs/simulator.md)",
    )
    sim.add_argument(
        "--rescue",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="nonstop: with --snapshot-every > 1 the survivors write the state after their last "
        "completed step on a failure and a lost rank takes another model copy's, as the runtime "
        "does (policy/rescue.py): only the step in flight is lost (default: on)",
    )


def _add_advise(sub: Any) -> None:
    """``advise``: the cluster, the candidates' draws, proactive migration, the goal."""
    adv = sub.add_parser(
        "advise", help="choose nonstop's settings for a cluster and show the goodput frontier"
    )
    _job_args(adv, days=14.0)
    adv.add_argument("--host-mem-gb", type=float, default=1024.0, help="host memory per node for snapshots")
    adv.add_argument("--seeds", type=int, default=2, help="failure draws per candidate (default %(default)s)")
    adv.add_argument("--trace", default=None, help="also evaluate proactive migration on a spot trace")
    adv.add_argument(
        "--horizon-min", type=int, default=5, help="prediction horizon, minutes (60 s intervals)"
    )
    adv.add_argument(
        "--threshold", type=float, default=0.5, help="predicted drop (nodes) that triggers a move"
    )
    adv.add_argument("--ar-order", type=int, default=3, help="AR order on differenced availability")
    adv.add_argument(
        "--replica-nodes",
        type=int,
        default=None,
        metavar="N",
        help="the job's layout, as for simulate (default: model copies of 16 nodes)",
    )
    adv.add_argument(
        "--may-drop-batch",
        action="store_true",
        help="the job may train a smaller batch while shrunk (--shrink-batch drop, torchft's "
        "semantics): the advisor tries it too; without, every step keeps the global batch",
    )
    adv.add_argument(
        "--ettr-goal",
        type=float,
        default=None,
        metavar="FRACTION",
        help="choose the setting with the best goodput per provisioned GPU among those whose ETTR "
        "reaches this, e.g. 0.998 (none does: the highest ETTR, and the exit status is 3)",
    )


def _job(ns: argparse.Namespace) -> JobSpec:
    return JobSpec(
        num_gpus=ns.gpus,
        gpus_per_node=ns.gpus_per_node,
        days=ns.days,
        nodes_per_domain=ns.nodes_per_domain,
        state_bytes_per_gpu=ns.state_gb * 1e9,
        step_s=ns.step_s,
    )


def _model(ns: argparse.Namespace) -> FailureModel:
    base = preset(ns.preset)
    require(ns.rate is None or ns.rate >= 0, f"--rate must be >= 0; got {ns.rate}")
    return FailureModel(
        name=base.name if ns.rate is None else f"{base.name}@{ns.rate}",
        rate_per_node_day=base.rate_per_node_day if ns.rate is None else ns.rate / 1000.0,
        shape=ns.weibull_shape,
        planned_per_node_day=base.planned_per_node_day,
        causes=base.causes,
        lemon_fraction=ns.lemon_fraction,
        lemon_factor=ns.lemon_factor,
        source=base.source,
    )


def _failslow(ns: argparse.Namespace) -> FailSlowModel | None:
    if not ns.fail_slow:
        return None
    return FailSlowModel(
        rate_per_gpu_hour=ns.fail_slow_rate, warned_fraction=ns.warned_fraction, lead_s=ns.lead_s
    )


def _quarantine(spec: str) -> QuarantinePolicy:
    try:
        n, w = spec.split("/")
        return QuarantinePolicy(max_failures=int(n), window_s=float(w))
    except ValueError as e:
        raise UsageError(f"--quarantine wants FAILURES/WINDOW_S like 3/600; got {spec!r}") from e


def build_strategies(
    names: list[str], job: JobSpec, model: FailureModel, cal: Calibration, ns: argparse.Namespace
) -> list[Strategy]:
    out: list[Strategy] = []
    for name in names:
        if name == "checkpoint-restart":
            interval = ns.ckpt_interval_s
            if interval is None:  # the exact optimum for its blocking cost, but never below the write
                lam = model.job_rate_per_s(job.num_nodes) or 1e-12
                blocking = cal.dcp_blocking_s(job.state_bytes_per_gpu)
                write = cal.durable_write_s(job.state_bytes_per_gpu, job.num_gpus, job.gpus_per_node)
                interval = max(optimal_interval(ckpt_s=max(blocking, 1e-9), rate_per_s=lam), write)
            out.append(
                CheckpointRestart(job=job, interval_s=interval, calibration=cal, spare_nodes=ns.spare_nodes)
            )
        elif name == "torchft-like":
            out.append(
                TorchftLike(job=job, group_nodes=ns.group_nodes, calibration=cal, spare_nodes=ns.spare_nodes)
            )
        else:
            params = NonstopParams(
                snapshot_every=ns.snapshot_every,
                snapshot_budget=ns.snapshot_budget,
                snapshot_max_age_s=ns.snapshot_max_age,
                stall_s=ns.stall_s,
                replicas=ns.replicas,
                spares_per_node=ns.spares_per_node,
                spare_nodes=ns.spare_nodes,
                persist_every_s=ns.persist_every_s,
                quarantine=_quarantine(ns.quarantine),
                min_world_size=ns.min_world_size,
                elastic_wait_s=ns.elastic_wait,
                shards_per_rank=ns.shards_per_rank,
                shrink_batch=ns.shrink_batch,
                survivors=SurvivorMode(ns.survivors),
                replica_nodes=ns.group_nodes if ns.replica_nodes is None else ns.replica_nodes,
                keep_on_failure=ns.keep_groups_on_failure,
                rescue=ns.rescue,
            )
            out.append(Nonstop(job=job, params=params, calibration=cal))
    return out


def _median_run(runs: list[SimResult]) -> SimResult:
    med = statistics.median_low(r.ettr for r in runs)
    return next(r for r in runs if r.ettr == med)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _simulate(ns: argparse.Namespace) -> int:
    if ns.plot is not None:  # the picture crowns minutes of simulation: say so before, not after
        require_plots("--plot")
    job = _job(ns)
    cal = load_calibration(ns.results_dir)
    model = _model(ns)
    source: EventSource = model
    if ns.trace is not None:
        require(ns.spot_notice_s >= 0, "--spot-notice-s must be >= 0")
        source = TraceFailures(trace=load_node_trace(find_trace(ns.trace)), notice_s=ns.spot_notice_s)
    require(ns.seeds >= 1, f"--seeds must be >= 1; got {ns.seeds}")
    strategies = build_strategies(ns.strategy or list(STRATEGIES), job, model, cal, ns)
    slow = _failslow(ns)
    if slow is not None:
        source = WithFailSlow(base=source, model=slow)
        for strat in list(strategies):  # what the proactive moves are worth: nonstop without them
            if isinstance(strat, Nonstop):
                blind = Nonstop(job=job, params=replace(strat.p, straggler=NO_PROACTIVE), calibration=cal)
                blind.name = NO_PROACTIVE_NAME
                strategies.insert(strategies.index(strat) + 1, blind)
    medians: list[SimResult] = []
    every: dict[str, list[dict[str, Any]]] = {}
    for strat in strategies:
        runs = [simulate(job, source, strat, seed=ns.seed + k, progress=ns.progress) for k in range(ns.seeds)]
        medians.append(_median_run(runs))
        every[strat.name] = [result_json(r) for r in runs]
    what = (
        f"trace {ns.trace}"
        if ns.trace
        else f"preset {model.name} ({model.rate_per_node_day * 1000:.2f}/1,000 node-days)"
    )
    print(
        f"{job.num_gpus:,} GPUs ({job.num_nodes:,} nodes x {job.gpus_per_node}), {job.days:g} days, {what}, "
        f"{job.state_bytes_per_gpu / 1e9:g} GB state/GPU, step {job.step_s:g} s; median of {ns.seeds} seed(s)"
    )
    print(markdown_table(medians))
    if slow is not None:
        print(failslow_summary(medians))
    for r in medians:
        if r.resizes:
            resizes = ", ".join(f"{k} {v}" for k, v in sorted(r.resizes.items()))
            speed = "" if r.shrunk_throughput is None else f" at {r.shrunk_throughput:.2f} of full speed"
            print(
                f"{r.strategy} elastic: {resizes}; trained shrunk "
                f"{r.shrunk_s / 3600 / job.days:.2f} h/day{speed}"
            )
    if ns.json is not None:
        _write_json(
            ns.json,
            {
                "command": "simulate",
                "failures": what,
                "fail_slow": None if slow is None else slow.to_json(),
                "median_runs": [result_json(r) for r in medians],
                "runs": every,
                "calibration": cal.to_json(),
            },
        )
        print(f"wrote {ns.json}")
    if ns.plot is not None:
        plot_results(medians, ns.plot, title=f"{job.num_gpus:,} GPUs, {job.days:g} days, {what}")
        print(f"wrote {ns.plot}")
    return 0


def _advise(ns: argparse.Namespace) -> int:
    if ns.plot is not None:
        require_plots("--plot")
    job = _job(ns)
    cal = load_calibration(ns.results_dir)
    model = _model(ns)
    require(ns.seeds >= 1, f"--seeds must be >= 1; got {ns.seeds}")
    adv = advise(
        job=job,
        model=model,
        calibration=cal,
        host_budget_bytes=ns.host_mem_gb * 1e9,
        seeds=tuple(range(ns.seed, ns.seed + ns.seeds)),
        may_drop_batch=ns.may_drop_batch,
        replica_nodes=ns.replica_nodes,
        goal=ns.ettr_goal,
    )
    b = adv.best
    print(
        f"advice for {job.num_gpus:,} GPUs, {job.state_bytes_per_gpu / 1e9:g} GB/GPU, preset {model.name}, "
        f"{ns.host_mem_gb:g} GB host memory/node: replicas {b.replicas}, snapshot every {b.snapshots}, "
        f"persist every {b.persist_every_s:,.0f} s, {b.spare_nodes} spare node(s), elastic "
        f"{b.elastic} -> "
        f"ETTR {b.ettr:.4f}, goodput/provisioned GPU {b.goodput_per_provisioned_gpu:.4f}"
    )
    if adv.goal_met is not None:
        print(
            f"ETTR goal {adv.goal:g}: "
            + ("met" if adv.goal_met else "not reached by any setting tried; the closest is above")
        )
    if adv.rejected_for_memory:
        print(f"replication factors over the memory budget: {adv.rejected_for_memory}")
    print(adv.table())
    doc: dict[str, Any] = {"command": "advise", **adv.to_json(), "calibration": cal.to_json()}
    slow = _failslow(ns)
    if slow is not None:
        worth = proactive_worth(
            job=job,
            model=model,
            failslow=slow,
            calibration=cal,
            params=b.params(),
            seeds=tuple(range(ns.seed, ns.seed + ns.seeds)),
        )
        print(worth.line())
        doc["proactive"] = worth.to_json()
    if ns.trace is not None:
        series = load_availability(find_trace(ns.trace), 60.0)
        probe = Nonstop(job=job, params=NonstopParams(replicas=b.replicas), calibration=cal)
        # cost of one node lost without warning vs moved proactively, in GPU-seconds of the job
        unplanned = job.num_gpus * (cal.node_lease_s + probe.transfer + probe.rebuild + job.step_s)
        proactive = job.num_gpus * probe.migration
        ev = evaluate(
            series,
            model=ARForecaster(p=ns.ar_order),
            horizon=ns.horizon_min,
            threshold=ns.threshold,
            unplanned_cost_gpu_s=unplanned,
            proactive_cost_gpu_s=proactive,
        )
        print(
            f"spot trace {series.name}: AR({ns.ar_order}) {ns.horizon_min}-min forecast MAE {ev.mae_ar:.2f} "
            f"nodes (naive {ev.mae_naive:.2f}); moves ahead of {ev.anticipated}/{ev.drops} drops "
            f"(recall {ev.recall:.0%}, precision {ev.precision:.0%}); saves "
            f"{ev.saved_gpu_s_per_day / 3600:,.1f} GPU-h/day"
            + ("" if ev.saved_gpu_s_per_day > 0 else " -> do not move proactively on this trace")
        )
        doc["spot"] = ev.to_json()
    if ns.json is not None:
        _write_json(ns.json, doc)
        print(f"wrote {ns.json}")
    if ns.plot is not None:
        plot_frontier(adv, ns.plot, title=f"{job.num_gpus:,} GPUs, preset {model.name}")
        print(f"wrote {ns.plot}")
    return 3 if adv.goal_met is False else 0


def dispatch(ns: argparse.Namespace) -> int:
    """Run ``simulate`` or ``advise``; returns the exit status."""
    if ns.cmd == "simulate":
        return _simulate(ns)
    if ns.cmd == "advise":
        return _advise(ns)
    raise UsageError(f"unknown simulator command {ns.cmd!r}")


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `python -m nonstop.sim.cli`
    ap = argparse.ArgumentParser(prog="nonstop")
    add_parsers(ap.add_subparsers(dest="cmd", required=True))
    try:
        return dispatch(ap.parse_args(argv))
    except UsageError as e:
        print(f"nonstop: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
