"""``Session.on_event`` in a real job: rank 0's training script hands the job's events to the real
TensorBoard writer (``torch.utils.tensorboard.SummaryWriter`` through ``nonstop.loggers.
TensorBoardHook``) while rank 1 is SIGKILLed and recovered; the event file, read back with
TensorBoard's own ``EventAccumulator``, holds the failure, the MTTR the coordinator logged, the
world size and the committed step."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from nonstop.config import DetectionConfig, DetectorConfig, JobConfig
from nonstop.events.log import read_events
from nonstop.launch.launcher import run_job

pytest.importorskip("tensorboard")

SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import nonstop
    from nonstop.loggers import TensorBoardHook

    logdir, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = nonstop.init()
    writer, kinds = None, []
    if session.rank == 0:  # only rank 0 subscribes: the others receive nothing
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(logdir)
        hook = TensorBoardHook(writer)

        def on_event(event):
            kinds.append(event.kind)
            time.sleep(0.05)  # a slow logger: it must not slow the steps
            hook(event)

        session.on_event(on_event)

    def train_step(ddp, step):
        opt.zero_grad()
        for shard in session.shard_steps(ddp):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 100 + shard))
            ddp(x).pow(2).mean().backward()
        opt.step()
        time.sleep(0.05)
        return 0.0

    session.run(train_step, model=model, optimizer=opt, num_steps=steps)
    if writer is not None:
        writer.close()
        out = {"kinds": kinds, "dropped": session.events_dropped, "rank": session.rank}
        (__import__("pathlib").Path(logdir) / "seen.json").write_text(json.dumps(out))
    session.close()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensorboard_gets_the_jobs_failure_and_recovery(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = tmp_path / "train_tb.py"
    script.write_text(SCRIPT)
    logdir = tmp_path / "tb"
    job_dir = tmp_path / "job"
    config = JobConfig(
        script=str(script),
        script_args=(str(logdir), "40"),
        nproc_per_node=2,
        spares=1,
        job_dir=job_dir,
        faults=("kill:rank=1,step=15",),
        detection=DetectionConfig(detector=DetectorConfig()),
    )
    result = run_job(config, redirect_output=True)
    assert result.state.name == "DONE", result.error

    seen = json.loads((logdir / "seen.json").read_text())
    assert seen["rank"] == 0 and seen["dropped"] == 0
    for kind in ("failure", "recovery", "generation", "committed"):
        assert kind in seen["kinds"], kind

    log = [e for e in read_events(job_dir / "events.jsonl") if e["event"] == "recovery"]
    (recovery,) = log
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"nonstop/failures", "nonstop/mttr_s", "nonstop/world_size", "nonstop/committed_step"} <= tags
    (mttr,) = acc.Scalars("nonstop/mttr_s")
    assert mttr.value == pytest.approx(recovery["mttr_s"], rel=1e-5) and mttr.value > 0
    assert mttr.step == recovery["restore_step"]
    assert [s.value for s in acc.Scalars("nonstop/failures")] == [1.0]
    assert {s.value for s in acc.Scalars("nonstop/world_size")} == {2.0}
    committed = [s.value for s in acc.Scalars("nonstop/committed_step")]
    assert committed == sorted(committed) or len(set(committed)) > 3  # moves forward (a redo may step back)
    assert max(committed) >= 20
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("nonstop/events/text_summary")]
    assert any("recovery: kill of rank 1" in t for t in texts) and any("failure: kill" in t for t in texts)
