"""Requests from people's tools (``nonstop status``, ``persist``, ``migrate``, ``drain``) on
authenticated client channels, and the job status they are shown.

A request that cannot be honoured gets an error answer naming why; a migration or drain is
answered ``accepted`` at once and ``migrated`` per rank when its move ends; a persist is
answered when the durable tier holds the step.

Threading: the coordinator's thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nonstop.control.channel import Channel, Message
from nonstop.errors import ControlError
from nonstop.protocol.base import kind_of
from nonstop.protocol.client import AcceptedMsg, ErrorMsg, MigratedMsg, PersistedMsg, StatusMsg
from nonstop.protocol.wire import Drain, Migrate, PersistRequest, StatusRequest, decode_client

if TYPE_CHECKING:
    from nonstop.coordinator.loop import Coordinator

__all__ = ["ClientRequests"]


class ClientRequests:
    """Connected clients and the persist requests they wait on (see the module docstring)."""

    def __init__(self, c: Coordinator) -> None:
        self.c = c
        self.channels: dict[int, Channel] = {}
        self.tickets: list[tuple[Channel, int]] = []  # a client waiting for a persist, its ticket

    def on_request(self, chan: Channel, msg: Message) -> None:
        """One request, decoded (:func:`~nonstop.protocol.wire.decode_client`) and answered."""
        req = decode_client(msg)
        if isinstance(req, Migrate | Drain):
            if isinstance(req, Migrate):
                assert req.rank is not None
                moves = [(req.rank, req.to)]
            else:
                if req.node not in self.c.view.nodes:
                    chan.send(
                        MigratedMsg(rank=None, ok=False, error=f"no node {req.node} in the job").encode()
                    )
                    return
                moves = [(r, None) for r, n in sorted(self.c.view.rank_node.items()) if n == req.node]
            reason = "migrate" if isinstance(req, Migrate) else "drain"
            for rank, target in moves:
                error = self.c.swaps.request_migration(rank, target, reason)
                if error is not None:
                    chan.send(MigratedMsg(rank=rank, ok=False, error=error).encode())
                else:
                    self.c.swaps.clients.setdefault(rank, []).append(chan)
            chan.send(AcceptedMsg(ranks=tuple(r for r, _ in moves)).encode())
        elif isinstance(req, StatusRequest):
            chan.send(StatusMsg(status=self.status()).encode())
        elif isinstance(req, PersistRequest):
            if self.c.persister is None:
                chan.send(PersistedMsg(error="this job has no durable tier on this node").encode())
                return
            self.tickets.append((chan, self.c.persister.request()))
        else:
            chan.send(ErrorMsg(error=f"unknown request {kind_of(msg)!r}").encode())

    def status(self) -> dict[str, Any]:
        """What ``nonstop status`` shows (JSON types)."""
        spares: dict[str, int] = {}
        for node in self.c.view.idle_spares().values():
            spares[node] = spares.get(node, 0) + 1
        return {
            "job_id": self.c.job_id,
            "state": str(self.c.view.phase),
            "generation": self.c.view.generation,
            "world_size": self.c.view.world_size,
            "ranks": {
                str(r): {
                    "node": self.c.view.rank_node.get(r),
                    "spawn_id": sid,
                    # a member planned but not spawned yet has no process record
                    "pid": w.pid if (w := self.c.view.workers.get(sid)) is not None else None,
                    # its process has connected (a cold one a spare took over from never does as
                    # this rank: it waits as a spare)
                    "connected": w is not None and w.chan is not None,
                    "step": self.c.view.latest_step.get(r),
                }
                for r, sid in sorted(self.c.view.members.items())
            },
            "nodes": {
                n: {
                    "alive": rec.alive,
                    "quarantined": rec.quarantined,
                    "domain": rec.domain,
                    "ranks": sorted(r for r, nn in self.c.view.rank_node.items() if nn == n),
                    "idle_spares": spares.get(n, 0),
                    "failures": len(rec.failure_times),
                }
                for n, rec in sorted(self.c.view.nodes.items())
            },
            "committed_step": self.c.committed(),
            "replicated_step": self.c.view.replicated_step,
            "durable_step": self.c.rounds.last_step if self.c.rounds is not None else None,
            "durable_url": self.c.durable_url,
            "failures": self.c.view.failures_total,
            **self.c.swaps.status(),
            **self.c.health.status(),  # issue 21: stragglers, graded failures, probe verdicts
            "num_shards": self.c.num_shards,
            "full_world_size": self.c.config.world_size,
            "min_world_size": self.c.elastic.min_world_size,
            "shards": {
                str(r): list(sh) for r, sh in enumerate(self.c.resize.data_shards(self.c.view.world_size))
            },
            "store": self.c.config.store,
        }

    def answer_persists(self) -> None:
        if not self.tickets or self.c.persister is None:
            return
        pending = []
        for chan, ticket in self.tickets:
            if not self.c.persister.wait(ticket, 0):
                pending.append((chan, ticket))
                continue
            last = self.c.persister.last
            reply = PersistedMsg(
                error=self.c.persister.last_error,
                step=None if last is None else last.step,
                url=None if last is None else self.c.persister.durable.url,
                stored_bytes=None if last is None else last.stored_bytes,
            ).encode()
            try:
                chan.send(reply)
            except ControlError:
                pass
        self.tickets = pending
