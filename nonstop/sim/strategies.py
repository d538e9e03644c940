"""Baseline strategies: periodic checkpoint + full restart, and torchft-like replica healing.

Both classify each failure with the simulator's :func:`nonstop.sim.actions.recovery_action`
(called through the module, as nonstop's strategy does), then apply their own mechanics.
:mod:`nonstop.sim.nonstop_strategy` holds nonstop's own strategy.

A ``None`` cost parameter means "derive it from the calibration" (:mod:`nonstop.sim.calibrate`);
``describe()`` reports the value used and where it came from.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass
from typing import Any

from nonstop.policy.decisions import FailureKind, Tier
from nonstop.sim import actions
from nonstop.sim.actions import RecoveryAction
from nonstop.sim.api import Charge, JobSpec, Recovery, RunContext, default_spare_nodes, require
from nonstop.sim.calibrate import Calibration, load_calibration, rendezvous_s, restart_s
from nonstop.sim.failures import Cause

__all__ = ["DEFAULT_GROUP_NODES", "CheckpointRestart", "SparePool", "TorchftLike"]

# A replica group is one model-parallel copy of the model: Llama 3 405B trains with TP 8 x PP 16
# = 128 GPUs = 16 nodes per copy (arXiv:2407.21783, Table 4). Jobs whose node count 16 does not
# divide use the largest common divisor.
DEFAULT_GROUP_NODES = 16


class SparePool:
    """Idle spare nodes ``s0..s{n-1}``; a machine taken out of the job comes back after a delay."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._idle = [f"s{i}" for i in range(count)]
        self._returning: list[tuple[float, str]] = []
        self._serial = count

    def idle(self, now: float, limit: int | None = None) -> list[str]:
        """Idle spares in pool order (the first ``limit`` of them)."""
        while self._returning and self._returning[0][0] <= now:
            self._idle.append(heapq.heappop(self._returning)[1])
        return self._idle[:limit] if limit is not None else list(self._idle)

    def take(self, name: str, *, now: float, back_after_s: float | None) -> None:
        """Use spare ``name``; the machine it replaces joins the pool after ``back_after_s``
        (None: never, e.g. it is being repaired for longer than the run)."""
        self._idle.remove(name)
        if back_after_s is not None:
            heapq.heappush(self._returning, (now + back_after_s, f"s{self._serial}"))
            self._serial += 1


@dataclass(frozen=True, kw_only=True)
class _CRParams:
    interval_s: float
    blocking_s: float | None = None
    write_s: float | None = None
    restart_s: float | None = None
    load_s: float | None = None
    detect_s: float | None = None
    hang_detect_s: float | None = None
    spare_nodes: int | None = None
    node_replace_s: float | None = None
    first_step_extra_s: float | None = None


class CheckpointRestart:
    """Periodic checkpoint + full job restart: the DCP (async save) + torchrun baseline.

    Every ``interval_s`` seconds of training, the job blocks ``blocking_s`` to stage a checkpoint
    (``dcp.async_save``), which becomes durable ``write_s`` later. Any failure restarts the whole
    job from the newest durable checkpoint: detect (process exit: measured; hang: the collective
    timeout; lost node: the node lease), wait for a replacement node if one was lost (a spare, or
    the scheduler's pool), restart (Parcae's law), read the checkpoint, first step. A planned event
    saves a checkpoint and restarts without losing work.
    """

    def __init__(
        self,
        *,
        job: JobSpec,
        interval_s: float,
        calibration: Calibration | None = None,
        blocking_s: float | None = None,
        write_s: float | None = None,
        restart_s: float | None = None,
        load_s: float | None = None,
        detect_s: float | None = None,
        hang_detect_s: float | None = None,
        spare_nodes: int | None = None,
        node_replace_s: float | None = None,
        first_step_extra_s: float | None = None,
        name: str = "checkpoint-restart",
    ) -> None:
        self.name = name
        self.job = job
        self.cal = calibration or load_calibration()
        self.params = _CRParams(
            interval_s=interval_s,
            blocking_s=blocking_s,
            write_s=write_s,
            restart_s=restart_s,
            load_s=load_s,
            detect_s=detect_s,
            hang_detect_s=hang_detect_s,
            spare_nodes=spare_nodes,
            node_replace_s=node_replace_s,
            first_step_extra_s=first_step_extra_s,
        )
        b, g, n = job.state_bytes_per_gpu, job.gpus_per_node, job.num_nodes
        cal = self.cal
        self.blocking = cal.dcp_blocking_s(b) if blocking_s is None else blocking_s
        self.write = cal.durable_write_s(b, job.num_gpus, g) if write_s is None else write_s
        self.restart = _restart_total(n) if restart_s is None else restart_s
        self.rdzv = min(rendezvous_s(n), self.restart) if restart_s is None else 0.0
        self.load = cal.durable_read_s(b, job.num_gpus, g) if load_s is None else load_s
        self.detect_exit = cal.baseline_detect_exit_s if detect_s is None else detect_s
        self.detect_hang = cal.collective_timeout_s if hang_detect_s is None else hang_detect_s
        self.node_lease = cal.node_lease_s if detect_s is None else detect_s
        self.node_replace = cal.node_provision_s if node_replace_s is None else node_replace_s
        self.first_extra = (
            (cal.baseline_first_step_factor - 1.0) * job.step_s
            if first_step_extra_s is None
            else first_step_extra_s
        )
        require(interval_s > 0, f"checkpoint interval must be > 0 s; got {interval_s}")
        self.spare_nodes = default_spare_nodes(n) if spare_nodes is None else spare_nodes
        require(self.spare_nodes >= 0, f"spare nodes must be >= 0; got {spare_nodes}")
        for label, v in (
            ("blocking", self.blocking),
            ("write", self.write),
            ("restart", self.restart),
            ("load", self.load),
            ("node replacement", self.node_replace),
            ("first-step extra", self.first_extra),
        ):
            require(math.isfinite(v) and v >= 0, f"checkpoint-restart {label} time must be >= 0 s; got {v}")
        require(
            self.write <= interval_s,
            f"a checkpoint takes {self.write:.0f} s to become durable: use an interval >= that "
            f"(got {interval_s:.0f} s)",
        )
        self.spare_gpus = self.spare_nodes * g

    # -- per run ------------------------------------------------------------------------------
    def begin(self, ctx: RunContext) -> None:
        del ctx
        self.work = 0.0
        self.base = 0.0  # work at the start of the current cycle (the newest staged checkpoint)
        self.prev = 0.0  # the checkpoint before it
        self.phase = 0.0  # wall seconds into the current cycle (work, then blocking)
        self.base_durable_at = 0.0  # phase at which ``base`` is durable
        self.spares = SparePool(self.spare_nodes)

    def advance(self, dt: float) -> float:
        tau, blk = self.params.interval_s, self.blocking
        cycle = tau + blk
        total = self.phase + dt
        k = math.floor(total / cycle)
        rem = total - k * cycle
        worked = (k * tau + min(rem, tau)) - min(self.phase, tau)
        if k >= 1:
            self.prev = self.base + (k - 1) * tau
            self.base += k * tau
            self.base_durable_at = self.write
        self.phase = rem
        self.work += worked
        return dt - worked

    def on_failure(self, *, now: float, node: int, cause: Cause, recovering: bool) -> Recovery:
        del node
        action = actions.recovery_action(cause.kind, planned=cause.planned)
        if action is RecoveryAction.MIGRATE and not recovering:
            pause = [("plan", self.blocking + self.write)]  # save now, then restart
            lost = 0.0
            committed = self.work
        else:
            committed = self.base if self.phase >= self.base_durable_at else self.prev
            lost = self.work - committed
            pause = [("detect", self._detect(cause.kind))]
        replacement = "none"
        wait = 0.0
        if cause.kind is FailureKind.NODE_LOST:
            idle = self.spares.idle(now)
            if idle:
                self.spares.take(idle[0], now=now, back_after_s=self.cal.repair_s)
                replacement = "spare"
            else:
                wait = self.node_replace
                replacement = "pool"
        pause += [
            ("launch", wait + self.restart - self.rdzv),
            ("restore", self.load),
            ("rebuild", self.rdzv),
            ("resume", self.first_extra),
        ]
        self.work = self.base = self.prev = committed
        self.phase = 0.0
        self.base_durable_at = 0.0
        return Recovery(
            pause=pause, lost_work_s=lost, action=action, tier=Tier.DURABLE, replacement=replacement
        )

    def _detect(self, kind: FailureKind) -> float:
        if kind is FailureKind.NODE_LOST:
            return self.node_lease
        return self.detect_hang if kind is FailureKind.HANG else self.detect_exit

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "interval_s": self.params.interval_s,
            "blocking_s": self.blocking,
            "write_s": self.write,
            "restart_s": self.restart,
            "rendezvous_s": self.rdzv,
            "load_s": self.load,
            "detect_exit_s": self.detect_exit,
            "detect_hang_s": self.detect_hang,
            "node_replace_s": self.node_replace,
            "first_step_extra_s": self.first_extra,
            "spare_nodes": self.spare_nodes,
            "set": {k: v for k, v in asdict(self.params).items() if v is not None},
        }


def _restart_total(num_nodes: int) -> float:
    return restart_s(num_nodes)


class TorchftLike:
    """torchft-style fault tolerance: replica groups heal, the others train on.

    The job is ``num_nodes / group_nodes`` data-parallel replica groups (default 16 nodes each,
    see :data:`DEFAULT_GROUP_NODES`). When a node fails, the
    surviving groups' allreduce fails after the heartbeat timeout; they discard the step in flight,
    form a new quorum without the failed group and train on. The
    failed group restarts its processes (Parcae's law on the group's nodes; a lost node first waits
    for a spare or the pool), fetches the weights from a live group over the network, and rejoins
    at the next quorum; meanwhile its GPUs are idle (booked per stage). If no other group is up, the
    job restarts from its periodic durable checkpoint, like checkpoint-restart.

    Every quorum that changes the membership -- the failed group leaving, then rejoining -- makes
    every replica reconfigure its cross-group process group with all the replicas in it (torchft's
    ``Manager._async_quorum`` calls ``_pg.configure`` whenever the quorum id changes): a group over
    one rank of each replica group, so over ``num_groups`` nodes, charged the same rendezvous law
    as nonstop's rebuild of that group (:func:`rendezvous_s`). The quorum runs beside the step's
    forward (torchft's async quorum), so each membership change stops the job for ``requorum`` =
    quorum + reconfigure - forward (``Calibration.forward_share`` of the step), at least 0.
    """

    def __init__(
        self,
        *,
        job: JobSpec,
        group_nodes: int | None = None,
        calibration: Calibration | None = None,
        heartbeat_s: float | None = None,
        quorum_s: float | None = None,
        reconfigure_s: float | None = None,
        restart_s: float | None = None,
        ckpt_interval_s: float = 3600.0,
        spare_nodes: int | None = None,
        name: str = "torchft-like",
    ) -> None:
        if group_nodes is None:
            group_nodes = math.gcd(job.num_nodes, DEFAULT_GROUP_NODES)
        if spare_nodes is None:
            spare_nodes = default_spare_nodes(job.num_nodes)
        require(
            group_nodes >= 1 and job.num_nodes % group_nodes == 0,
            f"--group-nodes must divide the job's {job.num_nodes} nodes; got {group_nodes}",
        )
        require(ckpt_interval_s > 0, "torchft checkpoint interval must be > 0 s")
        require(spare_nodes >= 0, f"spare nodes must be >= 0; got {spare_nodes}")
        self.name = name
        self.job = job
        self.cal = cal = calibration or load_calibration()
        self.group_nodes = group_nodes
        self.num_groups = job.num_nodes // group_nodes
        self.heartbeat = cal.torchft_heartbeat_s if heartbeat_s is None else heartbeat_s
        self.quorum = cal.quorum_s if quorum_s is None else quorum_s
        self.reconfigure = rendezvous_s(self.num_groups) if reconfigure_s is None else reconfigure_s
        self.forward = cal.forward_share * job.step_s
        # what each membership change stops the job for: the part of the quorum and the
        # reconfiguration the step's forward does not hide
        self.requorum = max(0.0, self.quorum + self.reconfigure - self.forward)
        self.group_restart = _restart_total(group_nodes) if restart_s is None else restart_s
        self.ckpt_interval = ckpt_interval_s
        self.spare_nodes = spare_nodes
        self.spare_gpus = spare_nodes * job.gpus_per_node
        b = job.state_bytes_per_gpu
        self.fetch = cal.peer_transfer_s(b)
        self.step_overhead_fraction = cal.torchft_step_overhead_s / job.step_s
        self.ckpt_blocking = cal.dcp_blocking_s(b)
        self.durable_load = cal.durable_read_s(b, job.num_gpus, job.gpus_per_node)
        for label, v in (
            ("heartbeat", self.heartbeat),
            ("quorum", self.quorum),
            ("reconfigure", self.reconfigure),
            ("restart", self.group_restart),
        ):
            require(math.isfinite(v) and v >= 0, f"torchft {label} time must be >= 0 s; got {v}")

    def begin(self, ctx: RunContext) -> None:
        del ctx
        self.work = 0.0
        self.since_ckpt = 0.0
        self.down_until: dict[int, float] = {}
        self.spares = SparePool(self.spare_nodes)

    def advance(self, dt: float) -> float:
        """Checkpoint blocking, and every step torchft's own cost (quorum, commit vote, managed
        allreduce: ``Calibration.torchft_step_overhead_s``, measured side by side with DDP)."""
        cycle = self.ckpt_interval + self.ckpt_blocking
        n_ckpt = math.floor((self.since_ckpt + dt) / cycle)
        overhead = n_ckpt * self.ckpt_blocking
        self.since_ckpt = (self.since_ckpt + dt) - n_ckpt * cycle
        overhead += (dt - overhead) * self.step_overhead_fraction
        self.work += dt - overhead
        return overhead

    def on_failure(self, *, now: float, node: int, cause: Cause, recovering: bool) -> Recovery:
        action = actions.recovery_action(cause.kind, planned=cause.planned)
        group = node // self.group_nodes
        gpus = self.group_nodes * self.job.gpus_per_node
        down = sum(1 for g, t in self.down_until.items() if t > now and g != group)
        wait, replacement = 0.0, "none"
        if cause.kind is FailureKind.NODE_LOST:
            idle = self.spares.idle(now)
            if idle:
                self.spares.take(idle[0], now=now, back_after_s=self.cal.repair_s)
                replacement = "spare"
            else:
                wait, replacement = self.cal.node_provision_s, "pool"
        pause: list[tuple[str, float]]
        if self.num_groups - 1 - down <= 0:  # nobody to heal from: durable restart of the job
            lost = 0.0 if recovering else self.since_ckpt
            self.work -= lost
            self.since_ckpt = 0.0
            pause = [
                ("detect", self.heartbeat),
                ("launch", wait + _restart_total(self.job.num_nodes)),
                ("restore", self.durable_load),
                ("rebuild", self.quorum),
            ]
            self.down_until.clear()
            return Recovery(
                pause=pause, lost_work_s=lost, action=action, tier=Tier.DURABLE, replacement=replacement
            )
        step = self.job.step_s
        if action is RecoveryAction.MIGRATE:  # the group leaves at a step boundary
            pause = [("rebuild", self.requorum)]
            lost = 0.0
        else:
            pause = [("detect", self.heartbeat), ("rebuild", self.requorum)]
            lost = 0.0 if recovering else math.fmod(self.work, step)  # the step in flight
            self.work -= lost
        heal = [
            Charge(stage="launch", seconds=wait + self.group_restart, gpus=gpus),
            Charge(stage="restore", seconds=self.fetch, gpus=gpus),
            # its rejoin: the group waits the whole quorum, which every group reconfigures for
            Charge(stage="rebuild", seconds=self.quorum + self.reconfigure - self.requorum, gpus=gpus),
            Charge(stage="rebuild", seconds=self.requorum, gpus=self.job.num_gpus),
        ]
        start = max(now + sum(s for _, s in pause), self.down_until.get(group, 0.0))
        self.down_until[group] = start + sum(c.seconds for c in heal)
        return Recovery(
            pause=pause,
            lost_work_s=lost,
            partial=heal,
            partial_delay_s=start - now - sum(s for _, s in pause),
            action=action,
            tier=Tier.PEER,
            replacement=replacement,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "strategy": self.name,
            "group_nodes": self.group_nodes,
            "num_groups": self.num_groups,
            "heartbeat_s": self.heartbeat,
            "quorum_s": self.quorum,
            "reconfigure_s": self.reconfigure,
            "forward_s": self.forward,
            "requorum_s": self.requorum,
            "group_restart_s": self.group_restart,
            "fetch_s": self.fetch,
            "ckpt_interval_s": self.ckpt_interval,
            "ckpt_blocking_s": self.ckpt_blocking,
            "step_overhead_s": self.cal.torchft_step_overhead_s,
            "spare_nodes": self.spare_nodes,
        }
