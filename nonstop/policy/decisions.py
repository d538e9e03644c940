"""Pure decision policies of the control plane.

Nothing here does I/O or reads a clock: callers pass ``now`` and observations,
and get decisions back. The runtime and the simulator call the same
functions, so they cannot disagree (``tests/structure/test_policy_callers.py``: every name
exported here has a caller in the runtime).
"""

from __future__ import annotations

import enum
import signal
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nonstop.errors import UsageError

__all__ = [
    "DetectorConfig",
    "FailureKind",
    "Placement",
    "QuarantinePolicy",
    "RestoreSource",
    "Tier",
    "choose_replacements",
    "place_replicas",
    "restore_source",
    "RankObservation",
    "ReplacementSource",
    "classify_exit",
    "committed_step",
    "find_hung_ranks",
    "median_step_time",
]


@dataclass(frozen=True, kw_only=True)
class DetectorConfig:
    """How failures are detected.

    heartbeat_interval_s: how often a worker's heartbeat thread reports.
    heartbeat_timeout_s: silence after which a live process counts as hung
        (a SIGSTOPped or GIL-deadlocked worker sends nothing).
    hang_factor: no step progress for ``hang_factor`` x the median step time
        (and no collective pending on that rank) counts as a hang.
    hang_min_s: floor for the progress-based hang timeout.
    startup_grace_s: before a rank's first step, only process exit and
        heartbeat silence count (the first step includes lazy init).
    confirm_silence: a silent worker's node agent confirms the hang before the kill
        (``agent/silence.py``): one it sees move -- starved of CPU, not stuck -- is spared
        and allowed ``JOB_STALL_FACTOR`` x the timeout. False: killed at the first silence.
    """

    heartbeat_interval_s: float = 0.1
    heartbeat_timeout_s: float = 1.0
    hang_factor: float = 10.0
    hang_min_s: float = 3.0
    startup_grace_s: float = 120.0
    confirm_silence: bool = True

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s <= 0 or self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise UsageError(
                "heartbeat timeout must be greater than the heartbeat interval (both > 0); "
                f"got interval={self.heartbeat_interval_s}, timeout={self.heartbeat_timeout_s}"
            )
        if self.hang_factor <= 1 or self.hang_min_s <= 0:
            raise UsageError("--hang-factor must be > 1 and --hang-min-s > 0")


class FailureKind(enum.StrEnum):
    """Why a rank stopped. The recovery path is the same for all three today;
    the kind feeds failure grading (restart in place vs replace vs quarantine)."""

    KILLED = "kill"  # died of a signal nobody in nonstop sent
    HANG = "hang"  # no heartbeat / no progress; nonstop killed it
    EXIT = "exit"  # exited on its own before the job finished
    ERROR = "error"  # raised an exception that was not a peer's failure
    NODE_LOST = "node"  # the node's agent vanished (lease expired or its channel died)


class Tier(enum.StrEnum):
    """Where a rank's restore step is read from, fastest first (:func:`restore_source`)."""

    LOCAL = "local"  # the rank's own slots in the memory of the node that plays it: nothing fetched
    # fetched into that node's memory from a copy elsewhere in memory: a replica (another node's,
    # or one this node keeps for a peer: a copy within the node) or a survivor's rescued step
    PEER = "peer"
    DURABLE = "durable"  # the durable tier (disk / object store): every rank rolls back to it


class ReplacementSource(enum.StrEnum):
    SPARE = "spare"  # a pre-warmed process already connected and waiting
    COLD = "cold"  # a new process (pays interpreter + torch import)


REBUILD_SILENCE_FACTOR = 10.0  # how much longer a rank joining a new group may be silent
# ... and one that has not completed a step in its generation yet: its first step pays lazy
# initialisation (imports, DDP's first iteration, the optimizer's state) with the GIL held for long
# stretches, which on a saturated machine starved the heartbeat thread past 1 s -- and a job that
# loses a rank before its first committed step cannot recover. 3x was measured too little: with
# the suite, a benchmark and CPU burners on this 2-core VM, ranks of a 4-rank job went 3 s silent
# in step 0 and the job failed (in either snapshot layout); a rank truly hung in its first step
# is now found after 10 s instead of 3 s
FIRST_STEP_SILENCE_FACTOR = REBUILD_SILENCE_FACTOR
# every rank of the job without progress at once, none of them in a collective: how much longer
# they get. Measured: with two test jobs and two CPU burners on this 2-core VM all four ranks of
# a DDP job went 3.2-3.4 s without a step (limit 3 s) and nonstop killed the whole job
JOB_STALL_FACTOR = 3.0


@dataclass(frozen=True, kw_only=True)
class RankObservation:
    """What the coordinator last saw of the worker playing a rank (monotonic seconds)."""

    last_heartbeat: float
    last_progress: float
    collective_pending: bool
    stepped: bool  # has completed at least one step in this generation
    # joining the new generation's groups (REBUILD, not ready yet): gloo's rendezvous and a sharded
    # model's mesh and build run in C with the GIL held for long stretches on a busy machine, so
    # its heartbeats may pause; silence is judged with REBUILD_SILENCE_FACTOR x the timeout (the
    # stage's own rebuild_timeout_s bounds it too)
    rebuilding: bool = False
    # the rank's own word (its latest heartbeat): seconds out of any collective without completing
    # a step (None: not reported). A healthy peer waiting on a stalled rank reports a collective
    # before this grows past the limit, however late its heartbeats arrive under load; and one
    # that waited long for a slow peer starts it afresh as it leaves the collective.
    idle_s: float | None = None
    # the rank's own word: its training thread used the CPU between its last two heartbeats. A
    # rank starved of CPU on its way to the collective its peers wait in moves; one stuck in a
    # sleep, a lock, a wait or a call blocked in the kernel does not.
    moving: bool = False
    # silent past the timeout once already, and its node agent saw it move (agent/silence.py):
    # starved, not hung -- its silence is allowed JOB_STALL_FACTOR x the timeout
    excused: bool = False


def classify_exit(returncode: int, *, killed_for_hang: bool) -> FailureKind:
    if killed_for_hang:
        return FailureKind.HANG
    if returncode < 0:
        return FailureKind.KILLED
    return FailureKind.EXIT


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def committed_step(complete_steps: Mapping[int, Sequence[int]], world_size: int) -> int | None:
    """Newest step whose snapshot is complete for every rank ``0..world_size-1``.

    ``complete_steps[rank]`` lists the steps with a complete snapshot of that
    rank. Returns None if no step is complete everywhere.
    """
    common: set[int] | None = None
    for rank in range(world_size):
        have = set(complete_steps.get(rank, ()))
        common = have if common is None else common & have
    return max(common) if common else None


def median_step_time(step_times: Sequence[float]) -> float | None:
    return statistics.median(step_times) if step_times else None


def find_hung_ranks(
    observations: Mapping[int, RankObservation],
    *,
    now: float,
    median_step_s: float | None,
    config: DetectorConfig,
) -> dict[int, str]:
    """Ranks to declare hung, with the reason.

    * heartbeat silent for ``heartbeat_timeout_s``: the process is stopped or
      wedged with the GIL held (a rank blocked in a collective still beats); 10x that while it
      joins a new group, 3x before its first step of the generation (lazy initialisation).
      The coordinator has the rank's node agent confirm it (``agent/silence.py``): a rank the
      agent saw move is ``excused`` -- starved of CPU -- and allowed ``JOB_STALL_FACTOR`` x the
      timeout, after which it is killed unconditionally.
    * no step progress for ``limit = max(hang_factor * median, hang_min_s)`` while no
      collective is pending on that rank, and the rank itself said (``idle_s``) that it has
      been out of any collective without completing a step for longer than ``limit`` (seconds
      spent waiting in one for a slow peer do not count): it is stuck in its own code. Its
      peers waiting in the allreduce for it are not blamed, even when their heartbeat saying so
      arrives late (a busy machine): the coordinator's clock of their progress runs from when
      their step reports *arrived*, their own from when they were last in a collective, and
      the last word before they entered the collective was a small ``idle_s``.
    * every rank stalled that way at once (two ranks or more), or a rank whose training thread is
      still moving (``moving``: it ran or waited for a CPU since its last heartbeat,
      ``train/threadprogress.py``: slow, on a starved CPU, rather than stuck): the limit is
      ``JOB_STALL_FACTOR`` times longer -- a starved machine or a shared stall, not one rank's
      hang. A rank that spins forever moves too: it is caught at the longer limit.
    """
    hung: dict[int, str] = {}
    stalled_for: dict[int, tuple[float, float, bool]] = {}  # rank -> (seconds stalled, its limit, moving)
    for rank, obs in observations.items():
        silent = now - obs.last_heartbeat
        if obs.rebuilding:
            allowed = config.heartbeat_timeout_s * REBUILD_SILENCE_FACTOR
        elif not obs.stepped:
            allowed = config.heartbeat_timeout_s * FIRST_STEP_SILENCE_FACTOR
        else:
            allowed = config.heartbeat_timeout_s
        if obs.excused:
            allowed = max(allowed, config.heartbeat_timeout_s * JOB_STALL_FACTOR)
        if silent > allowed:
            hung[rank] = f"no heartbeat for {silent:.2f}s"
            continue
        if not obs.stepped or median_step_s is None:
            limit = config.startup_grace_s
        else:
            limit = max(config.hang_factor * median_step_s, config.hang_min_s)
        stalled = now - obs.last_progress
        own_word = obs.idle_s is None or obs.idle_s > limit
        if stalled > limit and not obs.collective_pending and own_word:
            stalled_for[rank] = (stalled, limit, obs.moving)
    # Every rank at once, none silent and none waiting in a collective for another: that is the
    # machine or something all ranks share (a starved CPU, a stalled file system), not one rank's
    # hang -- one hung rank leaves its peers waiting in a collective. Killing them all restarts
    # the job for nothing: wait JOB_STALL_FACTOR x longer (as for a rank still moving).
    everyone = len(observations) > 1 and len(stalled_for) == len(observations)
    for rank, (stalled, limit, moving) in stalled_for.items():
        if everyone or moving:
            limit *= JOB_STALL_FACTOR
        if stalled > limit:
            hung[rank] = f"no step progress for {stalled:.2f}s (limit {limit:.2f}s)"
    return hung


@dataclass(frozen=True, kw_only=True)
class QuarantinePolicy:
    """A node that fails ``max_failures`` times within ``window_s`` seconds is quarantined."""

    max_failures: int = 3
    window_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_failures < 1 or self.window_s <= 0:
            raise ValueError("quarantine needs max_failures >= 1 and window_s > 0")

    def should_quarantine(
        self, failure_times: Sequence[float], *, now: float, others_usable: int = 1
    ) -> bool:
        """``failure_times``: when this node's failures happened (any clock, same as ``now``).
        ``others_usable``: live, unquarantined nodes besides this one; the last usable node is
        never quarantined (the job would have nowhere to run: it restarts in place instead)."""
        if others_usable < 1:
            return False
        recent = [t for t in failure_times if now - t <= self.window_s]
        return len(recent) >= self.max_failures


def place_replicas(
    nodes: Sequence[str],
    domains: Mapping[str, str],
    r: int,
    groups: Mapping[str, int] | None = None,
    positions: Mapping[str, int] | None = None,
) -> dict[str, list[str]]:
    """For each node, the ``r`` nodes holding replicas of its ranks' snapshots.

    Walks the ring of ``nodes`` (in the given order) from each node and takes the
    next nodes in a *different* failure domain; if there are not enough of those,
    the remaining slots go to other nodes of the same domain (a replica on
    another node still survives a process or node loss). Deterministic.

    ``groups`` (a sharded job with several replica groups, ``--mesh replicate=R``): node ->
    the replica group its ranks belong to. A node of *another* group is preferred over
    any of its own group (then other domains first within each): a failure that takes a
    whole replica group (its nodes often share a switch) leaves the replica elsewhere.
    ``positions``: node -> its place in its replica group; among the other groups' nodes the
    one at the same place -- its *twin*, holding the same shards -- comes first, since it can
    take the replicated shards from its own memory (``replica/dataplane.py``).
    """
    out: dict[str, list[str]] = {}
    n = len(nodes)
    grp, pos = groups or {}, positions or {}
    for i, node in enumerate(nodes):
        ring = [nodes[(i + k) % n] for k in range(1, n)]
        dom, g, p = domains.get(node, node), grp.get(node, 0), pos.get(node)
        # stable: ring order within each tier
        ranked = sorted(
            ring, key=lambda m: (grp.get(m, 0) == g, p is None or pos.get(m) != p, domains.get(m, m) == dom)
        )
        out[node] = ranked[: max(0, r)]
    return out


@dataclass(frozen=True, kw_only=True)
class RestoreSource:
    """Where one rank's restore step comes from: ``tier``, and for a memory tier the holder
    ``node`` and the slots there (``kind``: ``"local"``, a rank's own -- a survivor's, for a
    rescued step -- or ``"replica"``, a copy kept for a peer); None for the durable tier."""

    tier: Tier
    node: str | None = None
    kind: str | None = None

    @property
    def fetch(self) -> bool:
        """Whether the node playing the rank fetches the step into its memory first."""
        return self.tier is Tier.PEER


def restore_source(
    *, target: str, holders: Sequence[tuple[str, str]], durable: bool = False
) -> RestoreSource | None:
    """Where a rank played on node ``target`` reads its restore step (pure, deterministic).

    ``holders``: where memory holds the step for the rank, ``(node, "local" | "replica")`` --
    the plan's inventory entry (:mod:`nonstop.policy.planning`), with a survivor's rescued step
    for a missing rank given as its donor's ``(node, "local")`` (:func:`~nonstop.policy.rescue.with_rescue`).
    ``durable``: a durable checkpoint may serve (the job has a durable tier).

    * ``target`` holds it in the rank's own slots: :attr:`Tier.LOCAL`, nothing fetched;
    * else a holder: :attr:`Tier.PEER`, fetched from the target's own replica first (a copy
      within the node), then another node's replica, then another node's own slots (a node that
      is alive, or a donor's rescue), by node name;
    * held nowhere in memory: :attr:`Tier.DURABLE` if ``durable`` (the plan goes
      ``FROM_DURABLE``: no step is common to every rank in memory, so every rank rolls back),
      else None (nothing can restore the rank).

    The coordinator (``coordinator/restore_sources.py``, ``plan_fetches``) fetches what this
    says for every rank of a memory restore; the simulator asks it for a failed node's ranks.
    """
    if any(n == target and k == "local" for n, k in holders):
        return RestoreSource(tier=Tier.LOCAL, node=target, kind="local")
    if holders:
        node, kind = sorted(holders, key=lambda h: (h[0] != target, h[1] != "replica", h[0]))[0]
        return RestoreSource(tier=Tier.PEER, node=node, kind=kind)
    return RestoreSource(tier=Tier.DURABLE) if durable else None


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a failed rank is played next: on ``node``, by hot spare ``spare`` or a cold process."""

    node: str
    spare: int | None  # spare id, or None for a cold process

    @property
    def source(self) -> ReplacementSource:
        return ReplacementSource.COLD if self.spare is None else ReplacementSource.SPARE


def choose_replacements(
    *,
    failed: Mapping[int, str | None],
    spares: Mapping[int, str],
    data_nodes: Mapping[int, Sequence[str]],
    live_nodes: Sequence[str],
    load: Mapping[str, int],
    quarantined: Sequence[str] = (),
    cold_elsewhere: bool = True,
    avoid: Mapping[int, str] | None = None,
) -> dict[int, Placement]:
    """Who plays each failed rank, and on which node (pure, deterministic).

    ``failed``: rank -> the node it ran on (None if unknown). ``spares``: idle
    spare id -> its node. ``data_nodes``: rank -> nodes whose memory holds its
    restore step (own node first, then replica holders). ``load``: ranks each
    live node plays now. Preference, per rank in ascending order:

    1. a spare on a node that holds the rank's data (its own node first:
       restart in place; then a replica holder: no transfer needed);
    2. any spare on a usable node, least loaded node first;
    3. a cold process on the rank's own node, if usable;
    4. a cold process on the least loaded usable node -- unless ``cold_elsewhere`` is False
       (elastic jobs: a node has room for its own ranks only); the rank is then left out of
       the result, unplaced.

    ``avoid``: rank -> a node its failure was graded ``replace_elsewhere`` on
    (:mod:`nonstop.policy.grading`: the node, not the process, is suspect): that node is not
    preferred for the rank in 1 and comes last in 2 and 3 -- used only when no other node has
    a spare or room (recovering there beats not recovering).

    Usable: live and not quarantined. Raises ValueError if no node is usable.
    """
    avoid = avoid or {}
    bad = set(quarantined)
    usable = [n for n in live_nodes if n not in bad]
    if not usable:
        raise ValueError("no live, unquarantined node to place ranks on")
    free = {sid: node for sid, node in sorted(spares.items()) if node in usable}
    load_now = {n: load.get(n, 0) for n in usable}
    out: dict[int, Placement] = {}
    for rank in sorted(failed):
        own, shun = failed[rank], avoid.get(rank)
        candidates = ([own] if own else []) + list(data_nodes.get(rank, ()))
        prefer = [n for n in candidates if n in usable and n != shun]
        pick: Placement | None = None
        for node in prefer:
            sid = next((s for s, n in free.items() if n == node), None)
            if sid is not None:
                pick = Placement(node=node, spare=sid)
                break
        if pick is None and free:
            sid = min(free, key=lambda s: (free[s] == shun, load_now[free[s]], usable.index(free[s]), s))
            pick = Placement(node=free[sid], spare=sid)
        if pick is None:
            if own not in usable and not cold_elsewhere:
                continue
            others = [n for n in usable if n != shun]
            if own in others:
                node = own
            elif cold_elsewhere and others:
                node = min(others, key=lambda n: (load_now[n], usable.index(n)))
            elif own in usable:
                node = own  # the node to avoid, but the only place the rank may go
            else:
                node = min(usable, key=lambda n: (load_now[n], usable.index(n)))
            assert node is not None
            pick = Placement(node=node, spare=None)
        if pick.spare is not None:
            del free[pick.spare]
        load_now[pick.node] += 1
        out[rank] = pick
    return out
