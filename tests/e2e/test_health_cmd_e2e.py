"""``--health-cmd`` with real processes (issue 21): a 3-node job (one rank and one hot spare per
node) whose agents run the same health command every 0.5 s. The command reads the node's name
(``NONSTOP_NODE``, set by the agent) and says failing, with a JSON line, on node 1 once a
marker file exists in the job dir (``NONSTOP_JOB_DIR``); the test creates it once the job is
well under way. With ``--on-degraded drain`` node 1 is drained: its rank migrated live (reason
``degraded``), the node released, final weights bitwise those of the same job whose command
always passes -- which changes nothing (no health event, no migration). Events are asserted,
never timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nonstop.config import DetectorConfig, ProbeConfig
from nonstop.demo.runner import demo_job_config
from nonstop.policy.straggler import StragglerConfig
from tests.conftest import LEASE_TTL_S, NodesInBackground, events_named, run_nodes_job

pytestmark = pytest.mark.slow

STEPS = 80
MARKER = "node-1-sick"
CHECK = f"""\
[ "$NONSTOP_NODE" = 1 ] && [ -e "$NONSTOP_JOB_DIR/{MARKER}" ] && {{
  echo checking
  echo '{{"verdict": "failing", "detail": "marker found"}}'
  exit 1
}}
exit 0
"""


# What these jobs test is the health verdict's drain, not hang detection, and both assert that no
# rank failed: at the default 1 s heartbeat timeout a CI machine saturated by the other test
# worker's jobs once left two ranks' heartbeats unread for 1 s right after the start, and the
# recovery that followed (bitwise, nothing lost) failed the "no failure" check.
CALM = DetectorConfig(heartbeat_timeout_s=3.0)


def _probes(tmp: Path) -> ProbeConfig:
    script = tmp / "check.sh"
    script.write_text(CHECK)
    return ProbeConfig(period_s=0.5, command=f"sh {script}", timeout_s=10.0)


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, object]]]:
    """The job whose health command always passes (no marker): its hash and events."""
    tmp = tmp_path_factory.mktemp("passing")
    run = run_nodes_job(
        tmp / "job",
        nnodes=3,
        spares=1,
        steps=STEPS,
        straggler=StragglerConfig(on_degraded="drain"),
        probes=_probes(tmp),
        detector=CALM,
    )
    assert run.out is not None, run.result.error
    assert run.result.failures == []
    return str(run.out["final_hash"]), run.events


def test_a_passing_health_cmd_changes_nothing(passing: tuple[str, list[dict[str, object]]]) -> None:
    _, events = passing
    assert events_named(events, "health") == []  # the first healthy verdicts are no news
    assert events_named(events, "migration_start") == []
    assert events_named(events, "node_released") == []


def test_a_failing_health_cmd_drains_its_node(
    tmp_path: Path, passing: tuple[str, list[dict[str, object]]]
) -> None:
    reference, _ = passing
    job_dir = tmp_path / "job"
    config = demo_job_config(
        result=job_dir / "result.json",
        steps=STEPS,
        model="tiny",
        batch=4,
        script_extra=("--step-delay", "0.1"),
        nproc_per_node=1,
        nnodes=3,
        spares=1,
        job_dir=job_dir,
        coordinator="127.0.0.1:0",
        lease_ttl_s=LEASE_TTL_S,
        straggler=StragglerConfig(on_degraded="drain"),
        probes=_probes(tmp_path),
        detector=CALM,
    )
    job = NodesInBackground(config)
    job.wait_replicated(10)
    assert job.running, "the job ended before it was under way"
    (job_dir / MARKER).touch()  # node 1's health command says failing from now on
    result = job.result(timeout=600)
    events = job.events()
    out = (job_dir / "result.json").read_text()
    assert '"final_hash"' in out, result.error
    assert json.loads(out)["final_hash"] == reference  # bitwise: a live migration rolls nothing back
    (verdict,) = events_named(events, "health")
    assert verdict["node"] == "1" and verdict["verdict"] == "failing"
    assert verdict["probe"] == "command" and verdict["detail"] == "exit 1: marker found"
    (done,) = events_named(events, "migration_done")
    assert done["rank"] == 1 and done["reason"] == "degraded" and done["source"] == "1"
    assert done["target"] in ("0", "2")
    assert any(e["node"] == "1" for e in events_named(events, "node_released"))
    assert result.failures == [] and events_named(events, "failure") == []
