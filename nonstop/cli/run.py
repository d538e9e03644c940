"""``nonstop run SCRIPT``: launch a training script (torchrun-like) and keep it running.

Its flags come, lowest first, from the built-in defaults, Slurm's environment, ``PET_*``,
``NONSTOP_*``, ``--config`` (or ``$NONSTOP_CONFIG``) and the command line (:func:`with_defaults`);
they become one :class:`~nonstop.config.JobConfig`, checked before anything starts (a bad value:
one line, exit 2). Exit 0 once the job is done, 1 when it failed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from nonstop.cli.configfile import load_config
from nonstop.cli.env import add_torchrun_args, env_defaults, nproc_value, resolve_torchrun
from nonstop.cli.flags.detection import detection_config, detector_args, health_args, probe_args
from nonstop.cli.flags.logs import add_level_arg, add_log_args, log_config
from nonstop.cli.flags.metrics import add_metrics_args
from nonstop.cli.flags.nodes import elastic_config, node_args, node_config, replication_config
from nonstop.cli.flags.operations import operations_config
from nonstop.cli.flags.security import add_security_args, control_config
from nonstop.cli.flags.snapshot import persist_config, resume_arg, snapshot_args, snapshot_config
from nonstop.config import JobConfig
from nonstop.errors import JobFailedError, UsageError
from nonstop.slurm import slurm_defaults

__all__ = ["add_parser", "job_config", "run", "with_defaults"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run`` to ``nonstop``'s subcommands."""
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
    resume_arg(run)
    add_torchrun_args(run)  # after every flag it gives an underscore spelling
    run.add_argument("script", nargs="?", default=None)
    run.add_argument("script_args", nargs=argparse.REMAINDER)


def with_defaults(
    ap: argparse.ArgumentParser, run: argparse.ArgumentParser, ns: argparse.Namespace, argv: list[str] | None
) -> argparse.Namespace:
    """``nonstop run``'s command line parsed again (by ``ap``, whose ``run`` subparser is ``run``)
    over the defaults given, lowest first, by Slurm's environment, ``PET_*``, ``NONSTOP_*`` and
    ``--config`` (or ``$NONSTOP_CONFIG``): the command line wins over all (:mod:`nonstop.cli.env`);
    then torchrun's forms resolved. UsageError for a bad value or no script."""
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


def job_config(ns: argparse.Namespace) -> JobConfig:
    """The job's config from ``nonstop run``'s flags (after :func:`with_defaults`): the job's own
    fields and one part per component, each built from its flags (``nonstop/cli/flags/``) and
    validated alone, then the whole; UsageError (one line) for a bad value."""
    return JobConfig(
        script=f"-m {ns.script}" if ns.module else ns.script,
        script_args=tuple(ns.script_args),
        nproc_per_node=ns.nproc_per_node,
        spares=ns.spares,
        job_dir=ns.job_dir,
        host=ns.host,
        port=ns.port,
        max_restarts=ns.max_restarts,
        faults=tuple(ns.fail),
        extra_env=tuple(log_config(ns).to_env().items()),
        **node_config(ns),  # type: ignore[arg-type]
        detection=detection_config(ns),  # first, as the detector's flags were checked before
        snapshot=snapshot_config(ns),
        persist=persist_config(ns),
        replication=replication_config(ns),
        elastic=elastic_config(ns),
        control=control_config(ns),
        operations=operations_config(ns),
    )


def run(ns: argparse.Namespace) -> int:
    """Run the job to its end; 0 when done. JobFailedError (exit 1) when it is not."""
    from nonstop.coordinator.loop import JobState
    from nonstop.launch.launcher import run_job

    cfg = job_config(ns)
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
