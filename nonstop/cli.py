"""The ``nonstop`` command: ``run``, ``demo``, ``persist``, ``inspect``, ``export``, ``gc``, ``simulate``,
``advise``.

User errors print one line (``nonstop: error: ...``) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from nonstop.cliargs import (
    detector,
    detector_args,
    health,
    health_args,
    node_args,
    node_config,
    probe_args,
    probes,
    snapshot_args,
    snapshot_config,
)
from nonstop.cliconfig import load_config
from nonstop.clienv import add_torchrun_args, env_defaults, nproc_value, resolve_torchrun
from nonstop.clilogs import add_level_arg, add_log_args, log_config, log_level
from nonstop.climetrics import add_metrics_args, add_watch_args, watch_status
from nonstop.clisecurity import add_security_args, security_config
from nonstop.config import SURVIVOR_MODES, JobConfig
from nonstop.errors import JobFailedError, NonstopError, UsageError
from nonstop.policy.cadence import DEFAULT_BUDGET
from nonstop.progress import add_progress_args
from nonstop.slurm import slurm_defaults
from nonstop.workerlog import setup_logging

__all__ = ["main"]


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The CLI's parser and its ``run`` subparser (which ``--config`` and Slurm give defaults)."""
    ap = argparse.ArgumentParser(
        prog="nonstop", description="Keep PyTorch training running through failures."
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    add_level_arg(ap, top=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    from nonstop.sim import cli as sim_cli  # `nonstop simulate`, `nonstop advise`

    sim_cli.add_parsers(sub)
    from nonstop.chaos import cli as chaos_cli  # `nonstop chaos`

    chaos_cli.add_parsers(sub)

    run = sub.add_parser("run", help="launch a training script (torchrun-like)")
    run.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="read flags from a TOML file (keys: the long flag names, e.g. nproc-per-node = 4; "
        "script, script-args); flags on the command line override it",
    )
    run.add_argument(
        "--nproc-per-node",
        type=nproc_value,
        default=1,
        metavar="N|gpu|auto",
        help="ranks per node; gpu: one per visible GPU; auto: that, or one per CPU without GPUs (default 1)",
    )
    run.add_argument("--spares", type=int, default=0, help="hot spare processes to keep ready")
    run.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    run.add_argument("--host", default="127.0.0.1", help="address the control server binds")
    run.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    run.add_argument("--max-restarts", type=int, default=10)
    run.add_argument("--fail", action="append", default=[], metavar="SPEC", help="inject a fault (see demo)")
    run.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name")
    detector_args(run)
    health_args(run)  # issue 21: --straggler, --on-degraded
    probe_args(run)  # issue 21: --probe-period, --health-cmd, --health-timeout
    snapshot_args(run)
    node_args(run)
    add_security_args(run)
    add_metrics_args(run)
    add_log_args(run)
    add_level_arg(run)
    run.add_argument(
        "--resume",
        default=None,
        metavar="URL",
        help="restart the whole job from the newest good checkpoint here",
    )
    add_torchrun_args(run)  # after every flag it gives an underscore spelling
    run.add_argument("script", nargs="?", default=None)
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    demo = sub.add_parser("demo", help="train the demo model with injected failures")
    demo.add_argument("--nproc", type=int, default=3, help="ranks per node")
    demo.add_argument("--nnodes", type=int, default=1, help="nodes, each a separate agent on this machine")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--spares", type=int, default=1)
    demo.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    demo.add_argument(
        "--fail",
        action="append",
        default=[],
        metavar="SPEC",
        help="kill:rank=R,step=S | hang:rank=R,step=S | stall:rank=R,step=S | spin:rank=R,step=S | "
        "exit:rank=R,step=S,code=C | "
        "slow:rank=R,step=S,seconds=X | node:node=I,step=S "
        "(add ,at=recovery to fire during a recovery); repeatable",
    )
    demo.add_argument(
        "--verify",
        action="store_true",
        help="also run without faults and check the final weights are bitwise equal",
    )
    demo.add_argument(
        "--mesh",
        default=None,
        metavar="replicate=R,shard=S,tp=T",
        help="train the sharded demo on this mesh (FSDP2 on shard, HSDP with replicate, tensor "
        "parallel on tp; the product is nnodes x nproc); --verify compares every rank's shards",
    )
    demo.add_argument(
        "--min-world-size",
        type=int,
        default=0,
        metavar="N",
        help="elastic: the job may shrink to N ranks (the demo reads its batches by data shard)",
    )
    demo.add_argument(
        "--survivors",
        choices=SURVIVOR_MODES,
        default="auto",
        help="elastic: on a failure a spare could replace, 'continue' goes on without the rank at "
        "once and the spare joins at a step boundary; 'wait' waits for the spare (default %(default)s)",
    )
    demo.add_argument(
        "--snapshot-every",
        type=int,
        default=1,
        metavar="K",
        help="snapshot every K steps: a failure redoes up to K-1 steps past the last snapshot "
        "(--verify still compares bitwise; default %(default)s)",
    )
    demo.add_argument(
        "--snapshot-budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="FRACTION",
        help="tune the interval to this stall budget, as `nonstop run --snapshot-budget` (0: keep "
        "--snapshot-every; default %(default)s)",
    )
    demo.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    demo.add_argument("--job-dir", type=Path, default=Path(".nonstop/demo"))
    detector_args(demo)
    health_args(demo)  # issue 21: --straggler, --on-degraded
    add_security_args(demo, etcd=False)
    add_metrics_args(demo)
    add_level_arg(demo)

    persist = sub.add_parser("persist", help="make a running job's committed step durable now")
    persist.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    persist.add_argument("--timeout", type=float, default=300.0)
    add_progress_args(persist)

    status = sub.add_parser("status", help="a running job: ranks, nodes, spares, steps, tiers, migration")
    status.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    add_watch_args(status)

    migrate = sub.add_parser("migrate", help="move a rank of a running job live to another node")
    migrate.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    migrate.add_argument("--rank", type=int, required=True)
    migrate.add_argument(
        "--to", default=None, metavar="NODE", help="target node (default: the policy's choice)"
    )
    migrate.add_argument("--timeout", type=float, default=300.0)

    drain = sub.add_parser("drain", help="move every rank off a node of a running job (maintenance)")
    drain.add_argument("node", help="the node (its --node-rank)")
    drain.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    drain.add_argument("--timeout", type=float, default=300.0)

    inspect = sub.add_parser("inspect", help="list the checkpoints at a durable URL and verify them")
    inspect.add_argument("url", help="a directory or fsspec URL (e.g. .nonstop/job/checkpoints)")
    inspect.add_argument("--no-verify", action="store_true", help="skip reading every chunk")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    add_progress_args(inspect)

    timeline = sub.add_parser(
        "timeline", help="draw a job's event log: ranks, failures, recovery stages, nodes, tiers"
    )
    timeline.add_argument(
        "path", nargs="?", type=Path, default=Path(".nonstop/job"), help="a job dir or its events.jsonl"
    )
    timeline.add_argument(
        "--out",
        type=Path,
        default=None,
        help="file to write: .png, .svg, .pdf, or .json for a trace (default JOB_DIR/timeline.png)",
    )
    timeline.add_argument(
        "--format",
        choices=("png", "svg", "pdf", "trace"),
        default=None,
        help="trace: Chrome-trace/Perfetto JSON (default JOB_DIR/timeline.trace.json); default: by --out",
    )
    timeline.add_argument("--text-only", action="store_true", help="print the summary, draw nothing")

    from nonstop.checkpoint.cli import add_export_parser

    add_export_parser(sub)

    gc = sub.add_parser("gc", help="remove shared memory and processes left by crashed jobs")
    gc.add_argument("--dry-run", action="store_true")
    return ap, run


def main(argv: list[str] | None = None) -> int:
    ap, run = _parser()
    ns = ap.parse_args(argv)
    try:
        if ns.cmd == "run":
            ns = _with_defaults(ap, run, ns, argv)
        setup_logging(log_level(ns))
        return _dispatch(ns)
    except UsageError as e:
        print(f"nonstop: error: {e}", file=sys.stderr)
        return 2
    except JobFailedError as e:
        print(f"nonstop: job failed: {e}", file=sys.stderr)
        return 1
    except NonstopError as e:
        print(f"nonstop: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _with_defaults(
    ap: argparse.ArgumentParser, run: argparse.ArgumentParser, ns: argparse.Namespace, argv: list[str] | None
) -> argparse.Namespace:
    """``nonstop run``'s command line parsed again over the defaults given, lowest first, by
    Slurm's environment, ``PET_*``, ``NONSTOP_*`` and ``--config`` (or ``$NONSTOP_CONFIG``): the
    command line wins over all (:mod:`nonstop.clienv`); then torchrun's forms resolved."""
    defaults = slurm_defaults(os.environ)
    defaults.update(env_defaults(run, os.environ, "PET_"))
    defaults.update(env_defaults(run, os.environ, "NONSTOP_"))
    config = ns.config if ns.config is not None else os.environ.get("NONSTOP_CONFIG") or None
    if config is not None:
        defaults.update(load_config(Path(config), run))
    if defaults:
        run.set_defaults(**defaults)
        ns = ap.parse_args(argv)
    if ns.script is None:
        raise UsageError("nonstop run needs the training script: give it last, or as script in --config")
    resolve_torchrun(ns)
    return ns


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.cmd in ("simulate", "advise"):
        from nonstop.sim.cli import dispatch as sim_dispatch

        return sim_dispatch(ns)
    if ns.cmd == "chaos":
        from nonstop.chaos.cli import dispatch as chaos_dispatch

        return chaos_dispatch(ns)
    if ns.cmd == "run":
        from nonstop.coordinator.loop import JobState
        from nonstop.launch.launcher import run_job

        cfg = JobConfig(
            script=f"-m {ns.script}" if ns.module else ns.script,
            script_args=tuple(ns.script_args),
            nproc_per_node=ns.nproc_per_node,
            spares=ns.spares,
            job_dir=ns.job_dir,
            host=ns.host,
            port=ns.port,
            max_restarts=ns.max_restarts,
            faults=tuple(ns.fail),
            detector=detector(ns),
            straggler=health(ns),
            probes=probes(ns),  # issue 21: each agent's health probes
            resume=ns.resume,
            metrics_port=ns.metrics_port,
            extra_env=tuple(log_config(ns).to_env().items()),
            **snapshot_config(ns),  # type: ignore[arg-type]
            **node_config(ns),  # type: ignore[arg-type]
            **security_config(ns),  # type: ignore[arg-type]
        )
        result = run_job(cfg)
        if cfg.node_rank != 0:
            if result.state is not JobState.DONE:
                raise JobFailedError(f"node {cfg.node_rank}: {result.error or result.state}")
            print(f"nonstop: node {cfg.node_rank} finished its part of the job")
            return 0
        if result.state is not JobState.DONE:
            raise JobFailedError(result.error or str(result.state))
        print(
            f"nonstop: job done at step {result.final_step}, generation {result.generation}, "
            f"{len(result.failures)} failure(s) recovered; events in {ns.job_dir / 'events.jsonl'}"
        )
        return 0
    if ns.cmd == "demo":
        from nonstop.demo.runner import DemoOptions, run_demo

        opts = DemoOptions(
            nproc=ns.nproc,
            nnodes=ns.nnodes,
            steps=ns.steps,
            spares=ns.spares,
            model=ns.model,
            faults=tuple(ns.fail),
            verify=ns.verify,
            job_dir=ns.job_dir,
            detector=detector(ns),
            straggler=health(ns),
            mesh=ns.mesh,
            min_world_size=ns.min_world_size,
            survivors=ns.survivors,
            snapshot_every=ns.snapshot_every,
            snapshot_budget=ns.snapshot_budget,
            tls=ns.tls,
            metrics_port=ns.metrics_port,
        )
        report = run_demo(opts)
        if ns.json is not None:
            ns.json.parent.mkdir(parents=True, exist_ok=True)
            ns.json.write_text(json.dumps(report, indent=2))
        return 0 if report["equal"] in (None, True) else 1
    if ns.cmd == "persist":
        from nonstop.launch.job_client import request_persist
        from nonstop.progress import wait_with_status, wanted

        reply = wait_with_status(
            lambda: request_persist(ns.job_dir, timeout=ns.timeout),
            "nonstop persist: making the committed step durable",
            show=wanted(ns.progress),
        )
        print(
            f"nonstop persist: step {reply.step} is durable at {reply.url} "
            f"({reply.stored_bytes} bytes stored)"
        )
        return 0
    if ns.cmd == "status":
        from nonstop.launch.job_client import request_status

        if ns.watch:
            return watch_status(ns.job_dir, _format_status, interval_s=ns.interval)
        st = request_status(ns.job_dir)
        print(json.dumps(st, indent=2) if ns.json else _format_status(st))
        return 0
    if ns.cmd in ("migrate", "drain"):
        from nonstop.launch.job_client import request_migration
        from nonstop.protocol.base import MigrateMsg
        from nonstop.protocol.client import DrainMsg

        req = MigrateMsg(gen=-1, rank=ns.rank, to=ns.to) if ns.cmd == "migrate" else DrainMsg(node=ns.node)
        answers = request_migration(ns.job_dir, req, timeout=ns.timeout)
        failed = 0
        for a in answers:
            if a.ok:
                ratio = a.pause_ratio
                print(
                    f"nonstop: rank {a.rank} moved {a.source} -> {a.target} at step "
                    f"{a.boundary}" + (f", longest step gap {ratio:.2f}x the median step" if ratio else "")
                )
            else:
                failed += 1
                rank = "?" if a.rank is None else a.rank
                print(f"nonstop: rank {rank} not moved: {a.error}", file=sys.stderr)
        return 1 if failed or not answers else 0
    if ns.cmd == "inspect":
        from nonstop.progress import inspect_report, wanted
        from nonstop.snapshot.durable import format_inspect

        report = inspect_report(
            ns.url, verify=not ns.no_verify, show=wanted(ns.progress, json_output=ns.json)
        )
        print(json.dumps(report, indent=2) if ns.json else format_inspect(report))
        return 0
    if ns.cmd == "timeline":
        from nonstop.timeline import load_timeline, timeline_text
        from nonstop.timeline.output import picture_skipped, write_timeline

        skipped = None if ns.text_only else picture_skipped(out=ns.out, fmt=ns.format)  # no matplotlib
        tl = load_timeline(ns.path)
        print(timeline_text(tl))
        if skipped is not None:
            print(f"nonstop: {skipped}", file=sys.stderr)
        elif not ns.text_only:
            out, what = write_timeline(tl, job=ns.path, out=ns.out, fmt=ns.format)
            print(f"nonstop: timeline {'drawn' if what == 'picture' else 'trace written'} to {out}")
        return 0
    if ns.cmd == "export":
        from nonstop.checkpoint.cli import run_export

        return run_export(ns)
    if ns.cmd == "gc":
        from nonstop.agent.gc import collect_garbage
        from nonstop.launch.launcher import default_shm_dir

        rep = collect_garbage(default_shm_dir(), dry_run=ns.dry_run)
        verb = "would remove" if ns.dry_run else "removed"
        print(
            f"nonstop gc: {verb} {len(rep.segments)} segment(s) of {len(rep.jobs)} orphaned job(s), "
            f"killed {len(rep.killed)} process(es); {len(rep.live_jobs)} live job(s) left alone"
            + (f"; {len(rep.skipped)} path(s) it may not touch skipped" if rep.skipped else "")
        )
        for path in rep.skipped:
            print(f"  skipped {path}")
        return 0
    raise AssertionError(ns.cmd)


def _format_status(st: dict[str, object]) -> str:
    """``nonstop status`` for a person: one line for the job, one per node, one per rank."""
    lines = [
        f"job {st.get('job_id')}: {st.get('state')}, generation {st.get('generation')}, "
        f"{st.get('world_size')} ranks, {st.get('failures')} failure(s); store {st.get('store')}",
        f"steps: committed {st.get('committed_step')}, replicated {st.get('replicated_step')}, "
        f"durable {st.get('durable_step')} ({st.get('durable_url')})",
    ]
    nodes = st.get("nodes")
    if isinstance(nodes, dict):
        for name, n in nodes.items():
            what = "alive" if n["alive"] else ("quarantined" if n["quarantined"] else "lost")
            lines.append(
                f"node {name} [{n['domain']}]: {what}, ranks {n['ranks']}, {n['idle_spares']} idle spare(s), "
                f"{n['failures']} failure(s)"
            )
    ranks = st.get("ranks")
    shards = st.get("shards")
    full = st.get("full_world_size", st.get("num_shards"))
    shrunk = full not in (None, st.get("world_size"))
    if isinstance(ranks, dict):
        for r, info in ranks.items():
            played = f", shards {shards.get(r)}" if shrunk and isinstance(shards, dict) else ""
            lines.append(
                f"rank {r}: node {info['node']}, spawn {info['spawn_id']}, pid {info['pid']}, "
                f"step {info['step']}{played}"
            )
    if shrunk:
        lines.append(
            f"elastic: shrunk to {st.get('world_size')} of {full} ranks (minimum {st.get('min_world_size')})"
        )
    grow = st.get("growing")
    if isinstance(grow, dict):
        lines.append(f"growing to {grow['to']} ranks at step {grow['boundary']}")
    m = st.get("migration")
    if isinstance(m, dict):
        lines.append(
            f"migration: rank {m['rank']} {m['source']} -> {m['target']}, {m['phase']}"
            + (f" at step {m['boundary']}" if m.get("boundary") is not None else "")
        )
    if st.get("queued_migrations"):
        lines.append(f"queued migrations: ranks {st['queued_migrations']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
