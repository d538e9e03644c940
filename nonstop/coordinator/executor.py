"""The coordinator's I/O: the one place that sends on channels, spawns and kills through node
agents, and asks nodes for work whose answer comes back later (a request id).

Operations (recovery, swaps, replication, the store) decide; they act only through an
:class:`Executor`, so a test can drive them with fake channels and read what was sent.

Threading: the coordinator's thread only. A send on a channel that broke is dropped (the
peer's loss is detected on its own: an exit, a lease, a closed channel).
"""

from __future__ import annotations

import itertools
import signal

from nonstop import events as ev
from nonstop.control.channel import Channel, Message
from nonstop.coordinator.clock import SYSTEM_CLOCK, Clock
from nonstop.coordinator.torch_env import rank_env
from nonstop.coordinator.view import JobView, NodeRecord, Role, WorkerRecord
from nonstop.errors import ControlError
from nonstop.events.log import EventLog
from nonstop.protocol.agent import (
    AgentRequestMsg,
    FetchRequestMsg,
    InstalledMsg,
    InventoryMsg,
    KillMsg,
    LostMsg,
    SpawnMsg,
)

__all__ = ["Executor"]


class Executor:
    """Sends, spawns, kills and requests on behalf of the coordinator (see the module docstring).

    ``replies`` holds the answers to requests that arrived (``inventory``, ``installed``, a
    node's loss); ``pending`` maps a request in flight to the node asked."""

    def __init__(self, view: JobView, events: EventLog, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.view = view
        self.events = events
        self._req = itertools.count()
        self.replies: dict[int, InventoryMsg | InstalledMsg | LostMsg] = {}
        self.pending: dict[int, str] = {}

    # -- channels ----------------------------------------------------------------------------------
    def send(self, w: WorkerRecord, msg: Message) -> None:
        if w.chan is not None and not w.chan.closed:
            try:
                w.chan.send(msg)
            except ControlError:
                pass

    def send_node(self, node: NodeRecord, msg: Message) -> None:
        if node.alive and node.chan is not None and not node.chan.closed:
            try:
                node.chan.send(msg)
            except ControlError:
                pass

    def send_to(self, name: str, msg: Message) -> bool:
        """Send to node ``name``'s agent; whether it is there to receive it."""
        node = self.view.nodes.get(name)
        if node is None or not node.alive or node.chan is None or node.chan.closed:
            return False
        self.send_node(node, msg)
        return True

    def answer(self, chan: Channel, msg: Message) -> None:
        """Send ``msg`` on ``chan``, a channel no worker or node record holds (a client's, or a
        peer's not admitted yet). Unlike the sends above, a broken channel raises
        :class:`~nonstop.errors.ControlError`: the caller decides what that costs."""
        chan.send(msg)

    def tell(self, chan: Channel, msg: Message) -> None:
        """Send ``msg`` on ``chan``, a channel no live record holds (a peer refused at its hello,
        a node being lost); like the record sends, a broken channel drops it."""
        try:
            chan.send(msg)
        except ControlError:
            pass

    def close(self, chan: Channel) -> None:
        """Close ``chan`` (its peer's loss then follows as its close event)."""
        chan.close()

    def send_members(self, msg: Message) -> None:
        for sid in self.view.members.values():
            self.send(self.view.workers[sid], msg)

    # -- processes ---------------------------------------------------------------------------------
    def spawn(self, node: str, role: Role, rank: int | None) -> int:
        """Have ``node``'s agent start a process (``rank``: it plays that rank); its spawn id."""
        sid = self.view.add_worker(node, role, rank, self.clock.monotonic()).spawn_id
        # a rank: the agent labels the process's output with it (workerlog.py); env: torchrun's,
        # before the script starts
        env = None if rank is None else rank_env(self.view, sid, rank)
        self.send_node(
            self.view.nodes[node], SpawnMsg(spawn_id=sid, role=str(role), rank=rank, env=env).encode()
        )
        self.events.emit(ev.Spawn(spawn_id=sid, role=str(role), rank=rank, node=node))
        return sid

    def kill(self, sid: int, sig: int = signal.SIGKILL, *, unless_moving: bool = False) -> None:
        """Have ``sid``'s agent send it ``sig``; ``unless_moving``: SIGKILL only if the agent sees
        it stuck, and answer either way (``judged``: ``agent/silence.py``)."""
        node = self.view.nodes.get(self.view.node_of(sid))
        if node is not None:
            self.send_node(node, KillMsg(spawn_id=sid, sig=int(sig), unless_moving=unless_moving).encode())

    # -- requests to nodes -------------------------------------------------------------------------
    def request(self, node: NodeRecord, ask: AgentRequestMsg) -> int:
        """Send ``ask`` with a fresh request id (its ``id``, last on the wire); a node already
        lost is answered at once."""
        req = next(self._req)
        if not node.alive:  # nobody is there to answer
            self.replies[req] = LostMsg(id=req, error=f"node {node.name} lost")
            return req
        self.pending[req] = node.name
        self.send_node(node, ask.with_id(req).encode())
        return req

    def fetch(
        self,
        target: str,
        rank: int,
        step: int,
        source: str,
        kind: str,
        *,
        as_rank: int | None = None,
        base: int | None = None,
        track: bool = False,
        into: str = "local",
    ) -> int:
        """Ask ``target``'s agent to copy ``rank``'s snapshot of ``step`` from ``source``'s memory
        (``kind``: its own ranks' ``local`` slots or the ``replica`` s it holds) into its slots of
        ``as_rank`` (default ``rank``); a request id, answered by a ``fetched`` message.
        ``track`` / ``base``: a catch-up (the step comes as a delta against ``base``, which the
        last tracked fetch brought). ``into="replica"``: into the replica slots it keeps of
        ``rank`` instead (an old rank's step for a reshard, read there by the new ranks)."""
        ask = FetchRequestMsg(
            rank=rank,
            step=step,
            addr=self.view.nodes[source].data_addr,
            kind=kind,
            as_rank=as_rank if as_rank != rank else None,
            base=base,
            track=track,
            into=into,
        )
        return self.request(self.view.nodes[target], ask)

    def node_lost(self, name: str, *, keep: set[int]) -> None:
        """Node ``name`` is gone: its requests in flight are answered as lost, except ``keep``
        (fetches, which end with their generation)."""
        for req, n in list(self.pending.items()):
            if n == name and req not in keep:
                self.replies.setdefault(req, LostMsg(id=req, error=f"node {name} lost"))

    def on_reply(self, reply: InventoryMsg | InstalledMsg) -> None:
        """A node answered request ``reply.id``: kept in ``replies`` for whoever asked."""
        self.replies[reply.id] = reply

    def done(self, req: int) -> None:
        """Request ``req`` is answered or abandoned."""
        self.pending.pop(req, None)
