"""The ``nonstop`` command: ``run``, ``demo``, ``persist``, ``inspect``, ``gc``, ``simulate``, ``advise``.

User errors print one line (``nonstop: error: ...``) and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from nonstop.climetrics import add_metrics_args, add_watch_args, watch_status
from nonstop.clisecurity import add_security_args, security_config
from nonstop.config import SNAPSHOT_MODES, SURVIVOR_MODES, SWAP_TRANSFERS, DetectorConfig, JobConfig
from nonstop.errors import JobFailedError, NonstopError, UsageError

__all__ = ["main"]


def _detector_args(p: argparse.ArgumentParser) -> None:
    d = DetectorConfig()
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=d.heartbeat_timeout_s,
        help="seconds of heartbeat silence before a worker counts as hung (default %(default)s)",
    )
    p.add_argument(
        "--hang-factor",
        type=float,
        default=d.hang_factor,
        help="no progress for this many median step times counts as a hang (default %(default)s)",
    )
    p.add_argument(
        "--hang-min-s",
        type=float,
        default=d.hang_min_s,
        help="floor of the progress-based hang timeout, seconds (default %(default)s)",
    )


def _detector(ns: argparse.Namespace) -> DetectorConfig:
    return DetectorConfig(
        heartbeat_timeout_s=ns.heartbeat_timeout, hang_factor=ns.hang_factor, hang_min_s=ns.hang_min_s
    )


def _snapshot_args(p: argparse.ArgumentParser) -> None:
    c = JobConfig(script="")
    p.add_argument(
        "--snapshot",
        choices=SNAPSHOT_MODES,
        default=c.snapshot,
        help="per-step capture: overlapped with the next step, sync, or off (default %(default)s)",
    )
    p.add_argument(
        "--persist",
        default=None,
        metavar="URL",
        help="durable tier: directory or fsspec URL (default JOB_DIR/checkpoints)",
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=c.persist_every,
        help="persist the committed step every N steps, lazily; 0: only on demand, SIGTERM and exit "
        "(default %(default)s)",
    )
    p.add_argument(
        "--keep", type=int, default=c.keep, help="durable checkpoints to retain (default %(default)s)"
    )
    p.add_argument(
        "--lossy", action="store_true", help="quantise delta checkpoints (optimizer moments, weight deltas)"
    )
    p.add_argument("--lossy-bits", type=int, default=c.lossy_bits, help="4 or 8 (default %(default)s)")


def _snapshot_config(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "snapshot": ns.snapshot,
        "persist_url": ns.persist,
        "persist_every": ns.persist_every,
        "keep": ns.keep,
        "lossy": ns.lossy,
        "lossy_bits": ns.lossy_bits,
    }


def _node_args(p: argparse.ArgumentParser) -> None:
    c = JobConfig(script="")
    g = p.add_argument_group("many nodes")
    g.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default %(default)s)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index; node 0 hosts the coordinator")
    g.add_argument(
        "--coordinator", default=None, metavar="HOST:PORT", help="where node 0 listens and the others connect"
    )
    g.add_argument(
        "--domain", default=None, help="this node's failure domain (rack, zone); replicas avoid it"
    )
    g.add_argument(
        "--store",
        default=c.store,
        help="control store: embedded:// (default; the coordinator lives in node 0's process) or "
        "etcd://HOST:PORT (job state and node leases in etcd: the coordinator runs as its own process "
        "and may restart without stopping the job; needs --secret-file, the etcd password); "
        "etcds://HOST:PORT: the same over TLS (--etcd-ca, --etcd-cert, --etcd-key)",
    )
    g.add_argument(
        "--reconnect",
        type=float,
        default=c.reconnect_s,
        help="with --store etcd: seconds agents and workers wait for a restarted coordinator "
        "(default %(default)s)",
    )
    g.add_argument(
        "--data-host",
        default=None,
        help="address this node's data plane (peer replicas) binds and advertises "
        "(default: node 0 the coordinator's host; others the local address that reaches it)",
    )
    g.add_argument(
        "--lease-ttl",
        type=float,
        default=c.lease_ttl_s,
        help="seconds without a lease renewal after which a node is lost (default %(default)s)",
    )
    g.add_argument(
        "--replicas",
        type=int,
        default=c.replicas,
        help="peer copies of each rank's snapshot (default %(default)s)",
    )
    g.add_argument("--replica-bandwidth", type=float, default=None, metavar="MB/S", help="cap on replication")
    g.add_argument(
        "--secret-file",
        type=Path,
        default=None,
        help="job secret (default: JOB_DIR/secret, written by node 0)",
    )
    g.add_argument("--quarantine-failures", type=int, default=c.quarantine_failures)
    g.add_argument("--quarantine-window", type=float, default=c.quarantine_window_s, metavar="SECONDS")
    g.add_argument("--join-timeout", type=float, default=c.join_timeout_s, metavar="SECONDS")
    g.add_argument(
        "--preempt-grace",
        type=float,
        default=c.preempt_grace_s,
        metavar="SECONDS",
        help="SIGTERM to a node (not node 0) is a preemption notice: its ranks move live to other nodes "
        "within this grace; also JOB_DIR/preempt-node-N appearing (content: grace seconds)",
    )
    g.add_argument(
        "--preempt-url",
        default=None,
        metavar="URL",
        help="poll this HTTP endpoint for a preemption notice (a cloud metadata service, e.g. AWS "
        ".../spot/instance-action, GCP .../instance/preempted, Azure scheduled events); '{node}' is "
        "replaced by the node rank",
    )
    g.add_argument(
        "--preempt-header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="header of the notice request (e.g. 'Metadata-Flavor: Google'); repeatable",
    )
    g.add_argument(
        "--preempt-poll",
        type=float,
        default=c.preempt_poll_s,
        metavar="SECONDS",
        help="how often the notice endpoint is polled (default %(default)s)",
    )
    g.add_argument(
        "--min-world-size",
        type=int,
        default=c.min_world_size,
        metavar="N",
        help="elastic: when a rank cannot be replaced (no hot spare left), go on with fewer ranks, "
        "down to N, keeping the global batch by gradient accumulation; grow back when a node joins "
        "(default 0: never shrink)",
    )
    g.add_argument(
        "--elastic-wait",
        type=float,
        default=c.elastic_wait_s,
        metavar="SECONDS",
        help="elastic: wait this long for a spare before shrinking (default %(default)s)",
    )
    g.add_argument(
        "--survivors",
        choices=SURVIVOR_MODES,
        default=c.survivors,
        help="elastic: a failed rank a hot spare could take: 'continue' goes on without it at once "
        "(its data shards played by the others) and the spare joins at a step boundary; 'wait' "
        "has every rank wait for the spare's restore; 'auto' chooses per failure by the restore "
        "and step times measured (default %(default)s)",
    )
    g.add_argument(
        "--shards-per-rank",
        type=int,
        default=c.shards_per_rank,
        metavar="M",
        help="data shards (micro-batches, by gradient accumulation) each rank plays per step at full "
        "size: the script's Session.shard_steps yields them; with M > 1 a shrunk job spreads a lost "
        "rank's shards over more ranks (default %(default)s)",
    )
    g.add_argument(
        "--swap-transfer",
        choices=SWAP_TRANSFERS,
        default=c.swap_transfer,
        help="how a live migration's swap brings the boundary step to the joiner's node: as a delta "
        "against the step its catch-up fetched, the whole step, or auto: a delta when the catch-up "
        "measured deltas faster (a slow link) (default %(default)s)",
    )
    g.add_argument(
        "--mesh",
        default=c.mesh,
        metavar="replicate=R,shard=S,tp=T",
        help="a sharded job's device mesh (any subset of the dims; their product is the world size, "
        "tp divides --nproc-per-node): the script trains through Session.run(build=...), which "
        "builds its FSDP2 / HSDP / TP model on that mesh (default: data-parallel DDP)",
    )
    g.add_argument(
        "--rebuild-all-groups",
        action="store_true",
        help="a sharded job builds every mesh group again in each new generation; by default a "
        "group whose members all left the last one at a step boundary, unchanged, is kept",
    )


def _node_config(ns: argparse.Namespace) -> dict[str, object]:
    return {
        "nnodes": ns.nnodes,
        "node_rank": ns.node_rank,
        "coordinator": ns.coordinator,
        "domain": ns.domain,
        "data_host": ns.data_host,
        "store": ns.store,
        "reconnect_s": ns.reconnect,
        "lease_ttl_s": ns.lease_ttl,
        "replicas": ns.replicas,
        "replica_bandwidth_mb_s": ns.replica_bandwidth,
        "secret_file": ns.secret_file,
        "quarantine_failures": ns.quarantine_failures,
        "quarantine_window_s": ns.quarantine_window,
        "join_timeout_s": ns.join_timeout,
        "preempt_grace_s": ns.preempt_grace,
        "preempt_url": ns.preempt_url,
        "preempt_headers": tuple(ns.preempt_header),
        "preempt_poll_s": ns.preempt_poll,
        "min_world_size": ns.min_world_size,
        "elastic_wait_s": ns.elastic_wait,
        "survivors": ns.survivors,
        "swap_transfer": ns.swap_transfer,
        "shards_per_rank": ns.shards_per_rank,
        "mesh": ns.mesh,
        "keep_groups": not ns.rebuild_all_groups,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="nonstop", description="Keep PyTorch training running through failures."
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)
    from nonstop.sim import cli as sim_cli  # `nonstop simulate`, `nonstop advise`

    sim_cli.add_parsers(sub)
    from nonstop.chaos import cli as chaos_cli  # `nonstop chaos`

    chaos_cli.add_parsers(sub)

    run = sub.add_parser("run", help="launch a training script (torchrun-like)")
    run.add_argument("--nproc-per-node", type=int, default=1)
    run.add_argument("--spares", type=int, default=0, help="hot spare processes to keep ready")
    run.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    run.add_argument("--host", default="127.0.0.1", help="address the control server binds")
    run.add_argument("--port", type=int, default=0, help="control port (0: any free port)")
    run.add_argument("--max-restarts", type=int, default=10)
    run.add_argument("--fail", action="append", default=[], metavar="SPEC", help="inject a fault (see demo)")
    run.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name")
    _detector_args(run)
    _snapshot_args(run)
    _node_args(run)
    add_security_args(run)
    add_metrics_args(run)
    run.add_argument(
        "--resume",
        default=None,
        metavar="URL",
        help="restart the whole job from the newest good checkpoint here",
    )
    run.add_argument("script")
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
        help="kill:rank=R,step=S | hang:rank=R,step=S | stall:rank=R,step=S | exit:rank=R,step=S,code=C | "
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
    demo.add_argument("--json", type=Path, default=None, help="write the report as JSON here")
    demo.add_argument("--job-dir", type=Path, default=Path(".nonstop/demo"))
    _detector_args(demo)
    add_security_args(demo, etcd=False)
    add_metrics_args(demo)

    persist = sub.add_parser("persist", help="make a running job's committed step durable now")
    persist.add_argument("--job-dir", type=Path, default=Path(".nonstop/job"))
    persist.add_argument("--timeout", type=float, default=300.0)

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
        help="picture to write: .png, .svg or .pdf (default JOB_DIR/timeline.png)",
    )
    timeline.add_argument("--text-only", action="store_true", help="print the summary, draw nothing")

    gc = sub.add_parser("gc", help="remove shared memory and processes left by crashed jobs")
    gc.add_argument("--dry-run", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if ns.verbose else logging.WARNING, format="nonstop: %(levelname)s %(message)s"
    )
    try:
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


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.cmd in ("simulate", "advise"):
        from nonstop.sim.cli import dispatch as sim_dispatch

        return sim_dispatch(ns)
    if ns.cmd == "chaos":
        from nonstop.chaos.cli import dispatch as chaos_dispatch

        return chaos_dispatch(ns)
    if ns.cmd == "run":
        from nonstop.runtime.coordinator import JobState
        from nonstop.runtime.launcher import run_job

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
            detector=_detector(ns),
            resume=ns.resume,
            metrics_port=ns.metrics_port,
            **_snapshot_config(ns),  # type: ignore[arg-type]
            **_node_config(ns),  # type: ignore[arg-type]
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
            detector=_detector(ns),
            mesh=ns.mesh,
            min_world_size=ns.min_world_size,
            survivors=ns.survivors,
            tls=ns.tls,
            metrics_port=ns.metrics_port,
        )
        report = run_demo(opts)
        if ns.json is not None:
            ns.json.parent.mkdir(parents=True, exist_ok=True)
            ns.json.write_text(json.dumps(report, indent=2))
        return 0 if report["equal"] in (None, True) else 1
    if ns.cmd == "persist":
        from nonstop.runtime.client import request_persist

        reply = request_persist(ns.job_dir, timeout=ns.timeout)
        print(
            f"nonstop persist: step {reply['step']} is durable at {reply['url']} "
            f"({reply['stored_bytes']} bytes stored)"
        )
        return 0
    if ns.cmd == "status":
        from nonstop.runtime.client import request_status

        if ns.watch:
            return watch_status(ns.job_dir, _format_status, interval_s=ns.interval)
        st = request_status(ns.job_dir)
        print(json.dumps(st, indent=2) if ns.json else _format_status(st))
        return 0
    if ns.cmd in ("migrate", "drain"):
        from nonstop.runtime.client import request_migration

        req: dict[str, object] = (
            {"t": "migrate", "rank": ns.rank, "to": ns.to}
            if ns.cmd == "migrate"
            else {"t": "drain", "node": ns.node}
        )
        answers = request_migration(ns.job_dir, req, timeout=ns.timeout)
        failed = 0
        for a in answers:
            if a.get("ok"):
                ratio = a.get("pause_ratio")
                print(
                    f"nonstop: rank {a['rank']} moved {a.get('source')} -> {a.get('target')} at step "
                    f"{a.get('boundary')}"
                    + (f", longest step gap {ratio:.2f}x the median step" if ratio else "")
                )
            else:
                failed += 1
                print(f"nonstop: rank {a.get('rank', '?')} not moved: {a.get('error')}", file=sys.stderr)
        return 1 if failed or not answers else 0
    if ns.cmd == "inspect":
        from nonstop.snapshot.durable import DurableStore, format_inspect

        report = DurableStore(ns.url).describe(verify=not ns.no_verify)
        print(json.dumps(report, indent=2) if ns.json else format_inspect(report))
        return 0
    if ns.cmd == "timeline":
        from nonstop.timeline import load_timeline, render_timeline, timeline_text

        tl = load_timeline(ns.path)
        print(timeline_text(tl))
        if not ns.text_only:
            where = ns.path if ns.path.is_dir() else ns.path.parent
            out = render_timeline(tl, ns.out or where / "timeline.png")
            print(f"nonstop: timeline drawn to {out}")
        return 0
    if ns.cmd == "gc":
        from nonstop.runtime.gc import collect_garbage
        from nonstop.runtime.launcher import default_shm_dir

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


if __name__ == "__main__":
    sys.exit(main())


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
