"""What a generation asks before its plan, and the answers as the pending plan's events.

:class:`PlanAsks` is the I/O side of :class:`~nonstop.policy.planning.Pending` (the pure wait):
it asks every live node for its inventory, and -- a recovery with ``--snapshot-every`` > 1 and
``--rescue-wait`` > 0 -- asks every present rank to leave its step (``leave``), so that each
reports what it rescued (:mod:`nonstop.policy.rescue`); then it turns what has come in (inventory
replies, lost nodes, fault reports, the time) into ``Pending`` events, and the reports into a
:class:`~nonstop.policy.rescue.Rescue` for the plan.

Threading: the coordinator's thread only (replies arrive through its executor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from nonstop.policy.planning import (
    Answered,
    NodeGone,
    Pending,
    PlanNow,
    Replan,
    Reported,
    Waited,
)
from nonstop.policy.rescue import Report, Rescue, gather
from nonstop.protocol import wire
from nonstop.protocol.agent import InventoryRequestMsg
from nonstop.protocol.worker import LeaveMsg

if TYPE_CHECKING:
    from nonstop.coordinator.executor import Executor
    from nonstop.coordinator.view import JobView
    from nonstop.mesh import MeshSpec

__all__ = ["PLAN_WAIT_S", "PlanAsks"]

PLAN_WAIT_S = 3.0  # longest planning waits for the nodes' inventories


class PlanAsks:
    """The questions of the generation being planned (see the module docstring)."""

    def __init__(
        self,
        *,
        view: JobView,
        io: Executor,
        rescue_wait_s: float,
        mesh: MeshSpec | None,
        rescues: Callable[[], bool],
    ) -> None:
        """``rescue_wait_s``: how long a plan waits for the survivors' rescues (``--rescue-wait``);
        ``rescues``: whether steps go unsnapshotted now, so the survivors have rescues to report
        (:attr:`WorkerProtocol.rescues <nonstop.coordinator.workers.WorkerProtocol.rescues>`)."""
        self.view = view
        self.io = io
        self.rescue_wait_s = rescue_wait_s
        self.mesh = mesh
        self.rescues_on = rescues
        self.inventory_reqs: dict[int, str] = {}  # request id -> node

    def ask(self, p: Pending, now: float) -> list[PlanNow]:
        """Ask the live nodes' inventories (and the present ranks' rescues) for ``p``."""
        view = self.view
        nodes = view.alive_nodes()
        self.inventory_reqs = {self.io.request(view.nodes[n], InventoryRequestMsg()): n for n in nodes}
        rescues = p.rescue and bool(p.failures) and self.rescues_on() and self.rescue_wait_s > 0
        out = p.ask(
            set(nodes),
            deadline=now + PLAN_WAIT_S,
            rescuing=set(view.members) if rescues else set(),
            rescue_deadline=now + self.rescue_wait_s,
        )
        if rescues:
            self._ask_to_leave(p)
        return out

    def _ask_to_leave(self, p: Pending) -> None:
        """Ask every present rank that has not reported its fault to leave its step now and
        report what it rescued: one blocked in a collective on a survivor (a sharded job's group
        that a survivor parked, train/settle.py) would otherwise never report."""
        msg = LeaveMsg(
            gen=self.view.generation, recovery=True, lost=tuple(sorted({f.rank for f in p.failures}))
        ).encode()
        for sid in self.view.members.values():
            w = self.view.workers.get(sid)
            if w is not None and w.chan is not None and w.rescue is None:
                self.io.send(w, msg)

    def events(self, p: Pending, now: float) -> list[PlanNow | Replan]:
        """Feed ``p`` what came in: the nodes' answers (an error reply or a lost node: planned
        without its memory), the present ranks' reports (a dead one's: nothing), the time."""
        view = self.view
        out: list[PlanNow | Replan] = []
        replies = self.io.replies
        for req, node in self.inventory_reqs.items():
            msg = replies.get(req)
            if not view.nodes[node].alive:
                out += p.on_event(NodeGone(node, now))
            elif isinstance(msg, wire.Inventory):
                out += p.on_event(Answered(node, msg.local, msg.replicas, now))
            elif msg is not None:
                out += p.on_event(NodeGone(node, now))
        for rank in sorted(p.rescuing):
            sid = view.members.get(rank)
            w = view.workers.get(sid) if sid is not None else None
            if w is None or not w.live:
                out += p.on_event(Reported(rank, None, None, now))
            elif w.rescue is not None:
                out += p.on_event(Reported(rank, w.rescue[0], w.rescue[1], now))
        return out + p.on_event(Waited(now))

    def drop(self) -> None:
        """Forget the inventory requests (answered, or asked for a generation not planned now)."""
        for req in self.inventory_reqs:
            self.io.replies.pop(req, None)
            self.io.done(req)
        self.inventory_reqs = {}

    def rescue(self, reports: Mapping[int, Report]) -> Rescue | None:
        """What the present ranks rescued together, with a sharded job's copy groups: a
        replaced rank takes the rescue of a survivor holding its shards."""
        if not reports:
            return None
        v, mesh = self.view, self.mesh
        groups = {r: mesh.copy_group(r) for r in range(v.world_size)} if mesh is not None else None
        return gather(reports, set(v.members), v.rank_node, groups)
