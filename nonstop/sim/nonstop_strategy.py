"""nonstop's strategy, driven by the runtime's own pure policies.

Every decision goes through :mod:`nonstop.runtime.policy`, called through the module so that the
simulator and the runtime cannot disagree (a test monkeypatches them and sees the result change):

* :func:`~nonstop.runtime.policy.recovery_action` — restart in place, replace the node, quarantine
  it, or migrate (planned events);
* :class:`~nonstop.runtime.policy.QuarantinePolicy` — a node failing too often is vacated;
* :func:`~nonstop.runtime.policy.place_replicas` — which nodes hold each node's snapshot replicas
  (asked on a window of the ring around the node: the same answer as on the whole ring, see
  :meth:`Nonstop.holders`, at O(window) cost instead of O(nodes^2));
* :func:`~nonstop.runtime.policy.choose_replacements` — a hot spare (process spare on the node, or
  a spare node), a cold process in place, or a fresh node from the scheduler's pool;
* :func:`~nonstop.runtime.policy.choose_tier` — restore from local memory, a peer's replica, or
  the durable tier (then every rank rolls back to the newest persisted step).

Granularity: one call per failed node; the node's ranks move together (a node's GPUs share its
snapshot memory and its spare), so ``failed`` holds one entry for the node's rank group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nonstop.runtime import policy
from nonstop.runtime.policy import FailureKind, QuarantinePolicy, RecoveryAction, ReplacementSource, Tier
from nonstop.sim.api import JobSpec, Recovery, RunContext, default_spare_nodes, require
from nonstop.sim.calibrate import Calibration, load_calibration, rendezvous_s
from nonstop.sim.failures import Cause
from nonstop.sim.strategies import SparePool

__all__ = ["Nonstop", "NonstopParams"]

POOL = "pool"  # a fresh node from the scheduler (cold, pays node_provision_s)


@dataclass(frozen=True, kw_only=True)
class NonstopParams:
    """nonstop's knobs. ``None`` = derived from the calibration (see ``Nonstop.describe()``).

    snapshot_every: steps between in-memory snapshots. stall_s: loop stall per snapshot.
    replicas: peer replicas of each node's snapshots (r). spares_per_node: pre-warmed process
    spares on every node. spare_nodes: hot spare nodes (None: 1% of the job's nodes, at least 1).
    persist_every_s: seconds of training between durable checkpoints. quarantine: the runtime's
    policy. migration_pause_s: the pause of a live migration.
    """

    snapshot_every: int = 1
    stall_s: float | None = None
    replicas: int = 1
    spares_per_node: int = 1
    spare_nodes: int | None = None
    persist_every_s: float = 1800.0
    quarantine: QuarantinePolicy = field(default_factory=QuarantinePolicy)
    migration_pause_s: float | None = None

    def __post_init__(self) -> None:
        require(self.snapshot_every >= 1, f"--snapshot-every must be >= 1 step; got {self.snapshot_every}")
        require(self.replicas >= 0, f"--replicas must be >= 0; got {self.replicas}")
        require(self.spares_per_node >= 0, f"--spares-per-node must be >= 0; got {self.spares_per_node}")
        require(
            self.spare_nodes is None or self.spare_nodes >= 0,
            f"--spare-nodes must be >= 0; got {self.spare_nodes}",
        )
        require(self.persist_every_s > 0, f"--persist-every-s must be > 0; got {self.persist_every_s}")
        for label, v in (("stall", self.stall_s), ("migration pause", self.migration_pause_s)):
            require(v is None or (math.isfinite(v) and v >= 0), f"nonstop {label} must be >= 0 s; got {v}")


class Nonstop:
    """Every-step snapshots in memory, peer replicas, hot spares, in-place rebuild, live migration.

    A process failure (crash, hang, error) restarts the node's ranks in place from local memory,
    on a process spare if one is ready; a lost node is replaced by a spare node (or the pool) that
    restores from a peer replica; a node the quarantine policy flags is vacated the same way; a
    planned event migrates live (one pause, nothing lost). When a lost node's replica holders are
    all unavailable too, every rank rolls back to the newest durable checkpoint. Survivors keep
    their processes; the group is rebuilt in place (rendezvous law at the job's scale).
    """

    def __init__(
        self, *, job: JobSpec, params: NonstopParams | None = None, calibration: Calibration | None = None
    ) -> None:
        self.name = "nonstop"
        self.job = job
        self.p = p = params or NonstopParams()
        self.cal = cal = calibration or load_calibration()
        b = job.state_bytes_per_gpu
        self.num_spare_nodes = default_spare_nodes(job.num_nodes) if p.spare_nodes is None else p.spare_nodes
        self.spare_gpus = self.num_spare_nodes * job.gpus_per_node
        self.stall = cal.snapshot_stall_s(b) if p.stall_s is None else p.stall_s
        require(
            self.stall < job.step_s * p.snapshot_every,
            f"a snapshot stall of {self.stall:.2f} s does not fit in {p.snapshot_every} step(s) of "
            f"{job.step_s} s: snapshot less often (--snapshot-every)",
        )
        self.transfer = cal.peer_transfer_s(b)
        self.replica_lag_steps = math.ceil(p.replicas * self.transfer / job.step_s) if p.replicas else 0
        self.restore_local = cal.restore_local_s(b)
        self.durable_read = cal.durable_read_s(b, job.num_gpus, job.gpus_per_node)
        self.persist_write = cal.durable_write_s(b, job.num_gpus, job.gpus_per_node)
        require(
            self.persist_write <= p.persist_every_s,
            f"persisting takes {self.persist_write:.0f} s: use --persist-every-s >= that",
        )
        self.rebuild = rendezvous_s(job.num_nodes)
        self.migration = (
            cal.migration_pause_steps * job.step_s if p.migration_pause_s is None else p.migration_pause_s
        )
        self._holders: dict[int, list[int]] = {}

    # -- the ring of replica holders ------------------------------------------------------------
    def holders(self, pos: int) -> list[int]:
        """Positions holding replicas of node ``pos`` (``policy.place_replicas``, cached).

        Domains are blocks of ``nodes_per_domain`` consecutive positions. Walking the ring from
        ``pos``, at most ``nodes_per_domain - 1`` same-domain nodes come before ``r`` nodes of other
        domains, so the policy asked on the window ``pos .. pos + nodes_per_domain + r - 1`` gives
        the answer it gives on the whole ring (tested); small jobs use the whole ring.
        """
        if pos not in self._holders:
            n, d, r = self.job.num_nodes, self.job.nodes_per_domain, self.p.replicas
            size = n if n <= 2 * (d + r) else d + r
            names = [f"n{(pos + k) % n}" for k in range(size)]
            domains = {nm: f"d{int(nm[1:]) // d}" for nm in names}
            placed = policy.place_replicas(names, domains, r)[names[0]]
            self._holders[pos] = [int(nm[1:]) for nm in placed]
        return self._holders[pos]

    # -- per run ----------------------------------------------------------------------------------
    def begin(self, ctx: RunContext) -> None:
        del ctx
        self.work = 0.0
        self.history: dict[int, list[float]] = {}
        self.proc_spare_at: dict[int, float] = {}  # position -> when its process spare is ready again
        self.mem_back_at: dict[int, float] = {}  # position -> when its snapshot memory is usable again
        self.spares = SparePool(self.num_spare_nodes)

    def advance(self, dt: float) -> float:
        frac = self.stall / (self.job.step_s * self.p.snapshot_every)
        self.work += dt * (1.0 - frac)
        return dt * frac

    def _lost(self, tier: Tier) -> float:
        step, k = self.job.step_s, self.p.snapshot_every
        committed = math.floor(self.work / step / k) * k * step
        if tier is Tier.PEER:
            committed = max(0.0, committed - self.replica_lag_steps * step)
        elif tier is Tier.DURABLE:
            every = self.p.persist_every_s
            committed = max(0.0, math.floor((self.work - self.persist_write) / every) * every)
        return self.work - committed

    def on_failure(self, *, now: float, node: int, cause: Cause, recovering: bool) -> Recovery:
        cal = self.cal
        name = f"n{node}"
        hist = self.history.setdefault(node, [])
        hist.append(now)
        quarantined = self.p.quarantine.should_quarantine(hist, now=now)
        action = policy.recovery_action(cause.kind, quarantined=quarantined, planned=cause.planned)
        alive = cause.kind is not FailureKind.NODE_LOST or cause.planned  # notice: still up
        stays = alive and action is RecoveryAction.RESTART_IN_PLACE  # the node keeps playing its ranks
        holders = [h for h in self.holders(node) if self.mem_back_at.get(h, 0.0) <= now]
        spares: dict[int, str] = {}
        if stays and self.p.spares_per_node > 0 and self.proc_spare_at.get(node, 0.0) <= now:
            spares[0] = name
        # Spare nodes are interchangeable (all idle, load 0): the policy takes the first in order,
        # so offering the first few gives its answer at O(1) instead of O(spares) per failure.
        idle = self.spares.idle(now, limit=2)
        spares.update({i + 1: s for i, s in enumerate(idle)})
        live = ([name] if alive else []) + [f"n{h}" for h in holders] + idle + [POOL]
        load = {nm: 1 for nm in live if nm.startswith("n")}
        placement = policy.choose_replacements(
            failed={0: name},
            spares=spares,
            data_nodes={0: [f"n{h}" for h in holders]},
            live_nodes=live,
            load=load,
            quarantined=[] if stays else [name],
        )[0]
        in_place = placement.node == name
        tier = policy.choose_tier(
            local_alive=alive and in_place,
            has_local=True,
            peer_has=bool(holders) or alive,
            durable_has=True,
        )
        assert tier is not None  # the durable tier always has the newest persisted step
        if action is RecoveryAction.MIGRATE:
            lost = 0.0
            pause = [("plan", cal.plan_s), ("restore", self.migration)]
        else:
            lost = 0.0 if recovering and tier is not Tier.DURABLE else self._lost(tier)
            if placement.source is ReplacementSource.SPARE:
                launch = cal.launch_spare_s
            elif placement.node == POOL:
                launch = cal.node_provision_s + cal.launch_cold_s
            else:
                launch = cal.launch_cold_s
            if tier is Tier.LOCAL:
                restore = self.restore_local
            elif tier is Tier.PEER:
                restore = self.transfer + self.restore_local
            else:
                restore = self.durable_read
            pause = [
                ("detect", self._detect(cause.kind)),
                ("plan", cal.plan_s),
                ("launch", launch),
                ("restore", restore),
                ("rebuild", self.rebuild),
            ]
        self.work -= lost
        # bookkeeping: spares used, machines leaving, memory that must be re-replicated
        back = sum(s for _, s in pause) + self.transfer * max(1, self.p.replicas)
        if placement.source is ReplacementSource.SPARE and placement.node == name:
            self.proc_spare_at[node] = now + cal.launch_cold_s  # a new spare warms up
        elif placement.node != name:
            healthy = action is RecoveryAction.RESTART_IN_PLACE
            if placement.node != POOL:
                self.spares.take(placement.node, now=now, back_after_s=0.0 if healthy else cal.repair_s)
            self.mem_back_at[node] = now + back
            self.history[node] = []  # a different machine plays this position now
            self.proc_spare_at[node] = now + back
        source = "pool" if placement.node == POOL else placement.source.value
        return Recovery(pause=pause, lost_work_s=lost, action=action, tier=tier, replacement=source)

    def _detect(self, kind: FailureKind) -> float:
        cal = self.cal
        if kind is FailureKind.NODE_LOST:
            return cal.node_lease_s
        if kind is FailureKind.HANG:
            return cal.heartbeat_timeout_s + cal.detect_exit_s
        return cal.detect_exit_s

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "snapshot_every": self.p.snapshot_every,
            "stall_s": self.stall,
            "stall_fraction": self.stall / (self.job.step_s * self.p.snapshot_every),
            "replicas": self.p.replicas,
            "replica_lag_steps": self.replica_lag_steps,
            "spares_per_node": self.p.spares_per_node,
            "spare_nodes": self.num_spare_nodes,
            "persist_every_s": self.p.persist_every_s,
            "persist_write_s": self.persist_write,
            "restore_local_s": self.restore_local,
            "peer_transfer_s": self.transfer,
            "durable_read_s": self.durable_read,
            "rebuild_s": self.rebuild,
            "migration_pause_s": self.migration,
            "quarantine": {
                "max_failures": self.p.quarantine.max_failures,
                "window_s": self.p.quarantine.window_s,
            },
        }
