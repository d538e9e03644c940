"""``nonstop chaos``: a soak of seeded random faults on real multi-node jobs on this machine.

The soak is a sequence of jobs (episodes) of the demo model, each of ``--steps`` steps on
``--nnodes`` nodes (separate processes, their state in a real etcd), plus one uninterrupted
reference job of the same size. Faults come one after another: the driver waits until the job is
healthy (every node up, its spares ready, its committed step advancing), waits a random fraction
of a second, injects the next fault of the schedule, then waits until the job trains again at full
size past the step it had committed (that is the fault's recovery time) and is whole again. When
a job nears its last step it is left to finish; its final weights must be bitwise those of the
reference, and nothing of it (segment, process) may be left; the next job takes the next faults.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nonstop.chaos import report as rep
from nonstop.chaos.checks import Checks
from nonstop.chaos.cluster import Episode, Etcd, Netns, free_port
from nonstop.chaos.inject import Injector
from nonstop.chaos.recover import Overtaken, Recoveries
from nonstop.chaos.schedule import ALL_KINDS, Planned, make_schedule
from nonstop.chaos.watch import JobWatch, Timeout
from nonstop.config import DetectorConfig
from nonstop.demo.runner import demo_job_config
from nonstop.errors import UsageError
from nonstop.launch.jobdir import hold_dir

__all__ = ["ChaosOptions", "run_chaos"]


@dataclass(frozen=True, kw_only=True)
class ChaosOptions:
    faults: int
    seed: int = 0
    nnodes: int = 3
    nproc: int = 1
    spares: int = 1
    steps: int = 400
    duration_s: float | None = None  # stop injecting after this long (the jobs still finish)
    step_delay_s: float = 0.05
    lease_ttl_s: float = 3.0
    persist_every: int = 10
    kinds: tuple[str, ...] = ALL_KINDS
    job_dir: Path = Path(".nonstop/chaos")
    timeout_s: float = 240.0  # per wait (a recovery, a node's return): generous on a busy machine

    def __post_init__(self) -> None:
        if self.faults < 0:
            raise UsageError(f"--faults must be >= 0 (got {self.faults})")
        if self.nnodes < 2:
            raise UsageError(
                f"--nnodes must be >= 2 (got {self.nnodes}): node faults need a node besides node 0"
            )
        if self.nproc < 1 or self.spares < 1:
            raise UsageError("--nproc and --spares must be >= 1 (a failed rank needs a hot spare)")
        if self.steps < 100:
            raise UsageError(f"--steps must be >= 100 (got {self.steps}): faults need room in a job")
        bad = sorted(set(self.kinds) - set(ALL_KINDS))
        if bad:
            raise UsageError(f"unknown --kinds {bad}; known: {', '.join(ALL_KINDS)}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


def available_kinds(opts: ChaosOptions) -> tuple[tuple[str, ...], dict[str, str]]:
    """The kinds this machine can inject, and why each other one is skipped."""
    skipped: dict[str, str] = {}
    why_etcd, why_netns = Etcd.unavailable(), Netns.unavailable()
    for kind in opts.kinds:
        if kind in ("coordinator", "store_stall") and why_etcd:
            skipped[kind] = why_etcd
        elif kind == "partition" and why_netns:
            skipped[kind] = why_netns
    return tuple(k for k in opts.kinds if k not in skipped), skipped


class Soak:
    """One soak: etcd, namespaces, the reference, then the episodes until the schedule is done."""

    def __init__(self, opts: ChaosOptions, *, say: Any) -> None:
        self.opts, self.say = opts, say
        self.kinds, self.skipped = available_kinds(opts)
        self.schedule = make_schedule(
            opts.faults, opts.seed, kinds=self.kinds, nnodes=opts.nnodes, world_size=opts.world_size
        )
        self.netns: Netns | None = None
        self.etcd: Etcd | None = None
        self.checks = Checks()
        self.records: list[rep.FaultRecord] = []
        self.reference: str | None = None
        self.hashes: list[dict[str, Any]] = []
        self.episodes = 0
        self.t0, self.started = time.time(), time.monotonic()

    def report(self, *, complete: bool) -> dict[str, Any]:
        """The report of what has run so far."""
        o = self.opts
        return rep.build(
            faults=self.records,
            failures=self.checks.violations,
            lost=self.checks.lost,
            equal=all(h["equal"] for h in self.hashes) if self.hashes else None,
            leaked_segments=self.checks.leaked_segments,
            leaked_processes=self.checks.leaked_processes,
            complete=complete,
            seed=o.seed,
            requested_faults=o.faults,
            schedule=[p.to_json() for p in self.schedule],
            skipped_kinds=self.skipped,
            started_at=self.t0,
            duration_s=round(time.monotonic() - self.started, 1),
            episodes=self.episodes,
            jobs=self.hashes,
            reference_hash=self.reference,
            config={
                "nnodes": o.nnodes,
                "nproc": o.nproc,
                "spares": o.spares,
                "steps": o.steps,
                "step_delay_s": o.step_delay_s,
                "lease_ttl_s": o.lease_ttl_s,
                "persist_every": o.persist_every,
                "model": "tiny",
                "store": "etcd" if self.etcd else "embedded",
                "netns": self.netns is not None,
            },
        )

    # -- setup -------------------------------------------------------------------------------------
    def setup(self) -> None:
        root = self.opts.job_dir.resolve()
        if "partition" in self.kinds:
            self.netns = Netns(self.opts.nnodes)
            try:
                self.netns.setup()
            except Exception as e:
                self.netns.teardown()
                self.netns = None
                self.skipped["partition"] = f"cannot create network namespaces here: {e}"
                self.kinds = tuple(k for k in self.kinds if k != "partition")
                self.schedule = make_schedule(
                    self.opts.faults, self.opts.seed, kinds=self.kinds,
                    nnodes=self.opts.nnodes, world_size=self.opts.world_size,
                )  # fmt: skip
        if Etcd.unavailable() is None:
            host = self.netns.addr(0) if self.netns is not None else "127.0.0.1"
            self.etcd = Etcd(root / "etcd", host=host)
            self.etcd.start()

    def teardown(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
        if self.netns is not None:
            self.netns.teardown()

    # -- one job -----------------------------------------------------------------------------------
    def episode(self, name: str) -> Episode:
        o = self.opts
        job_dir = o.job_dir.resolve() / name
        if job_dir.exists():
            shutil.rmtree(job_dir)
        host = self.netns.addr(0) if self.netns is not None else "127.0.0.1"
        coordinator = f"{host}:{free_port(host)}"
        store: dict[str, Any] = {}
        if self.etcd is not None:
            store = dict(store=self.etcd.url, secret_file=self.etcd.secret_file)
        cfg = demo_job_config(
            result=job_dir / "result.json", steps=o.steps, model="tiny", batch=4,
            script_extra=("--step-delay", str(o.step_delay_s)), nnodes=o.nnodes, nproc_per_node=o.nproc,
            spares=o.spares, job_dir=job_dir, coordinator=coordinator, lease_ttl_s=o.lease_ttl_s,
            detector=DetectorConfig(), persist_every=o.persist_every, **store,
        )  # fmt: skip
        cfg = replace(cfg, max_restarts=10_000)
        all_args = ["--quarantine-failures", "1000000", "--max-restarts", "10000"]
        node0 = ["--persist-every", str(o.persist_every)]
        return Episode(cfg, coordinator=coordinator, node0_args=node0, all_args=all_args, netns=self.netns)

    def run_reference(self) -> None:
        ep = self.episode("reference")
        self.say(f"chaos: reference run ({self.opts.steps} steps, no faults) ...")
        ep.start(self.opts.timeout_s)
        try:
            rc = ep.wait_end(self.opts.timeout_s + self.opts.steps * 2.0)
        finally:
            ep.stop()
        result = ep.job_dir / "result.json"
        if rc != 0 or not result.exists():
            raise Timeout(f"the reference run failed (node 0 exit {rc}); logs in {ep.job_dir / 'logs'}")
        self.reference = str(json.loads(result.read_text())["final_hash"])

    def run_episode(self, todo: list[Planned], deadline: float | None) -> None:
        """One job: inject faults from ``todo`` (taken off it as they go) while there is room."""
        self.episodes += 1
        n = self.episodes
        ep = self.episode(f"job-{n:03d}")
        watch = JobWatch(ep.job_dir)
        injector = Injector(ep, watch, etcd=self.etcd, netns=self.netns)
        rec = Recoveries(ep, watch, self.checks, netns=self.netns, opts=self.opts, say=self.say)
        prefix = f"job {n}: "
        ended = False
        ep.start(self.opts.timeout_s)
        try:
            rec.wait_ready(None, self.opts.timeout_s)
            while todo and (deadline is None or time.monotonic() < deadline):
                p = todo[0]
                status = rec.room_for(p, injector.root)
                if status is None:
                    break  # too near the job's end: let it finish, the next job takes p
                todo.pop(0)
                time.sleep(p.delay_s)  # a random moment, not a step boundary
                status = watch.status() or status
                record = rep.FaultRecord(index=p.index, kind=p.kind, episode=n, time=time.time())
                self.records.append(record)
                tag = f"{prefix}fault {p.index} ({p.kind}): "
                try:
                    rec.fault(p, record, injector, status, tag=tag)
                except Overtaken as e:  # the job ended first: no fault happened; the next job takes it
                    self.records.remove(record)
                    todo.insert(0, p)
                    self.say(f"chaos: {tag}not done, the job ended first ({e}); the next job takes it")
                    break
                except Timeout as e:
                    record.ok = False
                    self.checks.fail(f"{tag}{e}")
                    self.say(f"chaos: {tag}FAILED: {e}")
                    return  # the job is stopped (finally) and checked for leftovers
                self.say(
                    f"chaos: {tag}recovered in {record.recovery_s or 0:.2f}s, whole again in "
                    f"{record.ready_s or 0:.2f}s"
                )
            ended = self.finish_episode(ep, prefix)
        except Timeout as e:
            self.checks.fail(f"{prefix}{e}")
            self.say(f"chaos: {prefix}FAILED: {e}")
        finally:
            if not ended:  # a job that did not end by itself is stopped: only then look for leftovers
                ep.stop()
            self.checks.leftovers(watch.job_id, ep, prefix)
            ep.stop()

    def finish_episode(self, ep: Episode, prefix: str) -> bool:
        """Wait for the job's end; check its weights. True when it ended by itself."""
        rc = ep.wait_end(self.opts.timeout_s + self.opts.steps * 2.0)
        if rc is None:
            self.checks.fail(f"{prefix}the job did not end; logs in {ep.job_dir / 'logs'}")
            return False
        result = ep.job_dir / "result.json"
        if rc != 0 or not result.exists():
            self.checks.fail(f"{prefix}the job failed (node 0 exit {rc}); logs in {ep.job_dir / 'logs'}")
            return True
        out = json.loads(result.read_text())
        equal = out["final_hash"] == self.reference
        self.hashes.append({"job": ep.job_dir.name, "final_hash": out["final_hash"], "equal": equal})
        if not equal:
            self.checks.fail(f"{prefix}final weights differ from the uninterrupted run's")
        self.say(f"chaos: {prefix}done, weights {'bitwise equal' if equal else 'DIFFERENT'}")
        return True


def run_chaos(
    opts: ChaosOptions, *, echo: bool = True, progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the soak; return the report (``ok`` False with ``failures`` when a check failed).
    ``progress`` gets the report so far (``complete`` False) after each job: a soak stopped
    early leaves what it measured."""
    say = print if echo else (lambda *a, **k: None)
    opts.job_dir.mkdir(parents=True, exist_ok=True)
    with hold_dir(opts.job_dir, what="chaos dir", option="--job-dir"):
        soak = Soak(opts, say=say)
        soak.t0, soak.started = time.time(), time.monotonic()
        deadline = soak.started + opts.duration_s if opts.duration_s else None
        try:
            soak.setup()
            say(
                f"chaos: {opts.faults} faults, seed {opts.seed}, {opts.nnodes} nodes x {opts.nproc} "
                f"rank(s), {opts.spares} spare(s) per node; kinds {', '.join(soak.kinds)}"
                + "".join(f"; {k} skipped ({why})" for k, why in soak.skipped.items())
            )
            soak.run_reference()
            todo = list(soak.schedule)
            stuck = 0
            while todo and (deadline is None or time.monotonic() < deadline) and stuck < 3:
                before = len(todo)
                soak.run_episode(todo, deadline)
                stuck = stuck + 1 if len(todo) == before else 0
                if progress is not None and todo:
                    progress(soak.report(complete=False))
            if todo and stuck:
                soak.checks.fail(f"{len(todo)} faults were never injected: 3 jobs in a row took none")
        except KeyboardInterrupt:  # SIGINT or SIGTERM (the CLI's handlers): stop, clean up, report
            soak.checks.fail(f"stopped by a signal after {len(soak.records)} of {opts.faults} faults")
            return soak.report(complete=False)
        finally:
            soak.teardown()
        injected = {r.kind for r in soak.records}
        for kind in sorted(set(soak.kinds) & {p.kind for p in soak.schedule} - injected):
            if deadline is None:
                soak.checks.fail(f"kind {kind} was scheduled but never injected")
        return soak.report(complete=True)
