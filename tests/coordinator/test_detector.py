"""FailureDetector verdicts on hand-built worker records (no processes, no clock)."""

from __future__ import annotations

from nonstop.config import DetectorConfig
from nonstop.coordinator.detector import CLOSE_GRACE_S, RAISE_EXIT_GRACE_S, FailureDetector, WorkerRecord

CFG = DetectorConfig(heartbeat_timeout_s=1.0, hang_factor=10, hang_min_s=2.0)


class _Chan:  # stands in for a connected channel; scan() only checks it is there
    closed = False


def _rec(sid: int, rank: int | None, now: float, **kw: object) -> WorkerRecord:
    w = WorkerRecord(
        spawn_id=sid,
        role="worker" if rank is not None else "spare",
        rank=rank,
        chan=_Chan(),
        last_hb=now,
        last_progress=now,
        stepped=True,
    )  # type: ignore[arg-type]
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def _scan(
    det: FailureDetector,
    now: float,
    recs: list[WorkerRecord],
    alive: set[int] | None = None,
    in_training: bool = True,
) -> tuple[dict[int, str], list[int]]:
    members = {w.rank: w for w in recs if w.rank is not None}
    v = det.scan(
        now=now,
        members=members,
        everyone=recs,
        alive=lambda sid: alive is None or sid in alive,
        in_training=in_training,
    )
    return v.kill, v.reraise


def test_healthy_workers_get_no_verdict() -> None:
    det = FailureDetector(CFG)
    det.record_step(0.1)
    assert _scan(det, 100.0, [_rec(0, 0, 99.9), _rec(1, 1, 99.9)]) == ({}, [])


def test_hung_rank_is_reported_by_spawn_id() -> None:
    det = FailureDetector(CFG)
    det.record_step(0.1)
    kill, _ = _scan(det, 100.0, [_rec(5, 0, 99.9), _rec(9, 1, 99.9, last_hb=98.5)])
    assert list(kill) == [9] and "no heartbeat" in kill[9]


def test_progress_is_not_judged_during_a_reconfiguration() -> None:
    det = FailureDetector(CFG)
    det.record_step(0.1)
    stalled = _rec(3, 0, 99.9, last_progress=50.0)
    assert list(_scan(det, 100.0, [stalled])[0]) == [3]
    assert _scan(det, 100.0, [stalled], in_training=False) == ({}, [])


def test_a_progress_hang_says_where_the_rank_was_and_a_moving_rank_waits_longer() -> None:
    det = FailureDetector(CFG)
    det.record_step(0.1)
    asleep = _rec(3, 0, 99.9, last_progress=97.5, at="train/steps.py:88 _wait")
    moving = _rec(4, 1, 99.9, last_progress=97.5, at="demo/model.py:40 forward", moving=True)
    waiting = _rec(6, 3, 99.9, last_progress=97.5, coll=True)  # in the allreduce, for them
    kill, _ = _scan(det, 100.0, [asleep, moving, waiting])  # 2.5 s stalled: limit 2 s, 6 s moving
    assert list(kill) == [3] and kill[3].endswith(", at train/steps.py:88 _wait")
    silent = _rec(5, 2, 98.5, at="x.py:1 f")
    assert _scan(det, 100.0, [silent])[0] == {5: "no heartbeat for 1.50s"}  # its last word is stale


def test_a_first_silence_asks_the_agent_and_an_excused_one_waits_longer_then_kills() -> None:
    """Silent once: a kill its agent is to confirm (agent/silence.py). Excused (the agent saw it
    move): its silence is allowed JOB_STALL_FACTOR x the timeout, then it is killed outright."""
    from nonstop.policy.decisions import JOB_STALL_FACTOR

    det = FailureDetector(CFG)
    det.record_step(0.1)
    silent = _rec(9, 1, 98.5)
    v = det.scan(now=100.0, members={1: silent}, everyone=[silent], alive=lambda _: True, in_training=True)
    assert list(v.kill) == [9] and v.ask == {9}
    unconfirmed = FailureDetector(DetectorConfig(heartbeat_timeout_s=1.0, confirm_silence=False))
    v = unconfirmed.scan(
        now=100.0, members={1: silent}, everyone=[silent], alive=lambda _: True, in_training=True
    )
    assert list(v.kill) == [9] and v.ask == set()  # --no-confirm-silence: killed outright
    excused = _rec(9, 1, 98.5, excused=True, coll=True)  # (in a collective: its progress is not judged)
    members = {1: excused}
    late = 98.5 + CFG.heartbeat_timeout_s * JOB_STALL_FACTOR
    for now in (100.1, 100.3, 100.5, 100.7, 100.9, 101.1, 101.3, 101.45):  # (as often as it scans)
        v = det.scan(now=now, members=members, everyone=[excused], alive=lambda _: True, in_training=True)
        assert v.kill == {} and v.ask == set()
    v = det.scan(now=late + 0.1, members=members, everyone=[excused], alive=lambda _: True, in_training=True)
    assert list(v.kill) == [9] and "no heartbeat for 3.10s" in v.kill[9] and v.ask == set()


def test_closed_channel_of_a_live_process_is_killed_after_a_grace() -> None:
    det = FailureDetector(CFG)
    w = _rec(4, None, 100.0, chan_closed_at=100.0)
    assert _scan(det, 100.0 + CLOSE_GRACE_S / 2, [w])[0] == {}
    assert _scan(det, 100.0 + CLOSE_GRACE_S * 2, [w], alive=set())[0] == {}  # already dead: its exit tells
    assert _scan(det, 100.0 + CLOSE_GRACE_S * 2, [w])[0] == {4: "control channel closed"}


def test_unexplained_exception_is_reraised_after_two_heartbeat_timeouts() -> None:
    det = FailureDetector(CFG)
    w = _rec(2, 1, 100.0, fault_report=(100.0, "ValueError: bug"))
    assert _scan(det, 101.5, [w])[1] == []
    assert _scan(det, 102.5, [w])[1] == [2]


GLOO_PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36247"


def test_a_peers_symptom_waits_while_the_rank_that_raised_the_cause_is_told_to_raise() -> None:
    """One rank's own exception closes its group; its peer reports the closed connection, maybe
    first. Only the cause raises: the peer survives into the recovery its exit starts."""
    det = FailureDetector(CFG)
    victim = _rec(0, 0, 103.0, fault_report=(100.0, GLOO_PEER))
    cause = _rec(1, 1, 103.0, fault_report=(100.1, "ValueError: sample 17 has no label"))
    assert _scan(det, 103.0, [victim, cause])[1] == [1]
    assert _scan(det, 103.0, [victim])[1] == [0]  # nothing else explains it: raised, as before
    both = [_rec(0, 0, 103.0, fault_report=(100.0, GLOO_PEER)), _rec(1, 1, 103.0, fault_report=(100.0, "x"))]
    assert _scan(det, 101.0, both)[1] == []  # (the grace still holds for the cause)
    members = {0: victim}  # the cause has exited and its recovery is being planned: still explained
    v = det.scan(
        now=103.0,
        members=members,
        everyone=[victim],
        alive=lambda _: True,
        in_training=False,
        recovering=True,
    )
    assert v.reraise == []


def test_a_peers_symptom_waits_while_a_peer_judged_lost_awaits_its_nodes_lease() -> None:
    """Found in the chaos soak: a partitioned node's workers closed their control channels, the
    survivor reported the reset connection, and the node's lease (3 s) outlived two heartbeat
    timeouts: the survivor was told to raise, and was replaced cold, its rescue lost. A peer
    already judged lost explains the symptom: the survivor waits for the recovery."""
    det = FailureDetector(CFG)
    det.record_step(0.1)
    survivor = _rec(0, 0, 103.0, fault_report=(100.0, GLOO_PEER))
    closed = _rec(1, 1, 103.0, chan_closed_at=100.1, chan=None)  # (its channel is gone)
    killed = _rec(2, 2, 103.0, killed_for_hang="control channel closed")
    assert _scan(det, 103.0, [survivor, closed])[1] == []
    assert _scan(det, 103.0, [survivor, killed])[1] == []
    silent = _rec(3, 1, 103.0, last_hb=100.0)  # judged in this very scan: killed as hung
    kill, reraise = _scan(det, 103.0, [survivor, silent])
    assert list(kill) == [3] and reraise == []
    assert _scan(det, 103.0, [survivor, _rec(1, 1, 103.0)])[1] == [0]  # the peers all well: raised


def test_a_rank_told_to_raise_is_not_killed_as_silent_while_it_exits() -> None:
    """Found under a saturated CPU: a rank told to raise its ValueError stopped beating while
    its interpreter unwound, and was killed as hung -- its failure recorded as a hang."""
    det = FailureDetector(CFG)
    det.record_step(0.1)
    w = _rec(2, 1, 100.0, fault_report=(100.0, "ValueError: bug"), told_to_raise_at=102.5)
    assert _scan(det, 110.0, [w]) == ({}, [])  # silent 10 s, exiting: no kill, not told twice
    late = 102.5 + RAISE_EXIT_GRACE_S + 1  # it never exited: judged again (a detector that
    det = FailureDetector(CFG)  # scanned all along: a gap between scans is its own stall)
    det.record_step(0.1)
    assert list(_scan(det, late, [w])[0]) == [2]


def test_silence_is_not_judged_across_the_coordinators_own_stall() -> None:
    """A coordinator starved of CPU for 2 s reads no heartbeat meanwhile: on resuming it gives
    every rank a full timeout from then, and still catches a rank that stays silent."""
    det = FailureDetector(CFG)
    det.record_step(0.1)
    w = _rec(7, 0, 100.0)
    assert _scan(det, 100.1, [w])[0] == {}
    assert _scan(det, 102.1, [w])[0] == {}  # 2.1 s since its last heartbeat, but the scan stalled
    for i in range(1, 10):  # the coordinator runs again (a scan every 0.1 s)
        assert _scan(det, 102.1 + i * 0.1, [w])[0] == {}
    kill, _ = _scan(det, 103.2, [w])  # silent a full timeout after the coordinator resumed
    assert list(kill) == [7] and "no heartbeat" in kill[7]


def test_a_rank_joining_the_new_group_may_be_silent_longer() -> None:
    """Gloo's rendezvous and a sharded model's build may hold the GIL for seconds on a busy machine:
    a rank in REBUILD gets 10x the heartbeat timeout; a stopped one is still caught."""
    det = FailureDetector(CFG)
    w = _rec(8, 0, 100.0)
    members = {0: w}

    def scan(now: float, rebuilding: set[int]) -> dict[int, str]:
        det._last_scan = now  # consecutive scans (no coordinator stall)
        return det.scan(now=now, members=members, everyone=[w], alive=lambda s: True, in_training=False,
                        rebuilding=rebuilding).kill  # fmt: skip

    assert scan(102.0, {0}) == {}
    assert list(scan(102.0, set())) == [8]
    assert list(scan(111.0, {0})) == [8]


def test_a_peer_waiting_on_a_stalled_rank_is_not_blamed_when_its_heartbeat_is_late() -> None:
    """Issue 17 item 8. Was: under load a healthy peer's step report arrived, then its heartbeat
    saying "in the allreduce" came 2.5 s later; the progress rule judged it by the coordinator's
    clock alone and replaced a healthy rank beside the stalled one."""
    det = FailureDetector(CFG)
    det.record_step(0.1)
    now = 100.0
    stalled = _rec(1, 1, now, last_progress=97.0, last_hb=99.9, coll=False, idle_s=2.9)
    # its last word, 0.3 s after its step, was "computing"; it has been in the allreduce since,
    # but the heartbeat saying so is still queued behind the busy CPU
    peer = _rec(2, 2, now, last_progress=97.0, last_hb=99.8, coll=False, idle_s=0.3)
    kill, _ = _scan(det, now, [stalled, peer])
    assert list(kill) == [1] and "no step progress" in kill[1]


def test_a_rank_that_does_not_report_idle_time_is_judged_as_before() -> None:
    det = FailureDetector(CFG)
    det.record_step(0.1)
    kill, _ = _scan(det, 100.0, [_rec(3, 0, 100.0, last_progress=97.0, last_hb=99.9, idle_s=None)])
    assert list(kill) == [3]


def test_a_peer_leaving_its_collective_on_a_hung_ranks_kill_is_not_blamed_before_the_recovery() -> None:
    """Found under load (FSDP2, tests/e2e/test_sharded_e2e.py): rank 0 stalled and was killed as hung;
    rank 1, released from the all-gather by the kill, reported "not in a collective" with no step
    for as long as the stall lasted, and was blamed too before its fault report arrived. While a
    kill for a hang is pending no progress is judged; a silent rank still is."""
    det = FailureDetector(CFG)
    det.record_step(0.1)
    now = 100.0
    stalled = _rec(1, 0, now, last_progress=96.0, killed_for_hang="no step progress")
    peer = _rec(2, 1, now, last_progress=96.0, coll=False, idle_s=4.0)
    assert _scan(det, now, [stalled, peer])[0] == {}
    silent = _rec(3, 2, now, last_hb=90.0)
    assert list(_scan(det, now, [stalled, peer, silent])[0]) == [3]
    stalled.killed_for_hang = None  # (its exit handled: no kill pending) the rule is as before
    assert list(_scan(det, now, [peer])[0]) == [2]
