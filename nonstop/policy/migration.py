"""Live migration: move a rank to another node while the job trains (``nonstop migrate``,
``nonstop drain``, preemption notices).

The stages (the state machine is :class:`~nonstop.policy.boundary_swap.BoundarySwap`, shared with an
elastic grow; :mod:`nonstop.coordinator.swaps` carries it out):

1. **prepare** -- a hot spare on the target node (the *joiner*) is chosen; the target node gets the
   rank's newest committed snapshot ``P`` into its memory (copied from a replica it holds, or
   fetched from the leaver's node over the data plane); the joiner is told its rank and restores
   ``P``: the script builds its model and optimizer, and every buffer is allocated and filled,
   while the other ranks keep training;
   **catch-up** -- once the joiner is ready, the target node fetches newer committed steps as
   deltas against the step it holds (:func:`catch_up_to`), so that it holds a step close to
   the boundary; the prepare and the catch-up fetches are *tracked*: both nodes keep what was
   sent as the base of the next delta (:mod:`nonstop.replica.peer`);
2. **pause** -- the coordinator picks a boundary step ``S`` a few steps ahead of the newest step
   reported; every rank stops after completing step ``S`` (its snapshot complete) and says so;
3. **swap** -- a new generation: the leaver leaves the membership (and is stopped), the target
   node fetches the leaver's snapshot of ``S`` -- as a delta against the step it holds when the
   catch-up measured deltas faster than whole steps (:func:`swap_as_delta`) -- the joiner restores
   it, the others keep their own state of ``S``, the process group is rebuilt with the joiner in
   the rank, and every rank continues from ``S``. Nothing is rolled back.

If the leaver (or any member) fails during a migration, the migration is aborted (the joiner is
stopped) and ordinary recovery runs. If the joiner dies, the migration is aborted and paused
ranks are told to continue in the same process group.

This module holds the pure decisions of a migration and its catch-up record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "CatchUp",
    "Transfer",
    "boundary_step",
    "catch_up_to",
    "choose_joiner",
    "choose_target",
    "swap_as_delta",
]

BOUNDARY_MARGIN = 3  # steps ahead of the newest reported step: no rank has started it yet
CATCHUP_ROUNDS = 2  # catch-up fetches at most, once the joiner is ready (each lands a few steps behind)


@dataclass(frozen=True)
class Transfer:
    """One measured fetch to the target node: snapshot bytes, bytes on the wire, seconds
    from request to installed (encode, send, decode, write)."""

    raw_bytes: int
    wire_bytes: int
    seconds: float

    @property
    def rate(self) -> float:
        """Snapshot bytes installed per second."""
        return self.raw_bytes / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class CatchUp:
    """A migration's target catching up while its joiner prepares: the step its node holds from
    the tracked fetches (the base of the next delta), the fetch in flight, and what the rounds
    measured (for :func:`swap_as_delta`)."""

    ready: bool = False  # the joiner restored the prepare step and warmed up
    held: int | None = None  # the step the target holds from the tracked fetches
    catchup_req: int | None = None  # a catch-up fetch in flight
    catchup_step: int | None = None
    rounds: int = 0  # catch-up fetches done
    catchups: list[Transfer] = field(default_factory=list)  # those that came as deltas, in order
    full: Transfer | None = None  # a catch-up round that fetched the whole step over the network
    swap_delta: bool | None = None  # how the swap fetched the boundary


def choose_joiner(target: str, idle_spares: Mapping[int, str]) -> int | None:
    """The spare (spawn id) on ``target`` that becomes the rank; None when it has none.
    Deterministic: the oldest (lowest spawn id) spare there."""
    on_target = sorted(sid for sid, node in idle_spares.items() if node == target)
    return on_target[0] if on_target else None


def choose_target(
    leaver_node: str,
    idle_spares: Mapping[int, str],
    live_nodes: Sequence[str],
    domains: Mapping[str, str],
    load: Mapping[str, int],
) -> str | None:
    """Where to move a rank off ``leaver_node`` (drain, preemption): a live node with an idle
    spare, preferring another failure domain, then the least loaded; None when no node can
    take it (the caller then waits, or lets ordinary recovery handle the rank)."""
    spare_nodes = {node for node in idle_spares.values()}
    candidates = [n for n in live_nodes if n != leaver_node and n in spare_nodes]
    if not candidates:
        return None
    home = domains.get(leaver_node, leaver_node)

    def key(n: str) -> tuple[int, int, str]:
        return (int(domains.get(n, n) == home), load.get(n, 0), n)

    return min(candidates, key=key)


def boundary_step(latest: Mapping[int, int], margin: int = BOUNDARY_MARGIN) -> int:
    """The step every rank stops after: ``margin`` beyond the newest step any rank reported,
    so that none has begun it when the pause request arrives."""
    return max(latest.values(), default=0) + margin


def catch_up_to(m: CatchUp, committed: int | None) -> tuple[int, bool] | None:
    """The next catch-up fetch: (step, as a delta?), or None (pause now).

    Only once the joiner is ready, with no catch-up in flight and a committed step newer
    than the one the target holds; at most :data:`CATCHUP_ROUNDS` rounds, so a pause is
    never put off for long. The first round is a delta against the step held (the steps the
    joiner missed); the second fetches the whole step under the same load, so that
    :func:`swap_as_delta` compares like with like."""
    if not m.ready or m.catchup_req is not None or m.held is None or committed is None:
        return None
    if committed <= m.held or m.rounds >= CATCHUP_ROUNDS:
        return None
    return committed, m.rounds == 0


def swap_as_delta(full: Transfer | None, deltas: Sequence[Transfer], mode: str = "auto") -> bool:
    """Whether the swap fetches the boundary as a delta against the step the target holds.

    ``mode`` (``--swap-transfer``): ``"delta"`` or ``"whole"`` decide alone; ``"auto"``: only
    when measured: the median catch-up delta installed snapshot bytes faster than the
    catch-up that fetched the whole step did (the prepare fetch is no measure: it competes
    with the joiner's start). On a fast link the whole step wins (encoding costs more than the
    bytes it saves); on a slow or capped link the delta does."""
    if mode != "auto":
        return mode == "delta"
    if full is None or not deltas:
        return False
    rates = sorted(t.rate for t in deltas)
    return rates[len(rates) // 2] > full.rate
