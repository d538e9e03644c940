"""Fail-slow with real processes (issue 21): a 3-node job (one rank and one hot spare per node)
whose rank 1 turns 3x slower at step 10 (``slowdown:rank=1,step=10,factor=3``) is flagged, and
with ``--straggler migrate`` moved live to another node's spare -- no rollback, final weights
bitwise those of the same job without the fault, which with ``--straggler warn`` flags nothing.
A node whose health turns degraded (``degrade:node=1,step=5``) is drained with ``--on-degraded
drain`` before its death (``node:node=1,step=40``) can cost a step; a whole-job slowdown and a
one-off slow step are not flagged. Events are asserted, timings only loosely."""

from __future__ import annotations

from pathlib import Path

import pytest

from nonstop.coordinator.loop import JobState
from nonstop.policy.straggler import StragglerConfig
from tests.conftest import DemoRun, events_named, run_demo_job, run_nodes_job

pytestmark = pytest.mark.slow

STEPS = 60
SLOWDOWN_AT = 10
DIES_AT = 40


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, object]]]:
    """The same job without the fault, ``--straggler warn``: its hash and events."""
    run = run_nodes_job(
        tmp_path_factory.mktemp("warn") / "job", nnodes=3, spares=1, steps=STEPS, straggler=StragglerConfig()
    )
    assert run.out is not None, run.result.error
    return str(run.out["final_hash"]), run.events


def _job(tmp_path: Path, **kw: object) -> DemoRun:
    """The test's job (3 nodes, one rank and one hot spare each, STEPS steps) with ``kw``."""
    return run_nodes_job(tmp_path / "job", nnodes=3, spares=1, steps=STEPS, **kw)


def test_no_fault_flags_nothing(undisturbed: tuple[str, list[dict[str, object]]]) -> None:
    _, events = undisturbed
    assert events_named(events, "straggler") == []  # no false positive
    assert events_named(events, "migration_start") == []


def test_a_straggler_is_migrated_away_bitwise(
    tmp_path: Path, undisturbed: tuple[str, list[dict[str, object]]]
) -> None:
    reference, _ = undisturbed
    run = _job(
        tmp_path,
        faults=(f"slowdown:rank=1,step={SLOWDOWN_AT},factor=3",),
        # a 60-step run has little left to lose: a cheap move, so the policy says migrate
        straggler=StragglerConfig(mode="migrate", migration_cost_s=0.5),
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference  # bitwise: a live migration rolls nothing back
    assert run.result.failures == [] and events_named(run.events, "failure") == []
    flagged = events_named(run.events, "straggler")
    assert [e["rank"] for e in flagged] == [1], flagged
    assert flagged[0]["step"] > SLOWDOWN_AT and flagged[0]["factor"] > 1.5
    (decision,) = [e for e in events_named(run.events, "proactive") if e["migrate"]]
    assert decision["rank"] == 1
    (done,) = events_named(run.events, "migration_done")
    assert done["rank"] == 1 and done["reason"] == "straggler" and done["source"] == "1"
    assert done["target"] in ("0", "2") and done["boundary"] > flagged[0]["step"]
    # the new process playing rank 1 is not slow: the flag clears, never raised again (the
    # detector's verdict on the steps' compute; the step intervals, which a competing load
    # stretches as much, are not compared here)
    assert events_named(run.events, "straggler_cleared")


def test_a_degraded_node_is_drained(tmp_path: Path, undisturbed: tuple[str, list[dict[str, object]]]) -> None:
    reference, _ = undisturbed
    run = _job(
        tmp_path,
        # the node dies at step 40 (its agent and every process SIGKILLed when a worker of it
        # starts that step): drained before, it has no worker left to die with
        faults=("degrade:node=1,step=5", f"node:node=1,step={DIES_AT}"),
        straggler=StragglerConfig(on_degraded="drain"),
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference
    (verdict,) = events_named(run.events, "health")
    assert verdict["node"] == "1" and verdict["verdict"] == "degraded"
    (done,) = events_named(run.events, "migration_done")
    assert done["rank"] == 1 and done["reason"] == "degraded" and done["source"] == "1"
    assert done["boundary"] < DIES_AT
    assert any(e["node"] == "1" for e in events_named(run.events, "node_released"))
    assert run.result.failures == [] and events_named(run.events, "failure") == []


def test_a_whole_job_slowdown_and_a_one_off_slow_step_flag_nothing(
    tmp_path: Path, undisturbed: tuple[str, list[dict[str, object]]]
) -> None:
    """Every rank 2x slower from step 10 (the job as a whole slows: a hotter room, a slower
    filesystem), and rank 1 once 0.8 s slower at step 30: no straggler, nothing moves, and the
    weights are those of the undisturbed run."""
    reference, _ = undisturbed
    run = _job(
        tmp_path,
        faults=(
            *(f"slowdown:rank={r},step={SLOWDOWN_AT},factor=2" for r in range(3)),
            "slow:rank=1,step=30,seconds=0.8",
        ),
        straggler=StragglerConfig(mode="migrate", migration_cost_s=0.5),  # would move a straggler
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference
    assert events_named(run.events, "straggler") == []
    assert events_named(run.events, "migration_start") == [] and run.result.failures == []
    # every fault fired (each process records the one it fired: the slowdowns of ranks 0-2 and
    # rank 1's slow step). Not timed: the step intervals once checked here (later steps > 1.1x the
    # early ones; 1.27x measured on a loaded machine) were 1.04x in a parallel test run, where the
    # load slowed the early steps as much
    fired = sorted(p.name for p in (run.job_dir / "faults").glob("fault-*"))
    assert fired == [f"fault-{i}" for i in range(4)], fired


def test_a_failure_on_a_degraded_node_is_replaced_on_another_node(
    tmp_path: Path, undisturbed: tuple[str, list[dict[str, object]]]
) -> None:
    """Node 1 turns degraded (``--on-degraded warn``: nothing moves), then its rank is SIGKILLed:
    the failure is graded replace_elsewhere and another node's spare takes rank 1, although node
    1 has an idle spare of its own -- still from memory, still bitwise."""
    reference, _ = undisturbed
    run = _job(
        tmp_path,
        faults=("degrade:node=1,step=5", "kill:rank=1,step=15"),
        straggler=StragglerConfig(),
    )
    assert run.out is not None, run.result.error
    assert run.out["final_hash"] == reference
    (graded,) = events_named(run.events, "failure_graded")
    assert (graded["rank"], graded["node"], graded["grade"]) == (1, "1", "replace_elsewhere"), graded
    (gen,) = [e for e in events_named(run.events, "generation") if e["cause"]]
    nodes = gen["nodes"]
    assert isinstance(nodes, dict) and nodes["1"] in ("0", "2"), gen
    assert gen["tier"] != "durable", gen  # from memory: node 1's or its peer replica
    (rec,) = events_named(run.events, "recovery")
    assert rec["lost_steps"] == 0, rec


def test_a_sharded_straggler_is_flagged_from_its_sampled_waits(tmp_path: Path) -> None:
    """FSDP2 on 3 ranks: rank 1 turns 3x slower. Its peers wait for it inside FSDP's all-gathers
    and reduce-scatters, where no allreduce stamp is: the sampled wait (train/waitclock.py) is what
    tells their compute from its own, so only rank 1 is flagged (without it none would be)."""
    run = run_demo_job(
        tmp_path / "job",
        mesh="shard=3",
        nproc=3,
        spares=0,
        steps=40,
        faults=("slowdown:rank=1,step=8,factor=3",),
        script_extra=("--step-delay", "0.1"),
        straggler=StragglerConfig(),
    )
    assert run.result.state is JobState.DONE, run.result.error
    flagged = events_named(run.events, "straggler")
    assert [e["rank"] for e in flagged] == [1], flagged
    assert flagged[0]["step"] > 8 and flagged[0]["factor"] > 1.5, flagged
