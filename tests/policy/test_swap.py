"""The boundary-swap machine (migration and grow), driven event by event with no I/O."""

from __future__ import annotations

from nonstop.policy.boundary_swap import (
    Action,
    BoundarySwap,
    Continue,
    Emit,
    Fetch,
    Finished,
    Joiner,
    Pause,
    Prepare,
    Release,
    Retire,
    SwapKind,
    SwapNow,
    SwapPhase,
)
from nonstop.policy.migration import CATCHUP_ROUNDS, CatchUp, Transfer

LATEST = {0: 10, 1: 11}


def migration(**kw: object) -> BoundarySwap:
    args: dict[str, object] = dict(
        kind=SwapKind.MIGRATION, joiners=[Joiner(sid=7, rank=1, node="2")], world_size=2, new_world_size=2,
        source_rank=1, source_node="1", prepare_step=9, started=100.0, reason="drain", leaver_sid=3,
        catch=CatchUp(),
    )  # fmt: skip
    args.update(kw)
    return BoundarySwap(**args)  # type: ignore[arg-type]


def grow() -> BoundarySwap:
    return BoundarySwap(
        kind=SwapKind.GROW, joiners=[Joiner(sid=8, rank=2, node="3"), Joiner(sid=9, rank=3, node="3")],
        world_size=2, new_world_size=4, source_rank=0, source_node="0", prepare_step=9, started=100.0,
    )  # fmt: skip


def kinds(actions: list[Action]) -> list[str]:
    return [a.kind if isinstance(a, Emit) else type(a).__name__ for a in actions]


def test_a_migration_from_start_to_done() -> None:
    m = migration()
    out = m.start()
    assert kinds(out) == ["migration_start", "Fetch"]
    f = out[1]
    assert isinstance(f, Fetch) and f.purpose == "prepare" and f.track and (f.target, f.source) == ("2", "1")
    out = m.on_prepare_fetched(7, True, None, now=101.0)
    assert out == [Prepare(sid=7, rank=1, world_size=2, step=9)] and m.joiners[0].told
    # the joiner is ready; the committed step moved on: one catch-up as a delta against what it holds
    out = m.on_restored(7, latest=LATEST, committed=11, now=102.0)
    [c1] = out
    assert isinstance(c1, Fetch) and c1.purpose == "catchup" and c1.base == 9 and c1.step == 11
    delta = Transfer(raw_bytes=100, wire_bytes=50, seconds=0.5)
    out = m.on_catchup_fetched(True, delta, delta=True, latest=LATEST, committed=12, now=103)
    c2 = out[-1]  # the second round fetches the whole step (a measure of the link)
    assert kinds(out) == ["catchup", "Fetch"] and isinstance(c2, Fetch) and c2.base is None and c2.step == 12
    whole = Transfer(raw_bytes=100, wire_bytes=100, seconds=0.1)
    out = m.on_catchup_fetched(True, whole, latest=LATEST, committed=13, now=104)
    assert kinds(out) == ["catchup", "migration_pause", "Pause"]  # CATCHUP_ROUNDS reached
    assert m.catch is not None and m.catch.rounds == CATCHUP_ROUNDS and m.catch.held == 12
    boundary = m.boundary
    assert boundary == 11 + 3 and out[-1] == Pause(at=boundary)
    # the source rank completes the boundary first: its fetch is asked for at once (whole: faster)
    out = m.on_paused(1, boundary, now=105)
    [early] = out
    assert isinstance(early, Fetch) and early.purpose == "boundary" and early.base is None
    m.joiners[0].boundary_req = 42
    out = m.on_paused(0, boundary, now=106)
    [swap] = out
    assert isinstance(swap, SwapNow) and swap.leaver == 3 and swap.ranks == {1: (7, "2")} and not swap.fresh
    assert m.phase is SwapPhase.SWAP
    m.generation = 5
    m.on_step(0, boundary + 1, (boundary, 10.0), 10.4)
    out = m.on_generation_done(median_step_s=0.2, now=107)
    assert kinds(out) == ["migration_done", "Finished"] and m.phase is SwapPhase.DONE
    info = out[0].fields  # type: ignore[union-attr]
    assert info["pause_ratio"] == (10.4 - 10.0) / 0.2 and info["catchup_rounds"] == 2
    assert info["swap_delta"] is False


def test_the_swap_fetches_a_delta_when_deltas_measured_faster() -> None:
    m = migration(catch=CatchUp(ready=True, held=12, rounds=2, full=Transfer(100, 100, 1.0),
                                catchups=[Transfer(100, 10, 0.1)]))  # fmt: skip
    m.phase, m.boundary = SwapPhase.PAUSE, 14
    [early] = m.on_paused(1, 14, now=1)
    assert isinstance(early, Fetch) and early.base == 12


def test_a_grow_prepares_every_joiner_then_pauses_then_swaps() -> None:
    z = grow()
    out = z.start()
    assert kinds(out) == ["grow_start", "Fetch", "Fetch"]
    assert [(f.as_rank, f.rank, f.track) for f in out[1:] if isinstance(f, Fetch)] == [
        (2, 0, False),
        (3, 0, False),
    ]
    assert z.on_prepare_fetched(8, True, None, now=1) == [Prepare(sid=8, rank=2, world_size=4, step=9)]
    assert z.on_restored(8, latest=LATEST, committed=11, now=2) == []  # the other joiner is not ready
    z.on_prepare_fetched(9, True, None, now=1)
    out = z.on_restored(9, latest=LATEST, committed=11, now=3)
    assert kinds(out) == ["grow_pause", "Pause"]  # no catch-up for a grow
    out = z.on_paused(0, 14, now=4)
    assert kinds(out) == ["Fetch", "Fetch"]  # rank 0 completed the boundary: both joiners fetch it
    [swap] = z.on_paused(1, 14, now=5)
    assert isinstance(swap, SwapNow) and swap.world_size == 4 and swap.fresh and swap.leaver is None
    assert swap.ranks == {2: (8, "3"), 3: (9, "3")} and swap.source_rank == 0
    z.generation = 3
    assert kinds(z.on_generation_done(median_step_s=None, now=6)) == ["grow_done", "Finished"]


def test_aborts_release_joiners_not_told_and_replace_the_others() -> None:
    z = grow()
    z.start()
    z.on_prepare_fetched(8, True, None, now=1)
    out = z.abort("joining spare 9 exited")
    assert out[:2] == [Retire(sid=8, respawn=True), Release(sid=9)]
    assert kinds(out)[2:] == ["grow_aborted", "Finished"] and z.phase is SwapPhase.ABORTED
    assert z.abort("again") == []  # terminal


def test_an_abort_while_paused_lets_the_ranks_go_on() -> None:
    m = migration()
    m.start()
    m.on_prepare_fetched(7, True, None, now=1)
    m.catch = CatchUp(ready=True, held=9, rounds=CATCHUP_ROUNDS)
    m.joiners[0].prepared = True
    m.phase, m.boundary = SwapPhase.PAUSE, 14
    out = m.on_paused(0, 15, now=2)
    assert out == []
    out = m.on_paused(1, 14, now=3)  # everyone stopped, but not at the same step
    assert Continue() in out and Retire(sid=7, respawn=True) in out
    fin = out[-1]
    assert isinstance(fin, Finished) and not fin.ok and "not 14" in str(fin.error)


def test_a_failed_prepare_fetch_aborts() -> None:
    m = migration()
    m.start()
    out = m.on_prepare_fetched(7, False, "gone", now=1)
    assert out[0] == Release(sid=7) and "gone" in str(m.error)


def test_a_failure_of_another_rank_after_the_swap_leaves_the_move_done() -> None:
    """The joiner holds the rank and the leaver retired: the failure's recovery takes over the
    generation, and the move stands -- reported done, interrupted, its pause not measured."""
    m = migration()
    m.phase, m.boundary = SwapPhase.SWAP, 14
    out = m.abort("rank 0 failed: killed", failed=[3, 4])  # the leaver (3) and rank 0's process
    assert kinds(out) == ["migration_done", "Finished"] and m.phase is SwapPhase.DONE
    done, fin = out
    assert isinstance(done, Emit) and done.fields["interrupted"] == "rank 0 failed: killed"
    assert done.fields["pause_ratio"] is None and done.fields["boundary"] == 14
    assert isinstance(fin, Finished) and fin.ok
    assert m.on_generation_done(median_step_s=0.1, now=5) == []  # over
    z = grow()
    z.phase = SwapPhase.SWAP
    out = z.abort("rank 0 failed", failed=[4])
    assert kinds(out) == ["grow_done", "Finished"] and out[0].fields["seconds"] is None  # type: ignore[union-attr]


def test_a_failure_of_the_joiner_after_the_swap_aborts_it_and_undoes_nothing() -> None:
    m = migration()
    m.phase = SwapPhase.SWAP
    out = m.abort("rank 1 failed", failed=[7])
    assert kinds(out) == ["migration_aborted", "Finished"]  # recovery replaces the joiner: nothing to undo
    z = grow()
    z.phase = SwapPhase.SWAP
    assert kinds(z.abort("rank 3 failed", failed=[9])) == ["grow_aborted", "Finished"]


def test_time_out_before_the_swap() -> None:
    m = migration()
    assert m.tick(now=100.0 + 29, timeout_s=30) == []
    out = m.tick(now=100.0 + 31, timeout_s=30)
    assert "not ready to swap within 30s" in str(out[-1].error)  # type: ignore[union-attr]
