"""A training loop the script owns (``Session.steps``) with ``state=`` objects, in real jobs: a 2-rank
job with a hot spare trains an AdamW model under a real LR schedule, a real ``torch.amp.GradScaler``
and torchdata's ``StatefulDataLoader`` (through ``nonstop.Batches``); rank 1 is SIGKILLed while rank
0 is inside a long step. Against the same job run without a fault:

* the final weights are bitwise equal;
* every rank saw the same batches (sample indices), learning rate and loss scale at every step;
* rank 0's step was interrupted by the recovery (the MTTR is far below its 30 s sleep).

And a script whose ``state=`` holds an object without ``state_dict()`` fails the job at once:
``nonstop run`` exits 2 with one line naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from nonstop.config import JobConfig
from nonstop.coordinator.loop import JobState
from nonstop.launch.launcher import run_job

pytestmark = pytest.mark.slow
pytest.importorskip("torchdata.stateful_dataloader")

STEPS = 12
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    import nonstop

    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    session = nonstop.init()

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 20
        def __getitem__(self, i):
            g = torch.Generator().manual_seed(1000 * session.rank + i)
            return i, torch.randn(6, generator=g), torch.randn(1, generator=g)

    torch.manual_seed(session.rank)  # the loader's shuffle draws from the restored global RNG
    batches = nonstop.Batches(StatefulDataLoader(Samples(), batch_size=3, shuffle=True))
    records = out / f"rank{session.rank}-{os.getpid()}.jsonl"
    sleep_once = out / "slept"
    state = {"sched": sched, "scaler": scaler, "data": batches}
    for step in session.steps(steps, model=model, optimizer=opt, state=state):
        with step:
            idx, x, y = next(batches)
            if step == 5 and session.rank == 0 and os.environ.get("SLOW") and not sleep_once.exists():
                sleep_once.touch()
                time.sleep(30)  # inside the step, in no collective: the recovery interrupts it
            opt.zero_grad()
            loss = (step.model(x) - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            step.loss = loss.item()
            rec = {"step": int(step), "idx": idx.tolist(), "lr": sched.get_last_lr()[0],
                   "scale": scaler.get_scale(), "epoch": batches.epoch, "gen": step.generation}
            with records.open("a") as f:
                f.write(json.dumps(rec) + "\\n")
            time.sleep(0.05)
    if session.rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "final.pt")
    session.close()
    """
)


def _run(tmp_path: Path, name: str, faults: tuple[str, ...], *, slow: bool) -> tuple[Any, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    out.mkdir()
    config = JobConfig(
        script=str(script),
        script_args=(str(out), str(STEPS)),
        nproc_per_node=2,
        spares=1,
        job_dir=tmp_path / f"job-{name}",
        faults=faults,
        extra_env=(("SLOW", "1"),) if slow else (),
    )
    return run_job(config, redirect_output=True), out


def _records(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, step) -> the record of the run of that step that counted: the last one written."""
    last: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.name[4 : path.name.index("-")])
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            last[(rank, rec["step"])] = rec  # a redone step overwrites the abandoned run's record
    return last


def test_user_owned_loop_with_state_objects_recovers_bitwise(tmp_path: Path) -> None:
    ref, ref_out = _run(tmp_path, "ref", (), slow=False)
    assert ref.state is JobState.DONE, ref.error
    run, out = _run(tmp_path, "faulty", ("kill:rank=1,step=5",), slow=True)
    assert run.state is JobState.DONE, run.error
    (failure,) = run.failures
    assert failure["rank"] == 1 and failure["replacement"] == "spare" and failure["lost_steps"] == 0
    assert failure["mttr_s"] < 15, failure  # rank 0's 30 s step was interrupted, not waited out

    a, b = torch.load(ref_out / "final.pt"), torch.load(out / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want, got = _records(ref_out), _records(out)
    assert set(want) == {(r, s) for r in (0, 1) for s in range(STEPS)}
    for key in sorted(want):
        w, g = dict(want[key]), dict(got[key])
        w.pop("gen"), g.pop("gen")
        assert g == w, key  # same samples in the same order, same lr, same loss scale
    assert {r["epoch"] for r in want.values()} == {0, 1}  # the data crossed an epoch boundary
    assert len({r["scale"] for r in want.values()}) > 1  # the scaler's scale moved
    assert max(r["gen"] for r in got.values()) > 1  # the faulty run did recover


BAD = textwrap.dedent(
    """
    import torch, nonstop
    model = torch.nn.Linear(2, 1)
    session = nonstop.init()
    for step in session.steps(5, model=model, state={"loader": iter(range(5))}):
        with step:
            pass
    """
)


def test_a_state_object_without_state_dict_fails_the_job_with_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(BAD)
    job = str(tmp_path / "job")
    cmd = [sys.executable, "-m", "nonstop.cli", "run", "--nproc-per-node", "2", "--job-dir", job, str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("nonstop: error:")]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "'loader'" in lines[0] and "state_dict()" in lines[0] and "rank " in lines[0]
    assert "Traceback" not in done.stderr  # the workers print the mistake's line, not a traceback
