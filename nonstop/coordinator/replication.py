"""Replication rounds: the newest step every rank completed goes to its holders' memory.

A round sends step S of every rank to the nodes that hold its replicas (``place_replicas``:
other failure domains first). When every rank's replica of S is acknowledged, S is the
**replicated step** -- the committed step of a job of several nodes -- and every node is told,
so that it may release older slots. A failed round releases its holds and is retried a moment
later; a node lost mid-round abandons it (:meth:`ReplicationRounds.reset`).

Rounds start only when the job phase allows (``phase.may_start(Op.REPLICATE)``, decided by the
coordinator) and run one at a time. I/O goes through the coordinator's
:class:`~nonstop.coordinator.executor.Executor`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nonstop import events as ev
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.executor import Executor
from nonstop.coordinator.view import JobView
from nonstop.events.log import EventLog
from nonstop.mesh import MeshSpec
from nonstop.policy.decisions import place_replicas
from nonstop.protocol.agent import CommittedMsg, ReplicatedMsg, ReplicateMsg

__all__ = ["ReplicationRounds"]

REPLICATED_EVENT_EVERY_S = 1.0
ROUND_RETRY_S = 0.05


@dataclass
class _Round:
    """One replication round: step ``step`` of every rank to its holders."""

    step: int
    pending: set[int]
    started: float
    raw: int = 0
    wire: int = 0


class ReplicationRounds:
    """Starts, tracks and accounts replication rounds (see the module docstring)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        events: EventLog,
        replicas: int,
        mesh: MeshSpec | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.clock = clock
        self.view, self.io, self.events = view, io, events
        self.replicas = replicas
        self.mesh = mesh  # with several replica groups, a rank's replica goes to another group's node
        self.round: _Round | None = None
        self._retry_at = 0.0  # after a failed round, wait a moment before the next
        self._event_at = 0.0
        self.totals: dict[str, int] = {"rounds": 0, "raw_bytes": 0, "wire_bytes": 0, "failed_rounds": 0}

    def stats(self) -> dict[str, Any]:
        t: dict[str, Any] = dict(self.totals)
        t["replicated_step"] = self.view.replicated_step
        t["wire_over_raw"] = (t["wire_bytes"] / t["raw_bytes"]) if t["raw_bytes"] else None
        return t

    def reset(self) -> None:
        """Abandon the round in flight (a node was lost, a generation opened): start over."""
        self.round = None

    def maybe_start(self, *, now: float) -> None:
        """Start the next round when none is in flight and a newer step is complete everywhere
        (the caller checked that the phase allows one)."""
        v = self.view
        if self.round is not None or now < self._retry_at or len(v.latest_step) < v.world_size:
            return
        step = min(v.latest_step.values())
        if v.replicated_step is not None and step <= v.replicated_step:
            return
        alive = v.alive_nodes()
        groups, positions = self._groups()
        domains = {n: v.nodes[n].domain for n in alive}
        holders = place_replicas(alive, domains, self.replicas, groups, positions)
        per_node: dict[str, dict[int, tuple[str, ...]]] = {}
        for rank in range(v.world_size):
            node = v.rank_node[rank]
            addrs = tuple(v.nodes[h].data_addr for h in holders.get(node, []))
            if not addrs:
                return  # not enough live nodes to hold a replica
            per_node.setdefault(node, {})[rank] = addrs
        self.round = _Round(step=step, pending=set(range(v.world_size)), started=now)
        for node, ranks in per_node.items():
            self.io.send_node(v.nodes[node], ReplicateMsg(step=step, ranks=ranks).encode())

    def _groups(self) -> tuple[dict[str, int] | None, dict[str, int] | None]:
        """Node -> the replica group (``replicate`` index) of its ranks, when there are several,
        and node -> its place in that group (the copy group of its first rank: nodes of two
        replica groups at one place hold the same shards)."""
        mesh = self.mesh
        if mesh is None or mesh.size("replicate") < 2:
            return None, None
        out: dict[str, int] = {}
        first: dict[str, int] = {}
        for rank, node in self.view.rank_node.items():
            if node is not None and rank < mesh.world_size:
                g = mesh.coords(rank)["replicate"]
                out[node] = min(out.get(node, g), g)
                first[node] = min(first.get(node, rank), rank)
        return out, {node: mesh.copy_group(rank) for node, rank in first.items()}

    def on_replicated(self, node: str, msg: ReplicatedMsg) -> None:
        """A node's answer for one rank of the round."""
        rd = self.round
        if rd is None or msg.step != rd.step:
            return
        if not msg.ok:
            self.totals["failed_rounds"] += 1
            self.broadcast_committed()  # release the failed round's holds
            self._retry_at = self.clock.monotonic() + ROUND_RETRY_S
            if self.totals["failed_rounds"] <= 3 or self.totals["failed_rounds"] % 100 == 0:
                self.events.emit(
                    ev.ReplicationFailed(
                        step=rd.step, node=node, error=msg.error, failed_rounds=self.totals["failed_rounds"]
                    )
                )
            self.round = None
            return
        rd.pending.discard(msg.rank)
        rd.raw += msg.raw
        rd.wire += msg.wire
        if rd.pending:
            return
        self.round = None
        self.view.replicated_step = rd.step
        self.broadcast_committed()
        self.totals["rounds"] += 1
        self.totals["raw_bytes"] += rd.raw
        self.totals["wire_bytes"] += rd.wire
        now = self.clock.monotonic()
        if now - self._event_at >= REPLICATED_EVENT_EVERY_S:
            self._event_at = now
            self.events.emit(
                ev.Replicated(
                    step=rd.step,
                    seconds=now - rd.started,
                    raw_bytes=rd.raw,
                    wire_bytes=rd.wire,
                    rounds=self.totals["rounds"],
                )
            )

    def broadcast_committed(self) -> None:
        """Tell every live node the replicated step (it releases older replicas' holds)."""
        for name in self.view.alive_nodes():
            self.io.send_node(self.view.nodes[name], CommittedMsg(step=self.view.replicated_step).encode())
