"""``nonstop demo``: train the demo model under the launcher, inject faults, report.

Runs one job with the requested faults and, with ``--verify``, the same job
without faults, then compares the SHA-256 of the final weights (they must be
bitwise equal: the world size never changes and every recovery returns all
ranks to the committed step).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.config import DetectorConfig, JobConfig, job_config_from_flat
from nonstop.coordinator.loop import JobResult, JobState
from nonstop.errors import JobFailedError, UsageError
from nonstop.events.log import read_events
from nonstop.faults import parse_fault
from nonstop.launch.jobdir import hold_dir
from nonstop.launch.local_nodes import run_local_nodes
from nonstop.policy.cadence import DEFAULT_BUDGET
from nonstop.policy.straggler import StragglerConfig

__all__ = ["DemoOptions", "run_demo"]


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    nproc: int = 3
    nnodes: int = 1
    steps: int = 60
    spares: int = 1
    model: str = "small"
    faults: tuple[str, ...] = ()
    verify: bool = False
    job_dir: Path = Path(".nonstop/demo")
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    mesh: str | None = None  # the sharded demo (nonstop.demo.train_sharded) on this mesh
    min_world_size: int = 0  # elastic: the job may shrink to this many ranks
    survivors: str = "auto"  # elastic: shrink first or replace first (policy/survivors.py)
    snapshot_every: int = 1  # --snapshot-every: steps between in-memory snapshots
    snapshot_budget: float = DEFAULT_BUDGET  # --snapshot-budget: the interval tuned to a stall budget
    tls: bool = False  # TLS on the control channel and the data plane (--tls)
    metrics_port: int | None = None  # Prometheus /metrics and /status (--metrics-port)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)  # --straggler, --on-degraded

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise UsageError(f"--nproc must be >= 1 (got {self.nproc})")
        if self.nnodes < 1:
            raise UsageError(f"--nnodes must be >= 1 (got {self.nnodes})")
        if self.steps < 1:
            raise UsageError(f"--steps must be >= 1 (got {self.steps})")
        if self.snapshot_every < 1:
            raise UsageError(f"--snapshot-every must be >= 1 (got {self.snapshot_every})")
        if not 0.0 <= self.snapshot_budget < 1.0:
            raise UsageError(f"--snapshot-budget must be a fraction in [0, 1) (got {self.snapshot_budget})")
        for f in self.faults:
            spec = parse_fault(f)
            if spec.step >= self.steps:
                raise UsageError(
                    f"fault {f!r} is at step {spec.step}, but the demo runs steps "
                    f"0..{self.steps - 1}: raise --steps or pick an earlier step"
                )


def demo_job_config(
    *,
    result: Path,
    steps: int,
    model: str,
    batch: int | None = None,
    script_extra: tuple[str, ...] = (),
    **config: Any,
) -> JobConfig:
    """A job that runs the demo training script (``nonstop.demo.train``) for ``steps`` steps of
    ``model``; rank 0 writes its result JSON (final loss and weights hash) to ``result``.
    ``batch`` None keeps the script's default; ``script_extra`` are more script flags;
    ``config`` are the job's settings by their flat names (``job_dir``, ``nproc_per_node``,
    ``faults``, ``snapshot_every``, ...: :data:`nonstop.config.FLAT`), each put in its part."""
    args = ["--steps", str(steps), "--model", model]
    if batch is not None:
        args += ["--batch", str(batch)]
    args += ["--result", str(result), *script_extra]
    script = "-m nonstop.demo.train_sharded" if config.get("mesh") else "-m nonstop.demo.train"
    return job_config_from_flat({"script": script, "script_args": tuple(args), **config})


def _one_run(opts: DemoOptions, job_dir: Path, faults: tuple[str, ...]) -> tuple[JobResult, dict[str, Any]]:
    if job_dir.exists():
        shutil.rmtree(job_dir)
    result_file = job_dir / "result.json"
    cfg = demo_job_config(
        result=result_file,
        steps=opts.steps,
        model=opts.model,
        nproc_per_node=opts.nproc,
        spares=opts.spares,
        job_dir=job_dir,
        faults=faults,
        detector=opts.detector,
        nnodes=opts.nnodes,
        coordinator="127.0.0.1:0" if opts.nnodes > 1 else None,
        mesh=opts.mesh,
        min_world_size=opts.min_world_size,
        survivors=opts.survivors,
        snapshot_every=opts.snapshot_every,
        snapshot_budget=opts.snapshot_budget,
        tls=opts.tls,
        metrics_port=opts.metrics_port,
        straggler=opts.straggler,
    )
    result = run_local_nodes(cfg, redirect_output=True)
    if result.state is not JobState.DONE or not result_file.exists():
        raise JobFailedError(
            f"demo job failed ({result.error or result.state}); worker logs are in {job_dir / 'logs'}"
        )
    out = json.loads(result_file.read_text())
    if opts.mesh is not None:  # every rank holds its own shards: the job's weights are all of them
        ranks = [
            json.loads(result_file.with_suffix(f".rank{r}.json").read_text()) for r in range(cfg.world_size)
        ]
        h = hashlib.sha256()
        for r in ranks:
            h.update(r["local_hash"].encode())
        out["final_hash"] = h.hexdigest()
    return result, out


def _resizes(job_dir: Path) -> list[dict[str, Any]]:
    """The shrinks and grows of a run, from its event log (what, when, the gap at a grow)."""
    return [
        {k: v for k, v in e.items() if k != "shards"}
        for e in read_events(job_dir / "events.jsonl")
        if e.get("event") in ("shrink", "grow_done", "grow_aborted")
    ]


def migrations(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live migrations of a run, from its event log (issue 21): ``rank``, ``from`` and ``to``
    (nodes), ``step`` (the boundary it moved at), ``reason`` (``straggler``, ``degraded``,
    ``preempt``, ``migrate``/``drain``: an operator's) and ``pause_steps`` (the longest step gap at
    the boundary beyond an ordinary step, in median steps; None when not measured)."""
    out = []
    for e in events:
        if e.get("event") != "migration_done":
            continue
        ratio = e.get("pause_ratio")
        out.append(
            {
                "rank": e.get("rank"),
                "from": e.get("source"),
                "to": e.get("target"),
                "step": e.get("boundary"),
                "reason": e.get("reason"),
                "pause_steps": round(max(0.0, ratio - 1), 3) if isinstance(ratio, int | float) else None,
            }
        )
    return out


def run_demo(opts: DemoOptions, *, echo: bool = True) -> dict[str, Any]:
    """Run the demo; return the report (also what ``--json`` writes). The demo dir is locked
    for the whole demo: a second demo on it is refused before it clears the first's job dirs."""
    with hold_dir(opts.job_dir, what="demo dir", option="--job-dir"):
        return _run_demo(opts, echo=echo)


def _run_demo(opts: DemoOptions, *, echo: bool) -> dict[str, Any]:
    say = print if echo else (lambda *a, **k: None)
    where = f"{opts.nnodes} nodes x {opts.nproc}" if opts.nnodes > 1 else f"{opts.nproc}"
    say(
        f"nonstop demo: {where} ranks, {opts.spares} hot spare(s) per node, {opts.steps} steps, "
        f"model {opts.model}{f', mesh {opts.mesh}' if opts.mesh else ''}, "
        f"faults: {', '.join(opts.faults) or 'none'}"
    )
    result, out = _one_run(opts, opts.job_dir / "run", opts.faults)
    for i, f in enumerate(result.failures, 1):
        st = f["stages"]
        say(
            f"failure {i}: {f['kind']} rank {f['rank']} after step {f['step']} ({f['detail']}) -> "
            f"replacement {f['replacement']}, restored step {f['restore_step']}"
        )
        gap, redone = f.get("survivor_gap_steps"), f.get("redone_steps")
        say(
            "  "
            + "  ".join(f"{k} {v * 1000:.0f}ms" for k, v in st.items())
            + f"  | MTTR {f['mttr_s']:.3f}s  lost steps {f['lost_steps']}"
            + (f"  redone {redone}" if redone else "")
            + (f"  survivors' gap {gap:.2f} steps" if gap is not None else "")
        )
    resizes = _resizes(opts.job_dir / "run")
    moves = migrations(read_events(opts.job_dir / "run" / "events.jsonl"))
    for mv in moves:
        pause = f", pause {mv['pause_steps']:.2f} steps" if mv["pause_steps"] is not None else ""
        move = f"rank {mv['rank']} node {mv['from']} -> {mv['to']} at step {mv['step']}"
        say(f"migration ({mv['reason']}): {move}{pause}")
    for z in resizes:
        if z["event"] == "shrink":
            first = " first, a spare joins later" if z.get("shrink_first") else ""
            say(f"shrink{first}: {z['old_world_size']} -> {z['world_size']} ranks ({z['reason']})")
        elif z["event"] == "grow_done":
            ratio = z.get("pause_ratio")
            pause = f", pause {ratio:.2f} steps" if ratio is not None else ""
            say(f"grow: back to {z['world_size']} ranks at step {z['boundary']}{pause}")
    say(
        f"final loss {out['final_loss']:.4f} after {out['step']} steps "
        f"(generation {result.generation}, median step {(result.median_step_s or 0) * 1000:.0f}ms), "
        f"weights sha256 {out['final_hash'][:16]}"
    )
    if result.replication.get("rounds"):
        rep = result.replication
        say(
            f"replication: {rep['rounds']} rounds, last replicated step {rep['replicated_step']}, "
            f"wire/raw {rep['wire_over_raw']:.3f}"
        )
    report: dict[str, Any] = {
        "nproc": opts.nproc,
        "nnodes": opts.nnodes,
        "replication": result.replication,
        "steps": opts.steps,
        "spares": opts.spares,
        "model": opts.model,
        "mesh": opts.mesh,
        "faults": list(opts.faults),
        "failures": result.failures,
        "resizes": resizes,
        "migrations": moves,
        "median_step_s": result.median_step_s,
        "final_loss": out["final_loss"],
        "final_hash": out["final_hash"],
        "generation": result.generation,
        "reference_hash": None,
        "equal": None,
    }
    if opts.verify:
        say("verify: running the same job without faults ...")
        _, ref = _one_run(opts, opts.job_dir / "reference", ())
        report["reference_hash"] = ref["final_hash"]
        report["reference_loss"] = ref["final_loss"]
        report["equal"] = ref["final_hash"] == out["final_hash"]
        say(
            f"verify: reference sha256 {ref['final_hash'][:16]} -> "
            + ("bitwise EQUAL" if report["equal"] else "DIFFERENT")
        )
    return report
